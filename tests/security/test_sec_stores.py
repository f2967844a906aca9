"""Stores under a full disk, a second writer and a lock-less file system (issue 14, items 1, 2, 8, 14).

A full disk is real here: a tmpfs mounted with a size limit (the tests run as root in CI; the mount is
removed in the fixture's ``finally``). A ballast file fills it, removing the ballast brings space back."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import fill_disk, tmpfs

from ajet_hpc.storage.client_store import ClientStore, Result, read_results
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.episode_store_writer import EpisodeWriter
from ajet_hpc.storage.h5_layout import StoreError, lookup3, read_superblock
from ajet_hpc.storage.lease import LeaseTiming
from ajet_hpc.storage.records import EpisodeRecord
from ajet_hpc.tracking.timeline import MODEL, USER, Timeline

REPO = Path(__file__).resolve().parents[2]


def make_record(i: int, turns: int = 2, answer: int = 5) -> EpisodeRecord:
    """Episode ``i``: ``turns`` calls of ``answer`` tokens after a 6-token prompt; deterministic."""
    timelines = [
        Timeline(
            prompt_ids=[i % 997, 1, 2, 3, 4, t],
            response_ids=[(i * 31 + t * 7 + k) % 50_000 for k in range(answer)],
            response_logprobs=[-k / 8 for k in range(answer)],
            token_authors=[USER] * 6 + [MODEL] * answer,
            loss_mask=[0] * 6 + [1] * answer,
            messages=[{"role": "user", "content": f"task {i} turn {t}"}],
            tools=None,
            policy_version=i // 10,
            finish_reason="stop",
            started_at=1000.0 + i,
            finished_at=1000.5 + i,
        )
        for t in range(turns)
    ]
    return EpisodeRecord(
        episode_id=f"ep-{i}", model="policy", task_id=f"task-{i}", group="math", state="finished",
        reward=i / 8, turn_rewards=None, reason=None, metadata={"i": i}, started_at=1000.0 + i,
        ended_at=1001.0 + i, timelines=timelines,
    )  # fmt: skip


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a file system that really runs full (ENOSPC)."""
    with tmpfs(tmp_path / "disk", "4m") as mount:
        yield mount


def _append_until_full(writer: EpisodeWriter, start: int) -> tuple[int, StoreError]:
    for i in range(start, start + 100_000):
        try:
            writer.append_episode(make_record(i, turns=8, answer=50))
        except StoreError as exc:
            return i, exc
    raise AssertionError("the disk never ran full")


def test_writer_survives_a_full_disk_and_readers_read_every_commit(small_disk: Path) -> None:
    path = small_disk / "policy.h5"
    with EpisodeWriter(path, chunk_tokens=1024) as writer:
        for i in range(5):
            writer.append_episode(make_record(i))
        ballast = fill_disk(small_disk, 600_000)
        failed, exc = _append_until_full(writer, 5)
        assert "No space left on device" in str(exc) and "nothing of it was committed" in str(exc)
        assert not writer.closed
        with EpisodeReader(path) as reader:  # while the writer holds the file: every commit readable
            assert [s["episode_id"] for s in reader.summaries()] == [f"ep-{i}" for i in range(failed)]
        with pytest.raises(StoreError, match=r"could not be reopened|nothing of it was committed"):
            writer.append_episode(make_record(failed))  # still full: a clear error, no damage
        ballast.unlink()
        for i in range(failed, failed + 3):  # space is back: the same writer appends again
            writer.append_episode(make_record(i))
    with EpisodeReader(path) as reader:
        assert [s["episode_id"] for s in reader.summaries()] == [f"ep-{i}" for i in range(failed + 3)]
        assert reader.episode(f"ep-{failed + 2}") == make_record(failed + 2)
    with EpisodeWriter(path) as writer:  # and a new writer opens it
        writer.append_episode(make_record(failed + 3))


def _ids(path: Path) -> list[str]:
    with EpisodeReader(path) as reader:
        return [s["episode_id"] for s in reader.summaries()]


