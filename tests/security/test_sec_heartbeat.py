"""The server's rendezvous heartbeat survives failed writes and retries (issue 14, item 8).

Disk full is real: the run's ``servers/`` folder is a full 1 MiB tmpfs (unmounted in ``finally``). ESTALE
needs an NFS server that replaced the file under us, which a test machine does not have: there the write
is made to fail by fault injection (``write_json_atomic`` raising ESTALE a few times)."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import uvicorn
from support import fill_disk, tmpfs, wait_until

from ajet_hpc.server import process
from ajet_hpc.server.context import ModelContext
from ajet_hpc.storage import rendezvous


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "servers", "1m") as folder:
        fill_disk(folder)
        yield folder


def _heartbeat(path: Path, monkeypatch: pytest.MonkeyPatch) -> process.Heartbeat:
    """The server's heartbeat thread, on stand-ins for uvicorn (started) and the server's state."""
    monkeypatch.setattr(rendezvous, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(process.Heartbeat, "RETRY_S", 0.05)
    record = rendezvous.Rendezvous("policy", "http://127.0.0.1:1", "127.0.0.1", 1, os.getpid(), "1", "node")
    ctx = SimpleNamespace(
        state="training", engine=SimpleNamespace(policy_version=3), step=2, last_step_at=None, reason=None
    )
    server = cast(uvicorn.Server, SimpleNamespace(started=True))  # stand-in: the heartbeat reads `started`
    beat = process.Heartbeat(path, record, server, cast(ModelContext, ctx))
    beat.start()
    return beat


def test_the_heartbeat_outlives_a_full_disk(full_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = full_disk / "policy.json"
    beat = _heartbeat(path, monkeypatch)
    try:
        time.sleep(0.5)  # about ten failed writes
        assert beat.is_alive() and not path.exists() and beat.failing_since is not None
        (full_disk / "ballast").unlink()  # space is back
        found = wait_until(lambda: rendezvous.read(path), 10, "the rendezvous to be written")
        assert found.policy_version == 3 and not found.is_stale(1.0)
        assert beat.is_alive() and beat.failing_since is None
    finally:
        beat.stop()


def test_the_heartbeat_outlives_estale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = rendezvous.write_json_atomic
    failures: list[Path] = []

    def stale_handle(path: Path, payload: object) -> None:
        if len(failures) < 5:
            failures.append(path)
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))
        real(path, payload)

    monkeypatch.setattr(rendezvous, "write_json_atomic", stale_handle)
    beat = _heartbeat(tmp_path / "policy.json", monkeypatch)
    try:
        wait_until(lambda: rendezvous.read(tmp_path / "policy.json"), 10, "the rendezvous to be written")
        assert len(failures) == 5 and beat.is_alive()
        first = rendezvous.read(tmp_path / "policy.json")
        assert first is not None

        def beaten_again() -> bool:
            latest = rendezvous.read(tmp_path / "policy.json")
            assert latest is not None  # written, and since replaced atomically
            return latest.heartbeat_at > first.heartbeat_at

        wait_until(beaten_again, 5, "a beat")  # and it goes on beating
    finally:
        beat.stop()
