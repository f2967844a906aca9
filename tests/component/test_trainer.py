"""The trainer for real: torchrun, DeepSpeed ZeRO-2/3 on 2 CPU ranks (gloo), the tiny model, the file
protocol, weight export into the vLLM engine, checkpoint and resume.

The reference for every step is one AdamW step in plain torch, in this process, on the whole batch as one
micro-batch: equal weights (and loss, grad norm) prove that sharding, micro-batching with zero-weight
padding, the step-wide normalizer and DeepSpeed's gradient reduction add up to the batch's gradient.
The fast tests at the top check the pure parts (plans, rank variables, command lines, protocol files).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ajet_hpc.algo.grpo import policy_loss, token_logprobs
from ajet_hpc.algo.sample_tensors import Sample, collate
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.placement import cpu_placement
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.trainer.coordinator.channel import TrainerChannel, TrainerFailed
from ajet_hpc.trainer.coordinator.rank_launcher import hostfile_lines, rank_command, start_ranks
from ajet_hpc.trainer.protocol.batch_file import read_batch
from ajet_hpc.trainer.protocol.checkpoints import RESUME_LIMIT_VAR, TrainerState, read_trainer_state
from ajet_hpc.trainer.protocol.step_result import StepResult, write_error
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights
from ajet_hpc.trainer.protocol.work_dir import WorkDir, step_name
from ajet_hpc.trainer.ranks import zero
from ajet_hpc.trainer.ranks.distributed import rank_env, shard_by_tokens
from ajet_hpc.trainer.ranks.step import plan_micro_batches
from ajet_hpc.trainer.ranks.worker import export_root

LR = 1e-3
BUDGET = 48  # micro_batch_tokens: the plan below gives the ranks 1 and 2 micro-batches
LENGTHS = (44, 12, 14, 10, 9)
START_TIMEOUT_S = 300
STEP_TIMEOUT_S = 120


def run(coroutine):
    return asyncio.run(coroutine)


# ---- fast: the pure parts ------------------------------------------------------------------------------


def fake_samples(lengths: tuple[int, ...]) -> list[Sample]:
    return [
        Sample([1] * n, [0] * (n - 2) + [1, 1], [0.0] * n, [0.0] * n, 0, f"e{i}", "t")
        for i, n in enumerate(lengths)
    ]


def test_shards_balance_tokens_and_cover_every_sample_once() -> None:
    assert shard_by_tokens([44, 12, 14, 10, 9], 2) == [[0], [1, 2, 3, 4]]
    assert shard_by_tokens([5, 5, 5], 2) == [[0, 2], [1]]
    assert shard_by_tokens([7], 3) == [[0], [], []]


def test_plan_pads_every_rank_to_the_same_number_of_micro_batches() -> None:
    samples = fake_samples(LENGTHS)
    plans = [plan_micro_batches(samples, 2, rank, BUDGET) for rank in range(2)]
    assert [len(p) for p in plans] == [2, 2]
    assert [(m.indices, m.scale) for m in plans[0]] == [([0], 1.0), ([0], 0.0)]  # one zero-weight pass
    assert [m.scale for m in plans[1]] == [1.0, 1.0]
    trained = sorted(i for plan in plans for m in plan if m.scale for i in m.indices)
    assert trained == list(range(len(samples)))
    # More ranks than samples: the idle rank runs the batch's first sample at zero weight.
    assert [(m.indices, m.scale) for m in plan_micro_batches(samples[:1], 2, 1, BUDGET)] == [([0], 0.0)]


def test_rank_variables_from_torchrun_and_from_srun() -> None:
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert rank_env(torchrun).rank == 1
    srun = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "g[1-4]",
        "MASTER_PORT": "1234",
    }
    env = rank_env(srun, hostnames=lambda nodelist: {"g[1-4]": ["g1", "g2", "g3", "g4"]}[nodelist])
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (
        5,
        8,
        1,
        "g1",
        1234,
    )
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        rank_env({k: v for k, v in srun.items() if k != "MASTER_PORT"})


def test_rank_commands() -> None:
    config = TrainerConfig(ranks=4)
    local = rank_command(Path("/w"), Path("/m"), config, on_slurm=True, ranks_per_node=[4], python="py")
    assert local[:6] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=4",
        "--module",
    ]
    assert local[6:11] == ["ajet_hpc.trainer.ranks.worker", "--work-dir", "/w", "--model", "/m"]
    assert TrainerConfig.model_validate_json(local[-1]) == config
    # split placement on 2 nodes of 8 GPUs, engine on 2: 6 ranks on the first node, 8 on the second
    multi = rank_command(Path("/w"), Path("/m"), config, on_slurm=True, ranks_per_node=[6, 8], python="py")
    assert multi[:4] == ["srun", "--nodes=2", "--ntasks=14", "--distribution=arbitrary"]
    assert multi[multi.index("py") : multi.index("py") + 3] == ["py", "-m", "ajet_hpc.trainer.ranks.worker"]
    assert hostfile_lines(["g1", "g2", "g3"], [2, 3]) == ["g1", "g1", "g2", "g2", "g2"]
    with pytest.raises(ValueError, match="Slurm"):
        rank_command(Path("/w"), Path("/m"), config, on_slurm=False, ranks_per_node=[4, 4], python="py")
    with pytest.raises(ValueError, match="allocation has 1 node"):
        hostfile_lines(["g1"], [2, 3])


def test_channel_submits_reports_errors_and_notices_dead_ranks(tmp_path: Path) -> None:
    samples = fake_samples((5, 3))
    alive = [True]
    channel = TrainerChannel(tmp_path, alive=lambda: alive[0])
    work = WorkDir(tmp_path)
    write_error(work, 1, "stale error of an abandoned run")
    channel.submit(1, samples, save_checkpoint=True)  # clears the stale result
    batch = read_batch(work.batch_file(1))
    assert (batch.step, batch.save_checkpoint, batch.samples) == (1, True, samples)
    with pytest.raises(TimeoutError):
        run(channel.wait_result(1, timeout_s=0.1))
    write_error(work, 1, "rank 1: boom")
    with pytest.raises(TrainerFailed, match="rank 1: boom"):
        run(channel.wait_result(1))
    alive[0] = False
    with pytest.raises(TrainerFailed, match="exited"):
        run(channel.wait_result(2))
    assert channel.last_checkpoint_step() is None
    channel.request_stop()
    assert work.stop.exists()


# ---- slow: real ranks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batches(tiny_model: Path) -> list[list[Sample]]:
    return make_batches(tiny_model)


def make_batches(tiny_model: Path) -> list[list[Sample]]:
    """Two batches of random-token samples; the last tokens are trained, with old logprobs from the initial
    model (ratio 1 at step 1) and alternating advantages."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    out = []
    for b in range(2):
        samples = []
        for i, n in enumerate(LENGTHS):
            ids = torch.randint(7, vocab, (n,), generator=generator)
            with torch.no_grad():
                logprobs = token_logprobs(model(ids[None]).logits, ids[None])[0]
            mask = [0] * (n // 2) + [1] * (n - n // 2)
            advantage = (1.0 if i % 2 else -0.5) * (b + 1)
            samples.append(
                Sample(
                    token_ids=ids.tolist(),
                    loss_mask=mask,
                    old_logprobs=[lp * m for lp, m in zip(logprobs.tolist(), mask, strict=True)],
                    advantages=[advantage * m for m in mask],
                    policy_version=0,
                    episode_id=f"b{b}-e{i}",
                    task_id=f"t{i // 2}",
                    weight=1.0 + 0.25 * i,
                )
            )
        out.append(samples)
    return out


def reference_step(model_dir: Path, samples: list[Sample], config: TrainerConfig) -> tuple[dict, dict]:
    """One plain-torch AdamW step on the whole batch: (weights after it, {"loss", "grad_norm"})."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=zero.ADAM_BETAS,
        eps=zero.ADAM_EPS,
        weight_decay=zero.WEIGHT_DECAY,
    )
    batch = collate(samples, model.config.pad_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logprobs = token_logprobs(logits, batch["input_ids"])
    loss, _ = policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        clip_eps=config.clip_eps,
        clip_eps_high=config.clip_eps_high,
        kl_coef=config.kl_coef,
        ref_logprobs=logprobs.detach() if config.kl_coef > 0 else None,  # the reference is the model
        weights=batch["weights"],
        normalizer=float(sum(sum(s.loss_mask) for s in samples)),
    )
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, {
        "loss": loss.item(),
        "grad_norm": grad_norm,
    }


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(path))
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class Ranks:
    """Started ranks with their channel; ``stop()`` waits for a clean exit, ``kill()`` terminates."""

    def __init__(
        self, work_dir: Path, model_dir: Path, config: TrainerConfig, recorded: int | None = None
    ) -> None:
        """``recorded``: the last step the coordinator recorded, as it tells the ranks it starts."""
        self.log = work_dir / "ranks.log"
        env = None if recorded is None else {**os.environ, RESUME_LIMIT_VAR: str(recorded)}
        self.proc = start_ranks(
            work_dir,
            model_dir,
            config,
            on_slurm=False,
            placement=cpu_placement(config.ranks),
            log_path=self.log,
            env=env,
        )
        self.channel = TrainerChannel(work_dir, alive=lambda: self.proc.poll() is None, log_path=self.log)
        self.ready = run(self.channel.wait_ready(timeout_s=START_TIMEOUT_S))

    def step(self, step: int, samples: list[Sample], save_checkpoint: bool = False) -> StepResult:
        self.channel.submit(step, samples, save_checkpoint)
        return run(self.channel.wait_result(step, timeout_s=STEP_TIMEOUT_S))

    def stop(self) -> int:
        """Asks the ranks to stop; their exit status (a failure prints the ranks' log, to say why)."""
        self.channel.request_stop()
        code = self.proc.wait(timeout=60)
        if code != 0:
            print(f"ranks exited {code}; the end of {self.log.name}:")
            print("\n".join(self.log.read_text(errors="replace").splitlines()[-60:]))
        return code

    def kill(self) -> None:
        """A crash: SIGKILL to torchrun and every rank (a SIGTERM alone they ignore until asked to stop,
        and torchrun puts each rank in a session of its own, so no process group holds them all)."""
        kill_tree(self.proc.pid)
        self.proc.wait()


def exported(result: StepResult) -> Path:
    """The folder the step's weights were exported to (these ranks sync by disk)."""
    assert isinstance(result.weights, DiskWeights), result.weights
    return result.weights.folder


def trainer_state(work: WorkDir) -> TrainerState:
    """``ds/trainer_state.json``, which a committed checkpoint leaves."""
    state = read_trainer_state(work)
    assert state is not None, "no trainer_state.json"
    return state


def check_against_reference(
    result: StepResult, weights_dir: Path, reference: tuple[dict, dict], initial: dict, samples: list[Sample]
) -> None:
    """The ranks' step equals the one-process step: loss, grad norm, weights and the model's logprobs.

    Adam's first step moves a weight by ``lr * g / (|g| + eps)``: by ``lr`` where ``|g| >> eps`` (equal to
    1e-5 there), by less where ``|g|`` is near ``eps = 1e-8``, and those few depend on the float32 order of
    the gradient's sums (ranks, micro-batches), so they get 5 % of ``lr``."""
    ref_weights, ref_metrics = reference
    assert result.samples == len(samples) and result.tokens == sum(sum(s.loss_mask) for s in samples)
    assert abs(result.loss - ref_metrics["loss"]) < 1e-6
    assert result.grad_norm == pytest.approx(ref_metrics["grad_norm"], rel=1e-5)  # a sum, not a mean
    exported = weights_of(weights_dir)
    assert exported.keys() == ref_weights.keys()
    assert max_diff(exported, initial) > LR / 2  # trained
    assert max_diff(exported, ref_weights) < 0.05 * LR
    for name, weight in exported.items():
        full_step = (ref_weights[name] - initial[name]).abs() > 0.99 * LR
        assert (weight - ref_weights[name]).abs()[full_step].max() < 1e-5, name
    assert (weights_dir / "tokenizer_config.json").is_file() and (weights_dir / "config.json").is_file()
    batch = collate(samples, 0)
    logprobs = []
    for state in (None, ref_weights):
        model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32).eval()
        if state is not None:
            model.load_state_dict(state)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logprobs.append(token_logprobs(logits, batch["input_ids"])[batch["attention_mask"] == 1])
    assert (logprobs[0] - logprobs[1]).abs().max() < 1e-5


@pytest.mark.slow
def test_zero2_matches_one_process_and_resumes_from_its_checkpoint(
    tiny_model: Path, batches: list[list[Sample]], tmp_path: Path
) -> None:
    config = TrainerConfig(zero_stage=2, ranks=2, lr=LR, micro_batch_tokens=BUDGET).resolved(ServingConfig())
    initial = weights_of(tiny_model)
    first = Ranks(tmp_path, tiny_model, config)
    try:
        assert first.ready["step"] == 0 and first.ready["world_size"] == 2
        result1 = first.step(1, batches[0], save_checkpoint=True)
        assert result1.checkpoint is True
        after_step1 = weights_of(exported(result1))
        reference = reference_step(tiny_model, batches[0], config)
        check_against_reference(result1, exported(result1), reference, initial, batches[0])
        result2 = first.step(2, batches[1])  # past the checkpoint: lost in the crash below
        after_step2 = weights_of(exported(result2))
        assert first.channel.last_checkpoint_step() == 1
        first.kill()
        with pytest.raises(TrainerFailed, match="exited"):
            run(first.channel.wait_result(3, timeout_s=10))
    finally:
        first.kill()

    work = WorkDir(tmp_path, export_root=export_root(tmp_path))
    assert work.weights != tmp_path / "weights"  # exports go to node-local storage, not the work dir
    assert exported(result1).parent == work.weights
    shutil.rmtree(work.weights_dir(1))  # the resumed ranks export the checkpoint's weights again
    second = Ranks(tmp_path, tiny_model, config)
    try:
        assert second.ready["step"] == 1
        assert max_diff(weights_of(Path(second.ready["weights_dir"])), after_step1) == 0.0
        again = second.step(2, batches[1])
        for key in ("loss", "grad_norm", "kl", "entropy", "clip_frac", "tokens"):
            assert getattr(again, key) == pytest.approx(getattr(result2, key), abs=1e-6), key
        assert max_diff(weights_of(exported(again)), after_step2) < 1e-6
        with pytest.raises(TrainerFailed, match="takes step 3 next"):
            second.channel.submit(5, batches[0])
            run(second.channel.wait_result(5, timeout_s=30))
        # what the coordinator does on Slurm's signal: checkpoint the current step now
        assert second.channel.last_checkpoint_step() == 1
        second.channel.request_save(2)
        saved = second.channel.wait_saved_blocking(2, timeout_s=STEP_TIMEOUT_S)
        assert saved.step == 2 and second.channel.last_checkpoint_step() == 2
        assert not work.save_request.exists()
        with pytest.raises(TrainerFailed, match="at step 2, not 7"):
            second.channel.request_save(7)
            second.channel.wait_saved_blocking(7, timeout_s=30)
        assert second.channel.last_checkpoint_step() == 2
        assert second.stop() == 0
    finally:
        second.kill()
    assert sorted(p.name for p in work.weights.iterdir()) == ["step-000001", "step-000002"]

    # A rank died after the checkpoint of step 2 was committed and before its result reached the
    # coordinator, which recorded step 1 last: the ranks go back to step 1's checkpoint, so that step 2's
    # batch, sent again as step 2, is trained once.
    previous = trainer_state(work).previous
    assert previous is not None and previous.step == 1
    third = Ranks(tmp_path, tiny_model, config, recorded=1)
    try:
        assert third.ready["step"] == 1
        assert max_diff(weights_of(Path(third.ready["weights_dir"])), after_step1) == 0.0
        state = trainer_state(work)
        assert (state.step, state.tag) == (1, "step-000001")  # named trusted again
        assert not (work.ds / "step-000002").exists()  # removed as left by a run past step 1
        again = third.step(2, batches[1], save_checkpoint=True)
        assert max_diff(weights_of(exported(again)), after_step2) < 1e-6
        state = trainer_state(work)
        assert state.step == 2 and state.previous is not None and state.previous.step == 1
        assert third.stop() == 0
    finally:
        third.kill()
    assert "checkpoint step-000002 is past step 1, the last the server recorded" in third.log.read_text()


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_trusted(
    tiny_model: Path, batches: list[list[Sample]], tmp_path: Path
) -> None:
    """A save that cannot finish (Slurm's SIGKILL after KillWait): the ranks, with a checkpoint of step N,
    train step N+1 and are asked to save it; as soon as DeepSpeed has begun writing ``ds/step-<N+1>`` every
    process is frozen (SIGSTOP), so that the disk can be looked at exactly as a kill leaves it, and killed
    with SIGKILL. ``trainer_state.json`` still names step N, and the next start resumes there. The moment
    cannot be timed otherwise: when the freeze comes after the commit (the save of the tiny model takes
    milliseconds), the ranks start again from that checkpoint and the test tries once more (at most 3
    times). (torchrun starts each rank in a session of its own: the signals go to every process.)"""
    import signal

    import psutil

    config = TrainerConfig(zero_stage=2, ranks=2, lr=LR, micro_batch_tokens=BUDGET).resolved(ServingConfig())
    work = WorkDir(tmp_path)
    caught = None
    for _attempt in range(3):
        ranks = Ranks(tmp_path, tiny_model, config)
        try:
            trusted = ranks.ready["step"]
            if trusted == 0:
                trusted = 1
                ranks.step(1, batches[0], save_checkpoint=True)
            step = trusted + 1
            ranks.step(step, batches[step % len(batches)])
            torchrun = psutil.Process(ranks.proc.pid)
            every = [torchrun, *torchrun.children(recursive=True)]
            partial = work.ds / step_name(step)
            ranks.channel.request_save(step)
            while not partial.exists() and ranks.proc.poll() is None:
                pass  # no sleep: catch the save in its first milliseconds
            for process in every:
                process.send_signal(signal.SIGSTOP)
            state = read_trainer_state(work)
            for process in every:
                process.send_signal(signal.SIGKILL)
            ranks.proc.wait()
        finally:
            ranks.kill()
        assert state is not None and state.step in (trusted, step)
        if state.step == trusted:
            caught = (trusted, partial)
            break
    assert caught is not None, "every save finished before the ranks could be frozen"
    trusted, partial = caught
    assert partial.exists() and trainer_state(work).step == trusted

    resumed = Ranks(tmp_path, tiny_model, config)
    try:
        assert resumed.ready["step"] == trusted
        assert resumed.stop() == 0
    finally:
        resumed.kill()


@pytest.mark.slow
def test_zero3_trains_and_syncs_weights_into_the_vllm_engine(
    tiny_model: Path, batches: list[list[Sample]], tmp_path: Path
) -> None:
    from ajet_hpc.engine.base import SamplingParams, generate_all
    from ajet_hpc.engine.select import vllm_available
    from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

    config = TrainerConfig(
        zero_stage=3, ranks=2, lr=LR, micro_batch_tokens=BUDGET, kl_coef=0.05, recompute_logprobs=True
    ).resolved(ServingConfig())
    ranks = Ranks(tmp_path, tiny_model, config)
    try:
        result = ranks.step(1, batches[0])
        assert ranks.stop() == 0
    finally:
        ranks.kill()
    weights = exported(result)
    assert result.kl == pytest.approx(0.0, abs=1e-6) and result.clip_frac == 0.0
    reference = reference_step(tiny_model, batches[0], config)
    check_against_reference(result, weights, reference, weights_of(tiny_model), batches[0])

    ok, why = vllm_available()
    if not ok:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {why}: a skipped vLLM test would hide the weight-sync check")
        pytest.skip(why)

    def score(folder: Path, prompt: list[int], response: list[int]) -> list[float]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            ids = torch.tensor([prompt + response])
            return token_logprobs(model(ids).logits, ids)[0, len(prompt) :].tolist()

    async def sync() -> tuple[list[int], Any, Any]:
        async with VllmEngine(tiny_model, VllmSettings(max_model_len=256)) as engine:
            ids = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "Which weights?"}], add_generation_prompt=True, return_dict=False
            )
            # tokenized and not as a dict: the ids of one conversation (transformers types every shape)
            assert isinstance(ids, list), type(ids)
            prompt = cast(list[int], ids)
            params = SamplingParams(max_tokens=16, temperature=0.0)
            before = await generate_all(engine, prompt, params, "before")
            await engine.load_weights(weights, 1)
            after = await generate_all(engine, prompt, params, "after")
            return prompt, before, after

    prompt, before, after = run(sync())
    trained = score(weights, prompt, after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, trained, strict=True)) < 1e-3
    initial = score(tiny_model, prompt, after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, initial, strict=True)) > 1e-2  # they changed
    assert (
        before.token_ids != after.token_ids
        or max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs, strict=True)) > 1e-2
    )
