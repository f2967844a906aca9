"""In-memory weight sync (trainer.weight_sync: memory) on the CPU path: real DeepSpeed ranks send their
weights over our gloo backend of vLLM's weight-transfer API into a running vLLM (CPU) engine, driven by the
same control calls the server makes. Three GRPO steps give the engine the same logprobs as reloading the
exported weights from disk, 2 ranks: an untied model under ZeRO-2 (the common case) and a tied one under
ZeRO-3 (the head shares the gathered embedding). The other two pairs add no code path (the sender leaves
a tied head out under either stage, the engine ties it back) and cost 40 s of CI each. A rank killed
mid-transfer fails the step with a clear error within the timeout. Slurm's signal landing during a sync
saves the step at once (the sync stops; the checkpoint carries the weights).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from pathlib import Path
from typing import Literal

import pytest
import torch
from coordinator_support import REPEATS, coordinator_for, finished
from support import tied_copy
from transformers import AutoModelForCausalLM

from ajet_hpc import fault_injection
from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.placement import cpu_placement
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.engine.base import SamplingParams, generate_all
from ajet_hpc.engine.select import vllm_available
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.coordinator.channel import TrainerChannel, TrainerFailed
from ajet_hpc.trainer.coordinator.rank_launcher import start_ranks
from ajet_hpc.trainer.protocol.checkpoints import read_trainer_state
from ajet_hpc.trainer.protocol.sync_channel import SyncServer, clear
from ajet_hpc.trainer.protocol.sync_plan import DISK, SyncPlan
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights, MemoryWeights
from ajet_hpc.trainer.protocol.work_dir import WorkDir

pytestmark = pytest.mark.slow

STEPS = 3
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def loop():
    if not vllm_available()[0]:
        why = vllm_available()[1]
        pytest.fail(why) if os.environ.get("CI", "").lower() == "true" else pytest.skip(why)
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module", params=["untied", "tied"])
def model(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "untied":
        return tiny_model
    return tied_copy(tiny_model, tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def engine(loop, model: Path):
    """One vLLM engine per model, built with the gloo transfer backend (it also reloads from disk)."""
    from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

    engine = VllmEngine(model, VllmSettings(max_model_len=256, weight_transfer_backend="ajet_gloo"))
    loop.run_until_complete(engine.start())
    yield engine
    loop.run_until_complete(engine.stop())


def batches(model: Path) -> list[list[Sample]]:
    """STEPS batches of 4 samples over real token ids, advantages +-1 on the last 6 tokens."""
    vocab = AutoModelForCausalLM.from_pretrained(model).config.vocab_size
    gen = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        samples = []
        for i in range(4):
            ids = torch.randint(10, vocab, (14,), generator=gen).tolist()
            mask = [0] * 8 + [1] * 6
            adv = 1.0 if i % 2 == 0 else -1.0
            samples.append(
                Sample(ids, mask, [0.0] * 14, [adv * m for m in mask], step, f"e{step}{i}", f"t{i}")
            )
        out.append(samples)
    return out


async def train(engine, model: Path, work: Path, config: TrainerConfig, memory: bool) -> list[dict]:
    """STEPS steps; after each, the engine's greedy answer and logprobs (and the step's result)."""
    sync = SyncPlan("ajet_gloo", 1) if memory else DISK
    server = None
    if memory:
        clear(WorkDir(work).sync)
        server = asyncio.get_running_loop().create_task(
            SyncServer(WorkDir(work).sync, engine.weight_transfer).serve()
        )
    log = work / "ranks.log"
    proc = start_ranks(
        work, model, config, on_slurm=False, placement=cpu_placement(2), log_path=log, sync=sync
    )
    channel = TrainerChannel(work, alive=lambda: proc.poll() is None, log_path=log)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which weights?"}], add_generation_prompt=True, return_dict=False
    )
    seen = []
    try:
        await channel.wait_ready(timeout_s=300)
        for step, samples in enumerate(batches(model), start=1):
            channel.submit(step, samples)
            result = await channel.wait_result(step, timeout_s=300)
            if not memory:
                assert isinstance(result.weights, DiskWeights), result.weights
                await engine.load_weights(result.weights.folder, step)
            assert engine.policy_version == step
            out = await generate_all(engine, prompt, GREEDY, f"{work.name}-{step}")
            # the disk pass also scores the answer with a transformers forward of the step's weights
            reference = None
            if isinstance(result.weights, DiskWeights):  # the disk pass
                reference = score(result.weights.folder, prompt, out.token_ids)
            seen.append(
                {"result": result, "tokens": out.token_ids, "logprobs": out.logprobs, "ref": reference}
            )
        channel.request_stop()
        await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # torchrun and the ranks (each in a session of its own)
        if server is not None:
            server.cancel()
    return seen


@pytest.mark.parametrize("model", ["untied"], indirect=True)
def test_memory_sync_gives_the_engine_what_a_disk_reload_gives_untied_zero2(
    loop, engine, model: Path, tmp_path: Path
) -> None:
    memory_equals_disk(loop, engine, model, 2, tmp_path)


def memory_equals_disk(loop, engine, model: Path, stage: Literal[1, 2, 3], tmp_path: Path) -> None:
    """STEPS steps sent in memory, then the same from disk: the engine answers the same each step."""
    config = TrainerConfig(
        zero_stage=stage, ranks=2, lr=3e-3, micro_batch_tokens=64, weight_sync_bucket_mb=1
    ).resolved(ServingConfig())
    memory = loop.run_until_complete(train(engine, model, tmp_path / "memory", config, memory=True))
    loop.run_until_complete(engine.load_weights(model, 0))  # back to the initial weights
    disk = loop.run_until_complete(train(engine, model, tmp_path / "disk", config, memory=False))
    for step, (mem, dsk) in enumerate(zip(memory, disk, strict=True), start=1):
        assert isinstance(mem["result"].weights, MemoryWeights) and isinstance(
            dsk["result"].weights, DiskWeights
        )
        assert mem["result"].weights.bytes > 0
        assert mem["tokens"] == dsk["tokens"], step
        diff = max(abs(a - b) for a, b in zip(mem["logprobs"], dsk["logprobs"], strict=True))
        assert diff <= 1e-4, (step, diff)
        # both equal a plain transformers forward of the trained weights (a tied head kept its tie)
        trained = max(abs(a - b) for a, b in zip(mem["logprobs"], dsk["ref"], strict=True))
        assert trained <= 1e-4, (step, trained)
    assert engine.last_pause_s > 0
    # the weights moved: the answer's logprobs differ from step to step
    assert memory[0]["logprobs"] != memory[-1]["logprobs"]
    # disk exports went to node-local storage, not into the work dir
    assert not (tmp_path / "disk" / "weights").exists()
    loop.run_until_complete(engine.load_weights(model, 0))


def score(folder: Path, prompt: list[int], response: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0]
    table = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return table.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("model", ["untied"], indirect=True)
def test_a_sender_killed_midway_fails_the_step_within_the_timeout(
    loop, engine, model: Path, tmp_path: Path
) -> None:
    """The rank stops before its second bucket (a test hook: a real transfer of the tiny model is over in
    milliseconds, too fast to kill in the middle), then is killed. The step ends with an error naming the
    ranks, the engine's receive gives up within weight_sync_timeout_s, and it serves again."""
    timeout_s = 15.0
    config = TrainerConfig(
        zero_stage=2,
        ranks=2,
        lr=3e-3,
        micro_batch_tokens=64,
        weight_sync_bucket_mb=1,
        weight_sync_timeout_s=timeout_s,
    ).resolved(ServingConfig())
    work = tmp_path / "killed"
    env = {**os.environ, fault_injection.SYNC_STALL_BUCKET: "1"}

    async def scenario() -> tuple[str, float, float]:
        clear(WorkDir(work).sync)
        server = asyncio.get_running_loop().create_task(
            SyncServer(WorkDir(work).sync, engine.weight_transfer).serve()
        )
        log = work / "ranks.log"
        proc = start_ranks(
            work,
            model,
            config,
            on_slurm=False,
            placement=cpu_placement(2),
            log_path=log,
            env=env,
            sync=SyncPlan("ajet_gloo", 1),
        )
        channel = TrainerChannel(work, alive=lambda: proc.poll() is None, log_path=log)
        try:
            await channel.wait_ready(timeout_s=300)
            channel.submit(1, batches(model)[0])
            deadline = time.monotonic() + 120
            while "stalling before bucket 1" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.2)
            killed = time.monotonic()
            kill_tree(proc.pid)  # torchrun and the ranks (each in a session of its own)
            with pytest.raises(TrainerFailed) as failed:
                await channel.wait_result(1, timeout_s=timeout_s)
            step_failed_after = time.monotonic() - killed
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Still there?"}], add_generation_prompt=True, return_dict=False
            )
            out = await asyncio.wait_for(
                generate_all(engine, prompt, GREEDY, "after-kill"), 2 * timeout_s + 30
            )
            assert out.token_ids
            return str(failed.value), step_failed_after, time.monotonic() - killed
        finally:
            if proc.poll() is None:
                kill_tree(proc.pid)  # torchrun and the ranks (each in a session of its own)
            server.cancel()

    message, step_failed_after, serving_after = loop.run_until_complete(scenario())
    assert "ranks" in message or "rank" in message, message
    assert step_failed_after < timeout_s
    assert serving_after < 2 * timeout_s + 30
    assert engine.last_pause_s < 2 * timeout_s + 30
    loop.run_until_complete(engine.load_weights(model, 0))


