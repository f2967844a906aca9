"""Group commit in the server store (issue 17, item 3): ``EpisodeWriter.append_records`` writes several
episodes and steps with one fsync and one commit, all or nothing. Real files, processes and disks, nothing
patched: a file written in groups must read back exactly as one written a record at a time (the
reference: one commit per record, as every append was before), a group that meets a real full disk (a
tmpfs) leaves nothing of itself, and a writer killed with SIGKILL at random points keeps every group it
acknowledged and no part of any other."""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from pathlib import Path
from typing import IO

import h5py
import numpy as np
import pytest
from support import tmpfs
from test_episode_store import append_on_a_full_disk, make_record, make_step

from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.episode_store_writer import EpisodeWriter, UnstorableRecord
from ajet_hpc.storage.h5_layout import OFFSETS, ROWS
from ajet_hpc.storage.records import EpisodeRecord, StepRecord, _cat


def _records(rng: random.Random, n: int) -> list[EpisodeRecord | StepRecord]:
    """Episodes of random sizes with a training step now and then (the recorder's queue mixes them)."""
    out: list[EpisodeRecord | StepRecord] = []
    for i in range(n):
        out.append(
            make_record(i, turns=rng.randint(0, 6), answer=rng.randint(1, 40), tool=rng.randint(0, 30))
        )
        if rng.random() < 0.15:
            out.append(make_step(len([r for r in out if isinstance(r, StepRecord)]), n=rng.randint(0, 4)))
    return out


def _contents(path: Path) -> dict:
    """Everything a reader gives back, and the raw committed rows and offsets."""
    with EpisodeReader(path) as reader:
        summaries = reader.summaries()
        steps = reader.steps()
        out = {
            "summaries": summaries,
            "episodes": [reader.episode(s["episode_id"]) for s in summaries],
            "steps": steps,
            "samples": [reader.step_samples(s["step"]) for s in steps],
        }
    with h5py.File(path, "r", locking=False) as f:
        for name in (*ROWS, *OFFSETS):
            out[f"raw {name}"] = f[name][:].tobytes()
    return out


@pytest.mark.parametrize("chunk_tokens", [8, 96, 65536])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_groups_read_back_as_records_committed_one_at_a_time(
    tmp_path: Path, chunk_tokens: int, seed: int
) -> None:
    """Random records in random groups (one group may seal many chunks and reuse both tail slots) against
    the reference, one commit per record."""
    rng = random.Random(seed)
    records = _records(rng, 60)
    with EpisodeWriter(tmp_path / "one.h5", chunk_tokens=chunk_tokens) as reference:
        for record in records:
            if isinstance(record, StepRecord):
                reference.append_step(record)
            else:
                reference.append_episode(record)
        assert reference.stats.commits == len(records)
    with EpisodeWriter(tmp_path / "groups.h5", chunk_tokens=chunk_tokens) as writer:
        i = 0
        while i < len(records):
            n = rng.choice([1, 2, 3, 7, 16, 40])
            writer.append_records(records[i : i + n])
            i += n
        groups = writer.stats.commits
        assert writer.stats.episodes == len([r for r in records if isinstance(r, EpisodeRecord)])
    assert groups < len(records) / 2
    grouped, expected = _contents(tmp_path / "groups.h5"), _contents(tmp_path / "one.h5")
    assert grouped["episodes"] == [r for r in records if isinstance(r, EpisodeRecord)]
    assert grouped == expected


@pytest.mark.parametrize("room", ["none", "all but a page"])
def test_a_group_that_meets_a_full_disk_commits_none_of_its_records(tmp_path: Path, room: str) -> None:
    """A real full disk (a 4 MiB tmpfs filled by a ballast file) with no room at all, or a page short of
    what the group needs: then its data is written, its chunks sealed and the ``sealed`` counter on disk
    past the commit (tail slots reused) when the disk runs out. Either way none of the group is in the
    store, the same writer reopens it at the last commit once space is back, and the next group lands
    after the earlier one."""
    group = [make_record(i, answer=40) for i in range(2, 6)] + [make_step(0)]
    with tmpfs(tmp_path / "disk", "4m") as disk:
        outcome = append_on_a_full_disk(
            disk, [make_record(0), make_record(1)], group, [make_record(6), make_step(1)], room
        )
        assert (
            "writing 5 records (episode ep-2 to step 0) failed, nothing of it was committed" in outcome.error
        )
        assert "No space left on device" in outcome.error
        assert (outcome.failed, outcome.commits) == (1, 1)
        assert outcome.sealed_past_commit == (room == "all but a page")
        assert outcome.after == "appended"
        with EpisodeReader(disk / "s.h5") as reader:
            assert [s["episode_id"] for s in reader.summaries()] == ["ep-0", "ep-1", "ep-6"]
            assert [reader.episode(f"ep-{i}") for i in (0, 1, 6)] == [make_record(i) for i in (0, 1, 6)]
            assert [s["step"] for s in reader.steps()] == [1]


