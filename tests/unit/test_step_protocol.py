"""The typed side of the trainer's file protocol: a step's result (`StepResult`, with its weight hand-off)
written by rank 0 and read by the coordinator, and what rank 0 finds when it looks for work (`look`).

The result file keeps the flat JSON the ranks wrote before it was typed (the dict rank 0 built, kept here
as the reference), and `look` decides as the former ``Rank._look`` did (kept here too, with its string
answers), over random work-dir states: the same answer and the same files written."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.storage.files import read_json, write_json_atomic
from ajet_hpc.trainer.coordinator.channel import TrainerChannel, TrainerFailed
from ajet_hpc.trainer.protocol.batch_file import Batch, encode_batch, read_batch
from ajet_hpc.trainer.protocol.checkpoints import (
    RESUME_LIMIT_VAR,
    TrainerState,
    commit_checkpoint,
    next_trainer_state,
    read_trainer_state,
    resume_point,
    uncommit_checkpoint,
)
from ajet_hpc.trainer.protocol.rank_env import PARENT_PID_VAR
from ajet_hpc.trainer.protocol.step_result import Failed, StepResult, read_result, write_error, write_result
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights, MemoryWeights, WeightHandoff
from ajet_hpc.trainer.protocol.work_dir import WorkDir, step_name
from ajet_hpc.trainer.ranks.worker import Control, look


def sample(n: int = 4) -> Sample:
    return Sample(
        token_ids=list(range(n)),
        loss_mask=[0] + [1] * (n - 1),
        old_logprobs=[0.0] + [-1.0] * (n - 1),
        advantages=[0.0] + [0.5] * (n - 1),
        policy_version=0,
        episode_id="ep",
        task_id="t",
    )


# ---- results -------------------------------------------------------------------------------------------


def random_metrics(rng: random.Random) -> dict[str, float]:
    """What ``train_step`` returns."""
    return {
        "loss": rng.uniform(-2, 2),
        "kl": rng.random() / 10,
        "entropy": rng.uniform(0, 5),
        "clip_frac": rng.random(),
        "grad_norm": rng.choice((rng.uniform(0, 100), float("nan"))),
        "tokens": rng.randrange(1, 10**6),
        "samples": rng.randrange(1, 512),
    }


def random_handoff(rng: random.Random, folder: Path) -> tuple[dict[str, Any], WeightHandoff]:
    """The former ``Rank._publish`` dict and the typed hand-off for the same weights."""
    if rng.random() < 0.5:
        seconds, size = round(rng.uniform(0, 5), 4), rng.randrange(10**10)
        return {"weights": "memory", "sync_send_s": seconds, "sync_bytes": size}, MemoryWeights(seconds, size)
    path = folder / f"step-{rng.randrange(10**6):06d}"
    return {"weights": "disk", "weights_dir": str(path)}, DiskWeights(path)


def reference_result(step: int, metrics: dict[str, float], weights: dict[str, Any], times: tuple) -> dict:
    """The result dict rank 0 wrote before `StepResult` (``Rank._train`` and ``step_result.write_result``)."""
    step_time, export_time, checkpoint, checkpoint_time = times
    result = {
        **metrics,
        "step_time_s": round(step_time, 4),
        "export_time_s": round(export_time, 4),
        "checkpoint": checkpoint,
        "checkpoint_time_s": round(checkpoint_time, 4),
        **weights,
    }
    return {**result, "step": step}


def same_json(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as JSON values (NaN equal to NaN)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_result_files_keep_the_former_json_and_read_back_typed(tmp_path: Path) -> None:
    rng = random.Random(16)
    work = WorkDir(tmp_path)
    for step in range(1, 201):
        metrics = random_metrics(rng)
        old_weights, weights = random_handoff(rng, tmp_path / "weights")
        times = (rng.uniform(0, 60), rng.uniform(0, 10), rng.random() < 0.3, rng.uniform(0, 30))
        result = StepResult(
            step=step,
            loss=metrics["loss"],
            kl=metrics["kl"],
            entropy=metrics["entropy"],
            clip_frac=metrics["clip_frac"],
            grad_norm=metrics["grad_norm"],
            tokens=int(metrics["tokens"]),
            samples=int(metrics["samples"]),
            step_time_s=round(times[0], 4),
            export_time_s=round(times[1], 4),
            checkpoint=times[2],
            checkpoint_time_s=round(times[3], 4),
            weights=weights,
        )
        write_result(work, result)
        written = read_json(work.result_file(step))
        assert written is not None
        assert same_json(written, reference_result(step, metrics, old_weights, times)), step
        back = read_result(work, step)
        assert isinstance(back, StepResult)
        assert same_json(back.to_json(), result.to_json()) and back.weights == weights
        assert math.isnan(back.grad_norm) == math.isnan(result.grad_norm)
        # a file in the former layout reads the same
        write_json_atomic(work.result_file(step), reference_result(step, metrics, old_weights, times))
        former = read_json(work.result_file(step))
        assert former is not None
        assert same_json(StepResult.from_json(former).to_json(), result.to_json())


def test_a_result_names_the_field_it_lacks_or_has_wrong(tmp_path: Path) -> None:
    work = WorkDir(tmp_path)
    good = {
        "step": 3,
        "loss": 0.5,
        "kl": 0,  # an int where a float goes reads as a float
        "entropy": 1.0,
        "clip_frac": 0.0,
        "grad_norm": 2.0,
        "tokens": 10,
        "samples": 2,
        "step_time_s": 1.0,
        "export_time_s": 0.5,
        "checkpoint": False,
        "checkpoint_time_s": 0.0,
        "weights": "disk",
        "weights_dir": "/w/step-000003",
    }
    result = StepResult.from_json(good)
    assert result.kl == 0.0 and isinstance(result.kl, float)
    assert result.weights == DiskWeights(Path("/w/step-000003"))
    for name, value in [
        ("loss", None),
        ("tokens", 10.5),
        ("tokens", True),
        ("checkpoint", 1),
        ("weights", "nfs"),
        ("weights_dir", 7),
    ]:
        with pytest.raises(ValueError, match=rf"result of step 3: field '{name}' is"):
            StepResult.from_json({**good, name: value})
    with pytest.raises(ValueError, match="field 'sync_bytes' is None"):
        StepResult.from_json({**good, "weights": "memory", "sync_send_s": 0.1})
    write_error(work, 4, "rank 1: boom")
    assert read_result(work, 4) == Failed("rank 1: boom")
    write_error(work, 4, "a second error does not replace the first")
    assert read_result(work, 4) == Failed("rank 1: boom")
    assert read_result(work, 5) is None


def test_the_channel_returns_typed_answers_and_raises_on_failures(tmp_path: Path) -> None:
    work = WorkDir(tmp_path)
    channel = TrainerChannel(tmp_path)
    write_json_atomic(work.ready, {"error": "rank 0: no GPU"})
    with pytest.raises(TrainerFailed, match="the ranks to start failed: rank 0: no GPU"):
        asyncio.run(channel.wait_ready(timeout_s=1))
    write_json_atomic(work.ready, {"step": 2, "weights": "memory", "sync_send_s": 0.1, "sync_bytes": 8})
    assert asyncio.run(channel.wait_ready(timeout_s=1))["step"] == 2
    result = StepResult(3, 0.1, 0.0, 1.0, 0.0, 1.0, 5, 1, 1.0, 0.1, True, 0.2, MemoryWeights(0.1, 8))
    write_result(work, result)
    assert asyncio.run(channel.wait_result(3, timeout_s=1)) == result
    assert channel.wait_result_blocking(3, timeout_s=1) == result
    state = TrainerState(step=3, tag="step-000003", world_size=1, zero_stage=2, rng_files=["rng-0.pt"])
    write_json_atomic(work.trainer_state, dataclasses.asdict(state))
    assert channel.wait_saved_blocking(3, timeout_s=1) == state
    channel.request_save(4)
    write_json_atomic(work.save_refused, {"step": 4, "reason": "the trainer is at step 3, not 4"})
    with pytest.raises(TrainerFailed, match="checkpoint of step 4 failed: the trainer is at step 3, not 4"):
        channel.wait_saved_blocking(4, timeout_s=1)


# ---- what rank 0 finds -----------------------------------------------------------------------------------


def reference_look(work: WorkDir, step: int) -> Batch | str | None:
    """The former ``Rank._look`` (``self.step`` as ``step``; the parent process taken as alive), but for
    one change made since: a save request is gone once read, also when it asks for a save (then rank 0
    deleted it after the checkpoint, and a request written in between was deleted unread)."""
    request = read_json(work.save_request) if work.save_request.exists() else None
    if request is not None:
        wanted = request.get("step")
        state = read_trainer_state(work)
        if wanted == step and (state is None or state.step != step):
            work.save_request.unlink()
            return "save"
        if wanted != step:
            reason = f"the trainer is at step {step}, not {wanted}"
            write_json_atomic(work.save_refused, {"step": wanted, "reason": reason})
        work.save_request.unlink(missing_ok=True)
    if work.stop.exists():
        return "stop"
    expected = step + 1
    for pending in work.pending_steps():
        if pending == expected:
            return read_batch(work.batch_file(pending))
        if pending > expected and not work.result_file(pending).exists():
            write_error(work, pending, f"the trainer is at step {step} and takes step {expected} next")
    return None


FORMER = {Control.WAIT: None, Control.STOP: "stop", Control.SAVE: "save"}


def random_state(rng: random.Random, work: WorkDir, step: int, batch: bytes) -> None:
    """A work dir as rank 0 may find it at ``step``: batches, a stop, a save request, a checkpoint."""
    for pending in rng.sample(range(max(1, step - 1), step + 5), rng.randrange(4)):
        work.batch_file(pending).parent.mkdir(parents=True, exist_ok=True)
        work.batch_file(pending).write_bytes(batch)
        if rng.random() < 0.2:
            write_error(work, pending, "an earlier error")
    if rng.random() < 0.3:
        work.stop.touch()
    if rng.random() < 0.5:
        write_json_atomic(work.save_request, {"step": rng.choice((step, step, step - 1, step + 2))})
    if rng.random() < 0.5:
        trusted = rng.choice((step, step - 1))
        state = TrainerState(trusted, step_name(trusted), 1, 2, [])
        write_json_atomic(work.trainer_state, dataclasses.asdict(state))


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_look_decides_as_the_former_look(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PARENT_PID_VAR, raising=False)  # no starting process to watch
    rng = random.Random(9)
    seen = set()
    for case in range(300):
        step = rng.randrange(0, 6)
        seed = rng.random()
        dirs = []
        for name in ("new", "old"):
            work = WorkDir(tmp_path / str(case) / name)
            work.root.mkdir(parents=True)
            batch_bytes = encode_batch(step + 1, [sample()], save_checkpoint=False)
            random_state(random.Random(seed), work, step, batch_bytes)
            dirs.append(work)
        new, old = dirs
        found = look(new, step)
        expected = reference_look(old, step)
        if isinstance(found, Batch):
            assert isinstance(expected, Batch) and found == expected, case
            seen.add("batch")
        else:
            assert isinstance(found, Control) and FORMER[found] == expected, case
            seen.add(found.name)
        assert files(new.root) == files(old.root), case
    assert seen == {"batch", "WAIT", "STOP", "SAVE"}


def test_a_save_request_written_while_the_asked_save_runs_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator may ask again as soon as it sees the checkpoint it asked for (test_trainer's
    request for step 7 right after step 2's). Rank 0 used to delete the request after the checkpoint, so a
    request written in between was deleted unread and its caller waited out its timeout."""
    monkeypatch.delenv(PARENT_PID_VAR, raising=False)
    work = WorkDir(tmp_path / "work")
    work.root.mkdir()
    write_json_atomic(work.save_request, {"step": 2})
    assert look(work, 2) is Control.SAVE and not work.save_request.exists()
    commit(work, 2)  # the save; meanwhile the coordinator asks again
    write_json_atomic(work.save_request, {"step": 7})
    assert look(work, 2) is Control.WAIT
    assert read_json(work.save_refused) == {"step": 7, "reason": "the trainer is at step 2, not 7"}
    assert not work.save_request.exists()


