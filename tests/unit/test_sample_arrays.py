"""Samples whose per-token fields are numpy arrays (what the trainer's build hands out) against the same
samples as lists: the mask helpers find the same runs, the samples compare equal, and the batch file, the
step record and the step's histograms are the same bytes and values either way."""

from __future__ import annotations

import copy
import dataclasses
import io
import random
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
from test_batch_file import random_sample

from ajet_hpc.algo.sample_tensors import ARRAY_TYPES, Sample, as_arrays, binary_runs, is_binary, mask_runs
from ajet_hpc.config import MergeConfig, TrainerConfig
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.storage.records import StepRecord, encode_step
from ajet_hpc.tracking.timeline import Timeline
from ajet_hpc.trainer.coordinator.collector import Batch
from ajet_hpc.trainer.coordinator.episodes_to_samples import build_samples
from ajet_hpc.trainer.coordinator.experiment_trackers import step_histograms
from ajet_hpc.trainer.protocol.batch_file import encode_batch, read_batch
from ajet_hpc.trainer.protocol.work_dir import WorkDir


def random_samples(seed: int, count: int = 12) -> list[Sample]:
    rng = random.Random(seed)
    return [random_sample(rng, i) for i in range(count)]


def test_mask_helpers_read_an_array_as_its_list() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        mask = [rng.choice((0, 1, 1)) for _ in range(rng.randint(0, 30))]
        array = np.asarray(mask, np.int8)
        assert mask_runs(array) == mask_runs(mask) == binary_runs(mask) == binary_runs(array)
        assert is_binary(array) and is_binary(np.asarray(mask, np.float64))
        for odd in (2, -1):
            assert not is_binary(np.asarray([*mask, odd], np.int8)) and binary_runs([*mask, odd]) is None
        assert not is_binary(np.asarray([*mask, 0.5]))


def test_samples_compare_by_value_whether_lists_or_arrays() -> None:
    for original in random_samples(1):
        arrays = as_arrays(copy.deepcopy(original))
        for name, kind in ARRAY_TYPES.items():
            value = getattr(arrays, name)
            assert value is None or (isinstance(value, np.ndarray) and value.dtype == kind)
        assert arrays == original and original == arrays
        other = copy.deepcopy(arrays)
        other.advantages[-1] += 1.0
        assert other != original
    with pytest.raises(ValueError, match="only 0 and 1"):
        Sample([1, 2], np.asarray([0, 2], np.int8), [0.0, 0.0], [0.0, 0.0], 0, "e", "t")


def test_the_step_record_is_the_same_from_arrays_and_from_lists() -> None:
    for seed in range(10):
        lists = random_samples(seed)
        arrays = [as_arrays(copy.deepcopy(s)) for s in lists]
        want = encode_step(StepRecord(step=seed + 1, metrics={"loss": 0.5}, samples=lists))
        got = encode_step(StepRecord(step=seed + 1, metrics={"loss": 0.5}, samples=arrays))
        assert got.counts == want.counts
        for part in ("rows", "lengths", "columns"):
            mine, theirs = getattr(got, part), getattr(want, part)
            assert mine.keys() == theirs.keys()
            for key in mine:
                assert mine[key].dtype == theirs[key].dtype and np.array_equal(mine[key], theirs[key]), key


def test_batch_files_from_arrays_read_back_as_lists_and_the_per_sample_layout_still_reads(
    tmp_path: Path,
) -> None:
    work = WorkDir(tmp_path)
    for step in range(1, 11):
        samples = random_samples(step)
        arrays = [as_arrays(copy.deepcopy(s)) for s in samples]
        data = encode_batch(step, arrays, save_checkpoint=True)
        assert data == encode_batch(step, samples, save_checkpoint=True)
        work.batch_file(step).parent.mkdir(parents=True, exist_ok=True)
        work.batch_file(step).write_bytes(data)
        back = read_batch(work.batch_file(step))
        assert back.samples == samples and back.save_checkpoint
        assert all(type(v) is float for s in back.samples for v in s.advantages)
        # the layout before the columns: one dict per sample, each per-token field a 64-bit tensor
        buffer = io.BytesIO()
        torch.save(
            {"step": step, "samples": [_per_sample(s) for s in samples], "save_checkpoint": False}, buffer
        )
        work.batch_file(step).write_bytes(buffer.getvalue())
        assert read_batch(work.batch_file(step)).samples == samples


def _per_sample(sample: Sample) -> dict:
    out = {}
    for item in dataclasses.fields(sample):
        value = getattr(sample, item.name)
        kind = {"old_logprobs": torch.float64, "advantages": torch.float64, "weights": torch.float64}.get(
            item.name, torch.int64
        )
        per_token = item.name in ARRAY_TYPES and value is not None
        out[item.name] = torch.tensor(value, dtype=kind) if per_token else value
    return out


def test_histograms_are_the_same_from_arrays_and_from_lists() -> None:
    samples = random_samples(5, 30)
    arrays = [as_arrays(copy.deepcopy(s)) for s in samples]
    assert step_histograms([], arrays) == step_histograms([], samples)


def test_the_build_hands_out_arrays() -> None:
    def timeline(prompt: list[int], answer: list[int]) -> Timeline:
        n = len(prompt) + len(answer)
        mask = [0] * len(prompt) + [1] * len(answer)
        logprobs = [-0.5] * len(answer)
        return Timeline(prompt, answer, logprobs, [0] * n, mask, [], None, 0, "stop")

    def episode(e: int, reward: float) -> Episode:
        first = timeline([1, 2, 3], [4, 5])
        second = timeline([1, 2, 3, 4, 5, 6], [7])
        return Episode(
            model="policy",
            tracker=None,
            state=FINISHED,
            stored_timelines=[first, second],
            group="g",
            episode_id=f"e{e}",
            task_id="t",
            repeat=e,
            reward=reward,
        )

    modes: tuple[Literal["linear", "none", "tree"], ...] = ("linear", "none", "tree")
    for mode in modes:
        batch = Batch(groups=[[episode(0, 1.0), episode(1, 0.0)]], dropped_ids=[])
        samples, _ = build_samples(batch, TrainerConfig(merge=MergeConfig(mode=mode)))
        assert samples and not batch.invalid
        for sample in samples:
            for name, kind in ARRAY_TYPES.items():
                value = getattr(sample, name)
                assert value is None or (isinstance(value, np.ndarray) and value.dtype == kind), (mode, name)
                # none is a view of a larger array (the task group's zeros would stay alive with the step)
                assert value is None or not isinstance(value.base, np.ndarray), (mode, name)
        if mode == "linear":
            assert [np.asarray(s.loss_mask).tolist() for s in samples] == [[0, 0, 0, 1, 1, 0, 1]] * 2
            assert samples[0].advantages[3] > 0 > samples[1].advantages[3]
