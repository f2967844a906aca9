"""Rendezvous files: written by rename, stale detection, withdrawal only by their owner."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ajet_hpc.storage import rendezvous


def record(**changes) -> rendezvous.Rendezvous:
    base = rendezvous.Rendezvous(
        name="policy", url="http://127.0.0.1:1234", host="127.0.0.1", port=1234, pid=42, job_id="7", node="g1"
    )
    return dataclasses.replace(base, **changes)


def test_publish_then_read(tmp_path: Path) -> None:
    path = tmp_path / "servers" / "policy.json"
    written = rendezvous.publish(path, record())
    assert rendezvous.read(path) == written
    assert not written.is_stale()
    assert [p.name for p in path.parent.iterdir()] == ["policy.json"]  # no temporary file left


def test_missing_is_none_and_old_heartbeat_is_stale(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    assert rendezvous.read(path) is None
    written = rendezvous.publish(path, record())
    old = dataclasses.replace(written, heartbeat_at=written.heartbeat_at - 3600)
    assert old.is_stale()


def test_withdraw_removes_only_our_own_file(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    ours = rendezvous.publish(path, record())
    successor = rendezvous.publish(path, record(pid=43, node="g2", started_at=ours.started_at + 5))
    assert not rendezvous.withdraw(path, ours)
    assert rendezvous.read(path) == successor
    assert rendezvous.withdraw(path, successor)
    assert not path.exists()


def test_foreign_format_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="not a rendezvous file of format 1"):
        rendezvous.read(path)