# ---- checkpoints: the trusted one and the one before ---------------------------------------------------


def checkpoint(step: int) -> TrainerState:
    return TrainerState(step, step_name(step), 2, 2, ["rng-rank00000.pt", "rng-rank00001.pt"])


def commit(work: WorkDir, step: int) -> TrainerState:
    """What rank 0 does once every rank has written step ``step``'s checkpoint."""
    (work.ds / step_name(step)).mkdir(parents=True, exist_ok=True)
    state = next_trainer_state(read_trainer_state(work), checkpoint(step))
    commit_checkpoint(work, state)
    return state


def test_a_checkpoint_names_the_one_before_and_keeps_it(tmp_path: Path) -> None:
    work = WorkDir(tmp_path)
    first = commit(work, 5)
    assert first.first and first.previous is None
    second = commit(work, 10)
    assert second.previous is not None
    assert (second.previous.step, second.previous.first, second.first) == (5, True, False)
    assert read_trainer_state(work) == second  # the previous one read back typed
    third = commit(work, 15)
    assert third.previous == dataclasses.replace(checkpoint(10), previous=None)
    assert sorted(p.name for p in work.ds.iterdir() if p.is_dir()) == ["step-000010", "step-000015"]
    # saved again after going back (a step trained again): the one before stays the one before
    uncommit_checkpoint(work, third.previous)
    shutil.rmtree(work.ds / "step-000015")
    again = commit(work, 15)
    assert again.previous is not None
    assert again.previous.step == 10 and again.step == 15
    # a state written before `previous` existed reads as one that does not know what came before
    write_json_atomic(
        work.trainer_state,
        {k: v for k, v in dataclasses.asdict(checkpoint(7)).items() if k not in ("previous", "first")},
    )
    old = read_trainer_state(work)
    assert old == checkpoint(7) and not old.first


