"""Rendezvous files: how clients find servers.

Each server writes ``RUN/servers/<name>.json`` by rename (never in place) when it is ready, refreshes its
heartbeat while it lives and removes the file on a clean exit. A file whose heartbeat is older than
``stale_after_s`` belongs to a server that died without cleaning up (killed, node lost): clients treat it
as absent and keep waiting for the requeued server, which writes a new file with its new address.

A server that ends for good leaves its file in place with its final state: ``finished`` (training done, or
its task sources used up: ``reason`` says which) or ``failed`` (``reason`` says why); clients stop on
either instead of waiting. ``step`` and ``last_step_at`` tell ``python -m ajet_hpc.status`` how far the
training is. Files written before those fields existed read with their defaults.

A rendezvous tells clients where to connect, so ``read`` trusts only a file owned by the reader's user and
writable by nobody else (``UntrustedRendezvous`` otherwise, naming owner and mode): a neighbour who can write
into ``servers/`` cannot redirect the run's clients. The handshake (``client/handshake.py``) is the second
line: even a trusted-looking file leads to no secret unless the server proves it holds it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ajet_hpc.storage.files import write_json_atomic

FORMAT = 1
HEARTBEAT_S = 5.0
STALE_AFTER_S = 30.0
FINAL_STATES = ("finished", "failed")


@dataclass(frozen=True)
class Rendezvous:
    name: str
    url: str
    host: str
    port: int
    pid: int
    job_id: str
    node: str
    state: str = "ready"
    policy_version: int = 0
    step: int = 0  # the last trained step (0: none yet, or no trainer)
    last_step_at: float | None = None  # when that step was recorded (time.time())
    reason: str | None = None  # why the server finished or failed
    started_at: float = 0.0
    heartbeat_at: float = 0.0
    format: int = FORMAT

    def age_s(self, now: float | None = None) -> float:
        return (now if now is not None else time.time()) - self.heartbeat_at

    def is_stale(self, stale_after_s: float = STALE_AFTER_S) -> bool:
        return self.age_s() > stale_after_s

    @property
    def final(self) -> bool:
        """The server ended for good (``finished`` or ``failed``): nobody should wait for it."""
        return self.state in FINAL_STATES


def publish(path: Path, rendezvous: Rendezvous) -> Rendezvous:
    """Write (or refresh) a rendezvous file with a new heartbeat; returns what was written."""
    fresh = dataclasses.replace(rendezvous, heartbeat_at=time.time())
    write_json_atomic(path, dataclasses.asdict(fresh))
    return fresh


class UntrustedRendezvous(ValueError):
    """A rendezvous file that another user owns or may write: nobody connects where it points."""


def _untrusted(info: os.stat_result, uid: int) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != uid:
        return f"it is owned by uid {info.st_uid}, not by you (uid {uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write it (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def read_trusted_json(path: Path, uid: int | None = None) -> Any | None:
    """The parsed file, or None when absent; ``UntrustedRendezvous`` unless it is a regular file (not a
    link) owned by ``uid`` (this user by default) and not writable by group or others. The checks and the
    read use one open file, so the file cannot be swapped in between."""
    uid = os.getuid() if uid is None else uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link
        raise UntrustedRendezvous(f"refusing the rendezvous {path}: {exc.strerror}{_FIX}") from exc
    with os.fdopen(fd, "rb") as handle:
        why = _untrusted(os.fstat(fd), uid)
        if why is not None:
            raise UntrustedRendezvous(f"refusing the rendezvous {path}: {why}{_FIX}")
        return json.loads(handle.read())


_FIX = (
    ". Only the run's own servers write there; another user may have planted it. Remove it, and keep the "
    "run directory private (0700, or 0750 with cluster.share_group)"
)


def read(path: Path) -> Rendezvous | None:
    """The rendezvous in ``path``; None when absent. A file of another format is an error, and so is one
    another user owns or may write (``UntrustedRendezvous``)."""
    raw = read_trusted_json(path)
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{path}: not a rendezvous file of format {FORMAT}")
    known = {field.name for field in dataclasses.fields(Rendezvous)}
    return Rendezvous(**{key: value for key, value in raw.items() if key in known})


def withdraw(path: Path, mine: Rendezvous) -> bool:
    """Remove the file if it is still ours (a requeued server may already have written a new one)."""
    current = read(path)
    if current is None or (current.node, current.pid, current.started_at) != (
        mine.node,
        mine.pid,
        mine.started_at,
    ):
        return False
    path.unlink(missing_ok=True)
    return True
