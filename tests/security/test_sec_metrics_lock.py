"""metrics.jsonl where POSIX locks do not work (issue 14, item 14): NFS mounted without lockd answers
``lockf`` with ENOLCK. A test machine's file systems all support POSIX locks, so the failure is injected:
``fcntl.lockf`` is replaced by one that raises ENOLCK (in this process and in the forked writer)."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest

from ajet_hpc.trainer.coordinator import metrics


@pytest.fixture(autouse=True)
def no_posix_locks(monkeypatch: pytest.MonkeyPatch) -> None:
    def lockf(fd: object, cmd: int, *args: object) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(metrics.fcntl, "lockf", lockf)
    monkeypatch.setattr(metrics, "_warned", set())


def test_appends_and_resume_work_without_posix_locks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3):
        metrics.append_row(path, {"step": step, "model": "policy"})
    metrics.append_event(path, "policy", "restart", "test")
    assert metrics.truncate_after(path, "policy", 1) == 2
    assert [row["step"] for row in metrics.read_rows(path)] == [1]
    assert len(metrics.read_events(path)) == 1
    assert caplog.text.count("POSIX locks do not work") == 1  # warned once
    assert not (tmp_path / "metrics.jsonl.xlock").exists()


def _append_one(path: str) -> None:
    metrics.append_row(Path(path), {"step": 9, "model": "other"})


def test_the_fallback_lock_excludes_another_process(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics.append_row(path, {"step": 1, "model": "policy"})
    writer = multiprocessing.get_context("fork").Process(target=_append_one, args=(str(path),))
    with metrics._locked(path):
        writer.start()
        time.sleep(0.5)
        assert writer.is_alive() and len(metrics.read_rows(path)) == 1  # it waits for the lock
    writer.join(10)
    assert writer.exitcode == 0
    assert [row["model"] for row in metrics.read_rows(path)] == ["policy", "other"]


def test_a_lock_file_of_a_dead_holder_is_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    dead = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    holder = {"host": socket.gethostname(), "pid": dead.pid, "token": "x", "time": time.time()}
    (tmp_path / "metrics.jsonl.xlock").write_text(json.dumps(holder))
    metrics.append_row(path, {"step": 1, "model": "policy"})
    assert [row["step"] for row in metrics.read_rows(path)] == [1]
    assert "taking over a lock file" in caplog.text