@pytest.mark.parametrize(
    ("state", "recorded", "resumed", "why"),
    [
        (checkpoint(4), None, 4, None),  # nothing known: the trusted one
        (checkpoint(4), 4, 4, None),
        (checkpoint(4), 6, 4, None),  # steps recorded after the checkpoint: they run again, as always
        (dataclasses.replace(checkpoint(5), previous=checkpoint(4)), 4, 4, "resuming from step-000004"),
        (dataclasses.replace(checkpoint(10), previous=checkpoint(5)), 7, 5, "resuming from step-000005"),
        (dataclasses.replace(checkpoint(1), first=True), 0, None, "starting afresh"),
        (
            dataclasses.replace(checkpoint(9), previous=checkpoint(8)),
            2,
            9,
            "resuming from step-000009 anyway",
        ),
        (checkpoint(9), 2, 9, "anyway"),  # written before `previous` existed: cannot go back
    ],
)
def test_the_ranks_go_back_from_a_checkpoint_past_the_record(
    state: TrainerState, recorded: int | None, resumed: int | None, why: str | None
) -> None:
    chosen, reason = resume_point(state, recorded)
    assert (None if chosen is None else chosen.step) == resumed
    if why is None:
        assert reason is None and chosen is state
    else:
        assert reason is not None
        assert why in reason and f"past step {recorded}, the last the server recorded" in reason


def test_the_recorded_step_reaches_the_ranks_as_a_number() -> None:
    from ajet_hpc.trainer.ranks.worker import _recorded_step

    assert _recorded_step({}) is None and _recorded_step({RESUME_LIMIT_VAR: "12"}) == 12
    with pytest.raises(RuntimeError, match="AJET_RESUME_AT_MOST='x' is not a step number"):
        _recorded_step({RESUME_LIMIT_VAR: "x"})