def test_a_writer_that_dies_at_its_file_size_limit_leaves_every_commit_readable(tmp_path: Path) -> None:
    """EFBIG for real: the writer process runs under RLIMIT_FSIZE, fails an append, then dies unclosed."""
    path = tmp_path / "policy.h5"
    child = textwrap.dedent(f"""
        import os, resource, signal, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]  # and support.py
        from pathlib import Path
        from test_sec_stores import make_record
        from ajet_hpc.storage.episode_store_writer import EpisodeWriter
        from ajet_hpc.storage.h5_layout import StoreError
        writer = EpisodeWriter(Path({str(path)!r}), chunk_tokens=1024)
        for i in range(3):
            writer.append_episode(make_record(i))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = os.path.getsize(writer.path) + 200_000
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        i = 3
        try:
            while True:
                writer.append_episode(make_record(i, turns=8, answer=50))
                i += 1
        except StoreError as exc:
            assert "File too large" in str(exc), exc
            print(i)
        os._exit(0)  # dies without closing the store
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    committed = int(done.stdout.split()[-1])
    assert committed > 3
    assert _ids(path) == [f"ep-{i}" for i in range(committed)]  # the inspector's reader reads them all
    with EpisodeWriter(path) as writer:  # the lease of the dead process is taken over, the file reopened
        writer.append_episode(make_record(committed))
    assert _ids(path) == [f"ep-{i}" for i in range(committed + 1)]


def _cut_short(path: Path, missing: int) -> None:
    """The state a failed append can leave: the superblock names an end ``missing`` bytes past the
    file's (HDF5 moved the end up, the data there was never written). Made by hand: which write of HDF5
    fails first on a full disk is not under a test's control."""
    block = read_superblock(path)
    assert block is not None
    size = block.head[9]
    at = 12 + 2 * size
    head = block.head[:at] + (block.eof + missing).to_bytes(size, "little") + block.head[at + size :]
    with open(path, "rb+") as handle:
        handle.write(head + lookup3(head).to_bytes(4, "little"))


def test_a_store_cut_short_by_a_failed_append_is_read_and_repaired(tmp_path: Path) -> None:
    path = tmp_path / "policy.h5"
    with EpisodeWriter(path, chunk_tokens=1024) as writer:
        for i in range(20):
            writer.append_episode(make_record(i))
    _cut_short(path, 50_000)
    assert _ids(path) == [f"ep-{i}" for i in range(20)]  # read through a repaired view, file untouched
    block = read_superblock(path)
    assert block is not None
    assert path.stat().st_size < block.eof
    with EpisodeWriter(path) as writer:  # the writer pads it to its end and goes back to the last commit
        writer.append_episode(make_record(20))
    assert _ids(path) == [f"ep-{i}" for i in range(21)]


# ------------------------------------------------------------------------------ one writer per client store
def _hold_client_store(path: Path, heartbeat_s: float) -> subprocess.Popen[str]:
    """A second process that opens client store ``path`` (lease heartbeat ``heartbeat_s``) and commits one
    result per line it reads on stdin, printing "ok" or the error."""
    child = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from ajet_hpc.storage.client_store import ClientStore, Result
        from ajet_hpc.storage.lease import LeaseTiming
        timing = LeaseTiming(heartbeat_s={heartbeat_s}, timeout_s={3 * heartbeat_s}, settle_s=0.1)
        store = ClientStore.open(Path({str(path)!r}), group="math", index=0, lease_timing=timing)
        print("open", flush=True)
        for line in sys.stdin:
            try:
                store.commit(Result(line.strip(), 0, 1.0, {{}}, {{}}, None, {{}}, 0.0))
                print("ok", flush=True)
            except Exception as exc:
                print(type(exc).__name__, exc, flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen(
        [sys.executable, "-c", child], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "open\n"
    return holder


def test_a_client_store_has_one_writer_across_processes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "clients" / "math" / "0.h5"
    holder = _hold_client_store(path, heartbeat_s=0.5)
    try:
        with pytest.raises(
            StoreError, match=rf"another process writes this store \(host .*, pid {holder.pid}"
        ):
            ClientStore.open(path, group="math", index=0, lease_wait_s=0)
        holder.send_signal(signal.SIGSTOP)  # its heartbeat stops (a frozen node, a lost mount)
        timing = LeaseTiming(heartbeat_s=0.5, timeout_s=1.5, settle_s=0.1)
        with ClientStore.open(path, group="math", index=0, lease_timing=timing) as store:  # waits, takes over
            assert (
                f"taking over the writer lease of host {socket.gethostname()}, pid {holder.pid}"
                in caplog.text
            )
            holder.send_signal(signal.SIGCONT)
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write("late\n")
            holder.stdin.flush()
            assert holder.stdout.readline().startswith("LeaseLost")  # the old writer writes nothing more
            store.commit(Result("mine", 0, 1.0, {}, {}, None, {}, 0.0))
        assert [r.task_id for r in read_results(path)] == ["mine"]
    finally:
        holder.kill()
        holder.wait()
