"""A closed server store read whole by plain HDF5 (issue 16, item 5): ``EpisodeWriter.close`` (and
``seal``) writes each column's open chunk into the column, so every dataset read whole with h5py holds
exactly the committed data. The reading example of docs/storage.md is taken from the markdown and run as
written (only its path replaced) against stores written through the real writer: one closed once, one
reopened for append (a requeued server) and closed again, one sealed mid-run. Its episodes and steps must
equal what ``EpisodeReader`` gives back."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from test_episode_store import make_record, make_step

from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.episode_store_writer import EpisodeWriter
from ajet_hpc.storage.h5_layout import SEALED, SPACES
from ajet_hpc.storage.records import EpisodeRecord, StepRecord

DOC = Path(__file__).resolve().parents[2] / "docs" / "storage.md"
MARKER = "<!-- plain-h5py example:"
DOC_PATH = '"RUN/data/policy.h5"'


def doc_example() -> str:
    """The python block right after the marker in docs/storage.md."""
    text = DOC.read_text()
    start = text.index(MARKER)
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None and text[start : match.start()].count("\n") == 1, "the block follows the marker"
    code = match.group(1)
    assert code.count(DOC_PATH) == 1, f"the example opens {DOC_PATH} once"
    return code


def run_example(path: Path) -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(doc_example().replace(DOC_PATH, repr(str(path))), str(DOC), "exec"), namespace)
    return namespace


def _records(rng: random.Random, first: int, n: int) -> list[EpisodeRecord | StepRecord]:
    out: list[EpisodeRecord | StepRecord] = []
    for i in range(first, first + n):
        record = make_record(i, turns=rng.randint(0, 6), answer=rng.randint(1, 40), tool=rng.randint(0, 30))
        if rng.random() < 0.2:
            record.reward = None
        out.append(record)
        if rng.random() < 0.2:
            out.append(make_step(i, n=rng.randint(0, 4)))
    return out


def check_whole(path: Path) -> None:
    """Every dataset read whole is as long as the commit says: rows, offsets and columns."""
    with h5py.File(path, "r", locking=False) as f:
        count = dict(zip(SPACES, f["commit"][:-1].tolist(), strict=True))
        for name, (_, space) in SEALED.items():
            assert len(f[name]) == count[space], name
        for rows in ("episodes", "timelines", "steps", "samples"):
            assert len(f[rows]) == count[rows], rows


def check_example(path: Path) -> None:
    """The doc's example against the package's reader, field by field."""
    got = run_example(path)
    with EpisodeReader(path) as reader:
        summaries = reader.summaries()
        assert [e["episode_id"] for e in got["episodes"]] == [s["episode_id"] for s in summaries]
        for plain, summary in zip(got["episodes"], summaries, strict=True):
            record = reader._episode_at(summary["index"])
            reward = plain.pop("reward")
            assert (math.isnan(reward) and record.reward is None) or reward == record.reward
            for key in ("episode_id", "model", "task_id", "group", "state", "reason", "metadata"):
                assert plain[key] == getattr(record, key), key
            assert len(plain["timelines"]) == len(record.timelines)
            for p, t in zip(plain["timelines"], record.timelines, strict=True):
                assert p["prompt_ids"].tolist() == t.prompt_ids
                assert p["response_ids"].tolist() == t.response_ids
                assert p["response_logprobs"].tolist() == t.response_logprobs
                assert p["loss_mask"].tolist() == t.loss_mask
                assert p["messages"] == t.messages and p["tools"] == t.tools
                assert p["finish_reason"] == t.finish_reason
        steps = reader.steps()
        assert [int(s["step"]) for s in got["steps"]] == [s["step"] for s in steps]
        for plain, step in zip(got["steps"], steps, strict=True):
            assert plain["metrics"] == step["metrics"]
            samples = reader.step_samples(step["step"]) if step["index"] == _last_index(steps, step) else None
            if samples is None:
                continue
            assert len(plain["samples"]) == len(samples)
            for p, s in zip(plain["samples"], samples, strict=True):
                assert p["token_ids"].tolist() == s.token_ids
                assert np.allclose(p["advantages"], s.advantages)
                assert p["episode_id"] == s.episode_id and p["task_id"] == s.task_id


def _last_index(steps: list[dict], step: dict) -> int:
    """``step_samples`` gives a step number's latest record: compare the samples of that one."""
    return max(s["index"] for s in steps if s["step"] == step["step"])


@pytest.mark.parametrize("chunk_tokens", [64, 1000, 65536])
def test_closed_store_reads_whole_with_plain_h5py(tmp_path: Path, chunk_tokens: int) -> None:
    rng = random.Random(chunk_tokens)
    path = tmp_path / "policy.h5"
    with EpisodeWriter(path, chunk_tokens=chunk_tokens) as writer:
        for first in range(0, 30, 10):
            writer.append_records(_records(rng, first, 10))
    check_whole(path)
    check_example(path)
    # A requeued server: reopens the sealed store, appends, closes (and seals) again.
    with EpisodeWriter(path, chunk_tokens=chunk_tokens) as writer:
        writer.append_records(_records(rng, 30, 7))
        writer.append_episode(make_record(99, turns=3))
    check_whole(path)
    check_example(path)


def test_seal_mid_run_then_append(tmp_path: Path) -> None:
    """``seal`` without closing: whole at that point for a plain reader; appending continues (the partial
    chunk is rewritten when it fills) and the package's readers see every commit throughout."""
    rng = random.Random(3)
    path = tmp_path / "policy.h5"
    with EpisodeWriter(path, chunk_tokens=256) as writer:
        writer.append_records(_records(rng, 0, 12))
        writer.seal()
        with h5py.File(path, "r", locking=False, swmr=True) as f:
            assert len(f["tokens"]) == int(f["commit"][SPACES.index("tokens")])
        writer.append_records(_records(rng, 12, 12))
        writer.seal()
        writer.append_records(_records(rng, 24, 3))
        with EpisodeReader(path) as reader:
            assert len(reader) == 27
    check_whole(path)
    check_example(path)
