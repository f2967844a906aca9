"""Rendezvous files: how clients find servers.

Each server writes ``RUN/servers/<name>.json`` by rename (never in place) when it is ready, refreshes its
heartbeat while it lives and removes the file on a clean exit. A file whose heartbeat is older than
``stale_after_s`` belongs to a server that died without cleaning up (killed, node lost): clients treat it
as absent and keep waiting for the requeued server, which writes a new file with its new address.

A server that ends for good leaves its file in place with its final state: ``finished`` (training done, or
its task sources used up: ``reason`` says which) or ``failed`` (``reason`` says why); clients stop on
either instead of waiting. ``step`` and ``last_step_at`` tell ``python -m ajet_hpc.status`` how far the
training is. Files written before those fields existed read with their defaults.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from ajet_hpc.storage.atomic import read_json, write_json_atomic

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


def read(path: Path) -> Rendezvous | None:
    """The rendezvous in ``path``; None when absent. A file of another format is an error."""
    raw = read_json(path)
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
