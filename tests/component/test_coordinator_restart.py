"""A trainer rank that dies after its step's checkpoint is named trusted and before the step's result reaches
the coordinator (docs/reliability.md): the step was trained and saved but never recorded, and its batch goes
to the ranks again. The ranks go back one checkpoint, so that batch is trained once and every step is
recorded once: in the same job (the coordinator restarts the ranks) and in the next one (a new coordinator
reads the last recorded step from metrics.jsonl).

Real parts: the coordinator, the tiny model on the transformers engine, one DeepSpeed ZeRO-2 rank on the
CPU, the file protocol, the consumed journal, metrics.jsonl. The rank's death is a test hook
(``AJET_TEST_EXIT_AFTER_COMMIT``, an ``os._exit`` right after the commit): the window is too short to hit
with a kill from outside, which is how the chaos test once hit it by chance.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from coordinator_support import REPEATS, close_store, coordinator_for, finished

from ajet_hpc import fault_injection
from ajet_hpc.engine.select import create_engine
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.protocol.checkpoints import read_trainer_state
from ajet_hpc.trainer.protocol.work_dir import WorkDir

pytestmark = pytest.mark.slow


async def train(
    tmp_path: Path, tiny_model: Path, tasks: list[str], exit_after: int | None, **trainer
) -> None:
    """A coordinator over ``tasks`` (one batch each, served by policy 0) until its last step."""
    engine = create_engine("transformers", tiny_model, max_model_len=1024)
    await engine.start()
    try:
        rank_env = (
            None if exit_after is None else {**os.environ, fault_injection.EXIT_AFTER_COMMIT: str(exit_after)}
        )
        coordinator = coordinator_for(tmp_path, engine, rank_env, save_every=1, max_staleness=3, **trainer)
        try:
            for task in tasks:
                for repeat in range(REPEATS):
                    coordinator.collector.add(finished(engine.tokenizer, task, repeat, version=0))
            await coordinator.run()
        finally:
            close_store(coordinator)  # as the server stops: the next job's server opens it again
    finally:
        await engine.stop()


def trained_steps(coordinator_dir: Path) -> dict[str, int]:
    from ajet_hpc.trainer.coordinator.journal import ConsumedJournal

    return ConsumedJournal(coordinator_dir / "consumed.jsonl").read().trained


def test_a_step_saved_but_not_recorded_is_trained_once_after_a_rank_restart(
    tmp_path: Path, tiny_model: Path
) -> None:
    asyncio.run(train(tmp_path, tiny_model, ["t0", "t1", "t2"], exit_after=2, total_steps=3))
    run = tmp_path / "run"
    assert [row["step"] for row in metrics.read_rows(run / "metrics.jsonl")] == [1, 2, 3]
    (restart,) = metrics.read_events(run / "metrics.jsonl", "policy")
    assert (restart["event"], restart["at_step"]) == ("trainer_restart", 2)
    work = run / "ckpt" / "policy"
    log = (work / "ranks.log").read_text()
    assert "test hook AJET_TEST_EXIT_AFTER_COMMIT: exiting after the commit of step 2" in log
    assert (
        "checkpoint step-000002 is past step 1, the last the server recorded: resuming from step-000001"
        in log
    )
    # each task's episodes trained in one step, and step 2 is t1's (not t1's again as step 3)
    assert trained_steps(work) == {"t0-r0": 1, "t0-r1": 1, "t1-r0": 2, "t1-r1": 2, "t2-r0": 3, "t2-r1": 3}
    state = read_trainer_state(WorkDir(work))
    assert state is not None and state.previous is not None
    assert state.step == 3 and state.previous.step == 2


def test_the_next_job_goes_back_from_a_checkpoint_its_metrics_never_recorded(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The rank dies after the first checkpoint; with ``max_restarts: 0`` the server fails. The next job (a
    new coordinator on the same run) finds step 1 saved but not in metrics.jsonl: its ranks start afresh."""
    asyncio.run(train(tmp_path, tiny_model, ["t0"], exit_after=1, total_steps=2, max_restarts=0))
    run, work = tmp_path / "run", tmp_path / "run" / "ckpt" / "policy"
    (failed,) = metrics.read_events(run / "metrics.jsonl", "policy")
    assert failed["event"] == "failed" and "trainer.max_restarts=0" in failed["reason"]
    state = read_trainer_state(WorkDir(work))
    assert metrics.read_rows(run / "metrics.jsonl") == [] and state is not None and state.step == 1

    asyncio.run(train(tmp_path, tiny_model, ["t0", "t1"], exit_after=None, total_steps=2))
    assert [row["step"] for row in metrics.read_rows(run / "metrics.jsonl")] == [1, 2]
    log = (work / "ranks.log").read_text()
    assert "checkpoint step-000001 is past step 0, the last the server recorded: starting afresh" in log
    assert trained_steps(work) == {"t0-r0": 1, "t0-r1": 1, "t1-r0": 2, "t1-r1": 2}
