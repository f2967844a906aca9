"""The coordinator prepares the next batch while the ranks train, only where staleness allows, and what it
prepared is consumed only once it goes to the ranks (issue 17, item 5).

Real parts: the coordinator, the tiny model on the transformers engine (weights reloaded from disk after
each step), one DeepSpeed ZeRO-2 rank on the CPU, the file protocol, the consumed journal, metrics.jsonl.
The episodes are finished episodes handed straight to the collector, as the server's recorder hands them.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from coordinator_support import REPEATS, coordinator_for, finished

from ajet_hpc.engine.select import create_engine
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.coordinator.channel import TrainerChannel
from ajet_hpc.trainer.coordinator.collector import BatchCollector
from ajet_hpc.trainer.coordinator.loop import Coordinator
from ajet_hpc.trainer.protocol.step_result import StepResult

pytestmark = pytest.mark.slow


def journal(coordinator: Coordinator) -> list[dict]:
    return [json.loads(line) for line in coordinator.journal.path.read_text().splitlines()]


async def stop_when(coordinator: Coordinator, ready, timeout_s: float = 600) -> None:
    """Wait until ``ready()``, then do what the server does on Slurm's signal: ``save_on_signal`` on the
    event loop's thread, blocking it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not ready():
        if loop.time() > deadline:
            raise TimeoutError("the coordinator never reached the state to stop in")
        await asyncio.sleep(0.02)
    assert coordinator.save_on_signal(300) == 2