@pytest.mark.parametrize("model", ["untied"], indirect=True)
@pytest.mark.parametrize("signal_at", ["start_weight_update", "update_weights"])
def test_a_signal_during_a_sync_saves_the_step_without_waiting_for_the_blocked_loop(
    loop, engine, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_at: str
) -> None:
    """The save on Slurm's signal runs on the event loop's thread and blocks it; the in-memory sync's
    control calls need that loop. Here the signal lands during step 2's sync, where a signal handler would
    run (the loop blocked, the call unanswered):

    - ``start_weight_update``: the server's handler for that call runs ``save_on_signal`` itself, while
      rank 0 waits for its answer;
    - ``update_weights``: the sync server runs ``save_on_signal`` when it finds that call and before it
      takes it (the window CI once hit): the engine never receives, so rank 0 must not begin to send.

    Two ZeRO-3 ranks, so rank 1 sits in the layer gathers meanwhile. The save must not wait for an answer
    that cannot come: step 2 is recorded with its weights withheld, checkpointed on request, the ranks exit,
    all well within the budget; the engine serves."""
    budget_s = 120.0
    coordinator = coordinator_for(
        tmp_path,
        engine,
        ranks=2,
        zero_stage=3,
        total_steps=3,
        save_every=100,
        weight_sync="memory",
        weight_sync_timeout_s=300,  # the deadlock this test guards against would wait out the budget
        micro_batch_tokens=64,
    )
    assert coordinator.sync == SyncPlan("ajet_gloo", 1)
    real, answer = engine.weight_transfer, SyncServer._answer
    saved: dict[str, float | int | None] = {}

    def signal_now(method: str) -> bool:
        flight = coordinator._in_flight
        if method != signal_at or flight is None or flight.step != 2 or saved:
            return False
        began = time.monotonic()
        saved["step"] = coordinator.save_on_signal(budget_s)  # blocks the loop, as the handler does
        saved["seconds"] = time.monotonic() - began
        return True

    async def signal_during_start_of_step_2(method: str, argument) -> None:
        if signal_now(method):
            raise RuntimeError("the job is going down (this call is never answered to a waiting rank)")
        return await real(method, argument)

    async def signal_before_update_is_taken(server: SyncServer, path: Path) -> None:
        try:
            method = pickle.loads(path.read_bytes())["method"]
        except FileNotFoundError:  # withdrawn since the listing
            method = None
        if method is not None:
            signal_now(method)
        await answer(server, path)

    monkeypatch.setattr(engine, "weight_transfer", signal_during_start_of_step_2)
    monkeypatch.setattr(SyncServer, "_answer", signal_before_update_is_taken)

    async def scenario() -> None:
        for task in ("t0", "t1", "t2"):
            for repeat in range(REPEATS):
                coordinator.collector.add(finished(engine.tokenizer, task, repeat, version=0))
        training = asyncio.create_task(coordinator.run())
        deadline = time.monotonic() + 300
        while not saved:
            assert not training.done(), training
            assert time.monotonic() < deadline, "step 2's sync never started"
            await asyncio.sleep(0.1)
        training.cancel()  # the server's shutdown after the save
        await asyncio.gather(training, return_exceptions=True)
        assert coordinator.process is not None
        await asyncio.to_thread(coordinator.process.wait, 60)  # the ranks obeyed the stop

    try:
        loop.run_until_complete(scenario())
    finally:
        if coordinator.process is not None and coordinator.process.poll() is None:
            kill_tree(coordinator.process.pid)
    assert saved["step"] == 2
    seconds = saved["seconds"]
    assert seconds is not None and seconds < budget_s / 2, saved
    rows = metrics.read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [(row["step"], row["weight_sync"]) for row in rows] == [(1, "memory"), (2, "withheld")]
    state = read_trainer_state(WorkDir(coordinator.work_dir))
    assert state is not None and state.step == 2  # the save on the signal, not a periodic one
    assert engine.policy_version == 1  # the engine kept step 1's weights
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Still serving?"}], add_generation_prompt=True, return_dict=False
    )
    assert loop.run_until_complete(
        asyncio.wait_for(generate_all(engine, prompt, GREEDY, "after"), 60)
    ).token_ids
    loop.run_until_complete(engine.load_weights(model, 0))


@pytest.mark.parametrize("model", ["tied"], indirect=True)
def test_memory_sync_gives_the_engine_what_a_disk_reload_gives_tied_zero3(
    loop, engine, model: Path, tmp_path: Path
) -> None:
    """Last in the file: the untied model's engine serves every test above it, started once."""
    memory_equals_disk(loop, engine, model, 3, tmp_path)