def test_an_unstorable_record_refuses_its_group_before_writing(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    with EpisodeWriter(path) as writer:
        writer.append_records([make_record(0)])
        bad = make_record(3)
        bad.metadata = {"x": object()}
        with pytest.raises(UnstorableRecord, match=f"{path}: episode ep-3 cannot be stored") as caught:
            writer.append_records([make_record(1), make_record(2), bad, make_record(4)])
        assert caught.value.index == 2
        assert writer.stats.commits == 1 and writer.stats.failed == 0
        writer.append_records([])  # nothing to commit: no commit
        assert writer.stats.commits == 1
    with EpisodeReader(path) as reader:
        assert len(reader) == 1


# --------------------------------------------------------------------------------------------- crashes
def _big(i: int) -> EpisodeRecord:
    return make_record(i, answer=200, tool=300)


def write_groups(path: Path, start: int, seed: int, out: IO[str]) -> None:
    """Append big episodes in groups of random sizes until killed. Writes ``begin END`` to ``out`` before a
    group and ``done END`` once ``append_records`` returned (the acknowledgement), END being the number of
    episodes in the store after that group."""
    rng = random.Random(seed)
    with EpisodeWriter(path, chunk_tokens=512) as writer:
        i = start
        while True:
            group = [_big(k) for k in range(i, i + rng.randint(1, 12))]
            out.write(f"begin {i + len(group)}\n")
            writer.append_records(group)
            i += len(group)
            out.write(f"done {i}\n")


def _fork_writer(path: Path, start: int, seed: int) -> tuple[int, IO[str]]:
    """``write_groups`` in a forked child (no interpreter start: the kill rounds stay quick on a busy
    machine); returns its pid and the read end of its output. No HDF5 file is open in this process here."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            with os.fdopen(write_end, "w", buffering=1) as out:
                try:
                    write_groups(path, start, seed, out)
                except BaseException:
                    out.write(traceback.format_exc().replace("\n", " | ") + "\n")
        finally:
            os._exit(1)
    os.close(write_end)
    return pid, os.fdopen(read_end)


def test_a_writer_killed_at_random_points_keeps_every_acknowledged_group(tmp_path: Path) -> None:
    """Several rounds, each resuming the store the previous kill left: every acknowledged group is there,
    the store ends at a group boundary (the group being written is all there or not at all), and the file
    opens for readers and for the next writer."""
    path = tmp_path / "s.h5"
    rng = random.Random(1717)
    stored = 0
    for round_ in range(8):
        pid, output = _fork_writer(path, stored, round_)
        lines: list[str] = []
        while not any(line.startswith("done") for line in lines):
            line = output.readline()
            assert line.startswith(("begin", "done")), f"the writer failed: {line}"
            lines.append(line)
        time.sleep(rng.uniform(0, 0.15))  # somewhere in a later group: encoding, writing, fsync or commit
        os.kill(pid, signal.SIGKILL)
        lines += output.read().splitlines()
        os.waitpid(pid, 0)
        output.close()
        acknowledged = max(int(line.split()[1]) for line in lines if line.startswith("done"))
        begun = max(int(line.split()[1]) for line in lines if line.startswith("begin"))
        with EpisodeReader(path) as reader:
            n = len(reader)
            assert n in (acknowledged, begun), (round_, n, acknowledged, begun)  # all or nothing
            assert [s["episode_id"] for s in reader.summaries()] == [f"ep-{i}" for i in range(n)]
            for i in sorted({stored, acknowledged - 1, n - 1}):
                if 0 <= i < n:
                    assert reader.episode(f"ep-{i}") == _big(i)
        stored = n
    with EpisodeWriter(path, chunk_tokens=512) as writer:  # the last kill's flags cleared, shrunk to commit
        writer.append_records([make_record(stored), make_record(stored + 1)])
    with EpisodeReader(path) as reader:
        assert len(reader) == stored + 2
        assert reader.episode(f"ep-{stored + 1}") == make_record(stored + 1)
        assert reader.episode(f"ep-{stored - 1}") == _big(stored - 1)


def test_the_fast_conversion_of_lists_matches_numpy() -> None:
    """``_cat`` converts lists of ids and masks without numpy; the reference is numpy's own conversion
    (what it did before), for random values at the edges of each type, and refuses what numpy refuses."""
    rng = random.Random(5)
    pools = {
        np.int32: [0, 1, -1, 2**31 - 1, -(2**31), 50_000, True, np.int64(7)],
        np.int8: [0, 1, 2, 3, 127, True, np.int64(1)],
    }
    for dtype, pool in pools.items():
        for _ in range(200):
            parts = [[rng.choice(pool) for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(1, 4))]
            fast = _cat(parts, dtype)
            assert (
                fast.dtype == dtype
                and fast.tolist() == np.concatenate([np.asarray(p, dtype) for p in parts]).tolist()
            )
    for dtype, odd in ((np.int32, [1.5, 2]), (np.int8, [-1, 2]), (np.int8, [200]), (np.int32, [2**31])):
        try:
            expected = np.concatenate([np.asarray([1], dtype), np.asarray(odd, dtype)]).tolist()
        except (OverflowError, ValueError) as error:
            with pytest.raises(type(error)):
                _cat([[1], odd], dtype)
        else:
            assert _cat([[1], odd], dtype).tolist() == expected