def test_the_next_batch_is_prepared_while_a_step_trains_and_consumed_only_when_sent(
    tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_staleness 2: batches 2 and 3 are built while steps 1 and 2 train. The job is told to stop while
    step 2 trains: step 2 is waited for, recorded and checkpointed; batch 3, built already, never went to the
    ranks, so the journal does not name its episodes (a restarted server trains them).

    The tiny model's step 1 can end before batch 2's build on a loaded machine (a CI run did: the row then
    says, truly, that batch 2 was not ready ahead). So the coordinator sees step 1's result only once the
    build it started while the step trained is over; a coordinator that never started it fails here."""

    async def scenario() -> Coordinator:
        engine = create_engine("transformers", tiny_model, max_model_len=1024)
        await engine.start()
        coordinator = coordinator_for(tmp_path, engine, total_steps=3, max_staleness=2, save_every=100)
        real_wait = TrainerChannel.wait_result

        async def result_after_batch_2(channel: TrainerChannel, step: int, *args, **kwargs) -> StepResult:
            result = await real_wait(channel, step, *args, **kwargs)
            deadline = time.monotonic() + 300
            while step == 1 and not (
                coordinator.batches.ahead is not None and coordinator.batches.ahead.done()
            ):
                assert time.monotonic() < deadline, "batch 2 was never prepared while step 1 trained"
                await asyncio.sleep(0.01)
            return result

        monkeypatch.setattr(TrainerChannel, "wait_result", result_after_batch_2)
        for task in ("t0", "t1", "t2"):
            for repeat in range(REPEATS):
                coordinator.collector.add(finished(engine.tokenizer, task, repeat, version=0))

        def step_2_trains_and_batch_3_is_built() -> bool:
            flight, ahead = coordinator._in_flight, coordinator.batches.ahead
            return (
                flight is not None
                and flight.step == 2
                and flight.submitted
                and ahead is not None
                and ahead.done()
                and not (tmp_path / "run" / "ckpt" / "policy" / "outbox" / "step-000002.json").exists()
            )

        training = asyncio.create_task(coordinator.run())
        await stop_when(coordinator, step_2_trains_and_batch_3_is_built)
        assert coordinator.batches.ahead is not None
        prepared = coordinator.batches.ahead.result()
        assert prepared.step == 3 and {e.task_id for e in prepared.batch.episodes} == {"t2"}
        training.cancel()  # the server's shutdown after the save
        await asyncio.gather(training, return_exceptions=True)
        await engine.stop()
        return coordinator

    coordinator = asyncio.run(scenario())
    rows = metrics.read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert [row["prepared_ahead"] for row in rows] == [False, True]
    for row in rows:
        assert row["coordinator_s"] > 0 and row["train_time_s"] > 0 and row["weight_sync_s"] >= 0
    first, second = rows
    assert first["coordinator_critical_s"] == pytest.approx(first["coordinator_s"], abs=1e-3)
    assert second["coordinator_critical_s"] < second["coordinator_s"]  # the build was off the critical path
    assert [(j["step"], sorted(j["trained"])) for j in journal(coordinator)] == [
        (1, ["t0-r0", "t0-r1"]),
        (2, ["t1-r0", "t1-r1"]),
    ]
    assert coordinator.channel is not None and coordinator.channel.last_checkpoint_step() == 2


def test_with_max_staleness_0_nothing_is_prepared_ahead(tmp_path: Path, tiny_model: Path) -> None:
    """Strictly on-policy: batch 2 is taken only once step 1 is recorded, even though episodes that would
    pass the staleness check for it (served by policy 1) are already waiting."""

    async def scenario() -> tuple[Coordinator, list[bool]]:
        engine = create_engine("transformers", tiny_model, max_model_len=1024)
        await engine.start()
        coordinator = coordinator_for(tmp_path, engine, total_steps=2, max_staleness=0)
        for task, version in (("t0", 0), ("t1", 1)):
            for repeat in range(REPEATS):
                coordinator.collector.add(finished(engine.tokenizer, task, repeat, version))
        seen: list[bool] = []  # while step 1 trains: was anything being prepared?

        async def watch() -> None:
            while coordinator.step < 1:
                flight = coordinator._in_flight
                if flight is not None and flight.submitted:
                    seen.append(coordinator.batches.ahead is not None)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        await coordinator.run()
        await watcher
        await engine.stop()
        return coordinator, seen

    coordinator, seen = asyncio.run(scenario())
    rows = metrics.read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    assert [row["prepared_ahead"] for row in rows] == [False, False]
    assert all(row["coordinator_critical_s"] == pytest.approx(row["coordinator_s"], abs=1e-3) for row in rows)
    assert seen and not any(seen)
    assert [j["step"] for j in journal(coordinator)] == [1, 2]


def test_a_batch_put_back_waits_in_front_and_reports_its_drops_with_the_next() -> None:
    """What the coordinator does with a batch prepared for a step that does not come (the step before it
    failed): its episodes are taken again first, its drops are reported once, nothing is lost."""
    from ajet_hpc.config import TrainerConfig
    from ajet_hpc.engine.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    collector = BatchCollector(TrainerConfig(tasks_per_batch=1, repeats=REPEATS, max_staleness=1))
    for task, version in (("old", 0), ("t0", 1), ("t1", 1)):
        for repeat in range(REPEATS):
            collector.add(finished(tokenizer, task, repeat, version))
    taken = collector.try_batch(version=2)  # prepared for step 3 while step 2 trains: "old" is too stale
    assert taken is not None and [e.task_id for e in taken.episodes] == ["t0", "t0"]
    assert taken.dropped_stale == 2 and taken.dropped_ids == ["old-r0", "old-r1"]
    collector.put_back(taken)
    again = collector.try_batch(version=1)
    assert again is not None and [e.episode_id for e in again.episodes] == ["t0-r0", "t0-r1"]
    assert again.dropped_stale == 2 and again.dropped_ids == ["old-r0", "old-r1"]  # reported once, here
    last = collector.try_batch(version=1)
    assert last is not None and last.dropped_ids == [] and [e.task_id for e in last.episodes] == ["t1", "t1"]


def test_ranks_started_with_the_engine_are_stopped_when_the_engine_fails_to_load(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The server starts the ranks before its engine (``Coordinator.prestart``, both load at once). An
    engine that cannot load (its weights file cut short: a real load error) fails the server's start, and
    the ranks started beside it are stopped, not left running on the node."""
    import shutil

    from ajet_hpc.server.app import create_app
    from ajet_hpc.server.context import ModelContext

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    engine = create_engine("transformers", broken, max_model_len=1024)
    coordinator = coordinator_for(tmp_path, engine, total_steps=1)
    assert isinstance(coordinator.host, ModelContext)
    coordinator.host.attach_trainer(coordinator)
    app = create_app(coordinator.host)

    async def start() -> None:
        async with app.lifespan():
            raise AssertionError("the server started with an engine that cannot load")

    with pytest.raises(Exception, match=r"(?i)safetensors|header|deserializ|file"):
        asyncio.run(start())
    assert coordinator.process is not None and coordinator.process.poll() is not None
    assert "torch.distributed.run" in (tmp_path / "run" / "ckpt" / "policy" / "ranks.log").read_text()
