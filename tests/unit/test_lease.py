"""The writer lease of the server store on real files and real processes (no HDF5 here: see
test_episode_store.py for the lease around a real writer).

A lease "from another host" cannot be produced on one machine: those tests write the lease file themselves,
as that host's writer would (they say so where they do).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.lease import (
    LEASE_BYTES,
    HeldLease,
    Lease,
    LeaseLost,
    LeaseTiming,
    acquire_lease,
    lease_path,
    read_lease,
)

FAST = LeaseTiming(heartbeat_s=0.05, timeout_s=0.5, settle_s=0.05)
SLOW = LeaseTiming(heartbeat_s=60, timeout_s=600)  # no heartbeat during a test
REPO = Path(__file__).resolve().parents[2]


class Watcher:
    """Receives the lease-lost call (a bound method, as the lease holds it by weak reference)."""

    def __init__(self) -> None:
        self.lost = threading.Event()

    def on_lost(self) -> None:
        self.lost.set()


def foreign_lease(heartbeat_age: float, host: str = "node-b.cluster", pid: int = 4242) -> Lease:
    """What a writer on another node would have written (faked: this test machine is one host)."""
    now = time.time()
    return Lease(
        host=host, pid=pid, job_id="777", restarts=0, token="f0f0f0f0f0f0f0f0", started_at=now - 3600,
        heartbeat_at=now - heartbeat_age, heartbeat_s=5.0, timeout_s=20.0,
    )  # fmt: skip


def write_lease(store: Path, lease: Lease) -> None:
    lease_path(store).write_bytes(lease.to_bytes())


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(proc.stdout)


def test_timing_is_checked() -> None:
    with pytest.raises(ValueError, match=r"timeout_s \(1.0\) must be at least 3 × heartbeat_s"):
        LeaseTiming(heartbeat_s=1.0, timeout_s=1.0)
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        LeaseTiming(heartbeat_s=0)


def test_a_lease_names_its_holder_and_goes_on_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, watcher = tmp_path / "m.h5", Watcher()
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    held = acquire_lease(store, SLOW, watcher.on_lost)
    lease = read_lease(store)
    assert lease is not None and lease == held.lease
    assert (lease.host, lease.pid, lease.job_id) == (socket.gethostname(), os.getpid(), "31337")
    assert lease_path(store) == tmp_path / "m.h5.lease"
    held.release()
    assert read_lease(store) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary files left either


def test_the_heartbeat_renews_the_lease(tmp_path: Path) -> None:
    store, watcher = tmp_path / "m.h5", Watcher()
    held = acquire_lease(store, FAST, watcher.on_lost)
    try:
        first = read_lease(store)
        assert first is not None
        deadline = time.monotonic() + 30
        while (now := read_lease(store)) == first and time.monotonic() < deadline:
            time.sleep(0.02)
        assert now is not None and now.token == first.token and now.heartbeat_at > first.heartbeat_at
        held.confirm()
    finally:
        held.release()
    assert not watcher.lost.is_set()


def test_a_healthy_holder_renews_in_place(tmp_path: Path) -> None:
    """Heartbeats rewrite the lease file through its descriptor: the same file (inode) and length, no
    temporary file, no name looked up: what 10,000 client tasks' heartbeats cost the metadata server."""
    store, watcher = tmp_path / "m.h5", Watcher()
    held = acquire_lease(store, FAST, watcher.on_lost)
    try:
        before = os.stat(lease_path(store))
        first = read_lease(store)
        assert first is not None and before.st_size == LEASE_BYTES
        deadline = time.monotonic() + 30
        beats = 0
        while beats < 3 and time.monotonic() < deadline:
            now = read_lease(store)
            assert now is not None and now.token == first.token  # never torn (read retries a torn read)
            beats += now.heartbeat_at > first.heartbeat_at
            first = now if now.heartbeat_at > first.heartbeat_at else first
            time.sleep(FAST.heartbeat_s)
        after = os.stat(lease_path(store))
        assert beats == 3 and (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.h5.lease"]
    finally:
        held.release()
    assert not watcher.lost.is_set()


def test_a_lease_renamed_over_is_seen_through_the_descriptor(tmp_path: Path) -> None:
    """A taker renames its lease over the file the holder rewrites in place: the holder's descriptor now
    points at an unlinked file, which its next heartbeat notices (then reads the name: another holder)."""
    store, watcher = tmp_path / "m.h5", Watcher()
    held = acquire_lease(store, FAST, watcher.on_lost)
    try:
        taker = tmp_path / "taker.tmp"
        taker.write_bytes(foreign_lease(heartbeat_age=0.0).to_bytes())  # faked: another node's takeover
        os.replace(taker, lease_path(store))
        assert watcher.lost.wait(30), "the heartbeat did not notice"
        with pytest.raises(LeaseLost, match=r"now names host node-b\.cluster"):
            held.confirm()
    finally:
        held.release()


def test_a_fresh_lease_of_another_host_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "m.h5"
    write_lease(store, foreign_lease(heartbeat_age=1.0))  # faked: another node's live writer
    before = lease_path(store).read_bytes()
    with pytest.raises(StoreError, match=r"host node-b\.cluster, pid 4242, Slurm job 777") as caught:
        acquire_lease(store, FAST, Watcher().on_lost)
    assert "scancel 777" in str(caught.value) and "last heartbeat" in str(caught.value)
    assert lease_path(store).read_bytes() == before


def test_a_lease_with_an_old_heartbeat_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "m.h5"
    old = foreign_lease(heartbeat_age=60.0)  # faked: a node that died a minute ago
    write_lease(store, old)
    with caplog.at_level(logging.WARNING, logger="ajet_hpc.storage.lease"):
        held = acquire_lease(store, FAST, Watcher().on_lost)
    try:
        assert "taking over the writer lease of host node-b.cluster, pid 4242" in caplog.text
        assert "heartbeat is older than its timeout of 20 s" in caplog.text
        assert held.taken_from == old
        lease = read_lease(store)
        assert lease is not None and (lease.host, lease.pid) == (socket.gethostname(), os.getpid())
    finally:
        held.release()


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over(tmp_path: Path) -> None:
    store = tmp_path / "m.h5"
    # The process is real and dead; the file stands for the lease it would have left (its heartbeat fresh).
    gone = replace(foreign_lease(heartbeat_age=0.0), host=socket.gethostname(), pid=dead_pid())
    write_lease(store, gone)
    held = acquire_lease(store, SLOW, Watcher().on_lost)
    try:
        assert held.taken_from == gone
        assert read_lease(store) == held.lease
    finally:
        held.release()


def test_a_lease_of_this_job_before_its_requeue_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "m.h5"
    write_lease(store, foreign_lease(heartbeat_age=1.0))  # faked: job 777's first run, on another node
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    with pytest.raises(StoreError, match="Slurm job 777"):  # the same run (another step of it): refused
        acquire_lease(store, FAST, Watcher().on_lost)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: Slurm ended the first run before this one
    held = acquire_lease(store, FAST, Watcher().on_lost)
    try:
        assert held.taken_from is not None and held.taken_from.host == "node-b.cluster"
        assert read_lease(store) == held.lease and held.lease.restarts == 1
    finally:
        held.release()


def test_a_holder_whose_lease_was_taken_stops(tmp_path: Path) -> None:
    store, watcher = tmp_path / "m.h5", Watcher()
    held = acquire_lease(store, FAST, watcher.on_lost)
    try:
        write_lease(store, foreign_lease(heartbeat_age=0.0))  # faked: another node took it over
        assert watcher.lost.wait(30), "the heartbeat did not notice"
        with pytest.raises(LeaseLost, match=r"lost its lease .* now names host node-b\.cluster, pid 4242"):
            held.confirm()
    finally:
        held.release()
    lease = read_lease(store)
    assert lease is not None and lease.host == "node-b.cluster"  # released, not removed: not ours


def test_a_removed_lease_is_lost_too(tmp_path: Path) -> None:
    store = tmp_path / "m.h5"
    held = acquire_lease(store, SLOW, Watcher().on_lost)
    lease_path(store).unlink()
    with pytest.raises(LeaseLost, match="its file was removed"):
        held.confirm(force=True)
    held.release()


def test_a_stale_claim_of_a_dead_taker_is_cleared(tmp_path: Path) -> None:
    store = tmp_path / "m.h5"
    old = foreign_lease(heartbeat_age=60.0)
    write_lease(store, old)
    claim = lease_path(store).with_name(f"m.h5.lease.takeover-{old.token}")
    # A taker that died between claiming and replacing (a real dead pid on this host).
    claim.write_bytes(replace(old, host=socket.gethostname(), pid=dead_pid(), token="dead").to_bytes())
    held = acquire_lease(store, FAST, Watcher().on_lost)
    try:
        assert not claim.exists() and read_lease(store) == held.lease
    finally:
        held.release()


def test_a_file_that_is_not_a_lease_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "m.h5"
    lease_path(store).write_text("hello\n")
    with pytest.raises(StoreError, match=r"m\.h5\.lease: not a writer lease .*remove this file"):
        acquire_lease(store, FAST, Watcher().on_lost)


def race(store: Path) -> None:
    """Run in a racing process: wait for "go", try to take the lease, say whether it won, hold it."""
    held: HeldLease | None = None
    sys.stdin.readline()
    try:
        held = acquire_lease(store, LeaseTiming(heartbeat_s=1, timeout_s=60), Watcher().on_lost)
        print("won", flush=True)
    except StoreError:
        print("refused", flush=True)
    sys.stdin.read()
    if held is not None:
        held.confirm(force=True)  # still ours at the end
        held.release()


@pytest.mark.parametrize("start", ["empty", "stale"])
def test_racing_takers_one_wins(tmp_path: Path, start: str) -> None:
    store = tmp_path / "m.h5"
    if start == "stale":
        write_lease(store, foreign_lease(heartbeat_age=60.0))  # faked: a dead node's lease
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'tests' / 'unit')!r}); "
        f"from pathlib import Path; from test_lease import race; race(Path({str(store)!r}))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    try:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        answers = [proc.stdout.readline().strip() for proc in procs if proc.stdout is not None]
        assert sorted(answers) == ["refused", "refused", "refused", "won"]
        winner = procs[answers.index("won")]
        lease = read_lease(store)
        assert lease is not None and lease.pid == winner.pid
    finally:
        for proc in procs:
            proc.communicate(timeout=60)
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0]
    assert read_lease(store) is None
