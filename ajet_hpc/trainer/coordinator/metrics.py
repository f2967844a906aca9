"""RUN/metrics.jsonl: one JSON row per training step and model, appended and fsync'ed.

On resume from a checkpoint at step ``k``, rows of that model past ``k`` (steps that will run again) are
removed first, so the file ends with every step exactly once. Several trainable models share the file
(their rows interleave; the ``model`` column tells them apart): appends and the rewrite of a resume hold a
POSIX lock on ``metrics.jsonl.lock`` (``lockf``, which network file systems honour), so one server's
resume never drops another's rows. Where POSIX locks do not work (NFS without lockd: ENOLCK, EOPNOTSUPP),
the lock is a file created with ``O_EXCL`` instead (``metrics.jsonl.xlock``: host, pid, time; one left by a
dead or stuck holder is taken over after ``XLOCK_STALE_S``), with a warning once per process.

Besides step rows the file holds *event rows*: ``{"event": ..., "model": ..., "reason": ..., "time": ...}``
(a restart of the trainer's ranks, a server that failed or ended early). An event row has an ``event`` key and
no ``step`` key; ``read_rows`` returns step rows only, ``read_events`` event rows only, and a resume never
drops events (they happened, whatever step is trained again).

*Eval rows* (``{"eval": <eval group>, "model": ..., "step": ..., "eval_pass@1": ...}``, one per eval round,
``trainer/coordinator/evaluation.py``) carry the step they evaluated: ``read_eval_rows`` returns them,
``read_rows`` does not, and a resume drops those past its checkpoint with the step rows (their rounds run
again).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ajet_hpc.storage.files import append_jsonl, holder_dead, read_jsonl, write_bytes_atomic

log = logging.getLogger(__name__)

EVENT = "event"
EVAL = "eval"
NO_POSIX_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
XLOCK_STALE_S = 30.0  # an O_EXCL lock file older than this is left by a dead or stuck holder
XLOCK_POLL_S = 0.02
_warned: set[str] = set()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The step rows of a metrics file (also the rows of other JSONL files without events, e.g. swaps)."""
    return [row for row in _read_all(path) if EVENT not in row and EVAL not in row]


def read_eval_rows(path: Path, model: str | None = None) -> list[dict[str, Any]]:
    """The eval rows of a metrics file (of ``model`` only, unless None), in the order written."""
    return [row for row in _read_all(path) if EVAL in row and model in (None, row.get("model"))]


def last_step(path: Path, model: str) -> int:
    """The last step of ``model``'s rows (0 when it has none, or there is no file)."""
    return max((row["step"] for row in read_rows(path) if row.get("model") == model), default=0)


def read_events(path: Path, model: str | None = None) -> list[dict[str, Any]]:
    """The event rows of a metrics file (of ``model`` only, unless None), in the order written."""
    return [row for row in _read_all(path) if EVENT in row and model in (None, row.get("model"))]


def _read_all(path: Path) -> list[dict[str, Any]]:
    return list(read_jsonl(path))  # a torn last line from a crash mid-append is skipped


def append_row(path: Path, row: dict[str, Any]) -> None:
    missing = [key for key in ("step", "model") if key not in row]
    if missing:
        raise ValueError(f"a metrics row needs {missing}")
    if EVENT in row:
        raise ValueError(f"a step row has no {EVENT!r} key; write events with append_event")
    _append(path, row)


def append_eval_row(path: Path, row: dict[str, Any]) -> None:
    """Append an eval round's row (``eval``, ``model`` and ``step``: the step whose policy it evaluated)."""
    missing = [key for key in (EVAL, "step", "model") if key not in row]
    if missing:
        raise ValueError(f"an eval row needs {missing}")
    _append(path, row)


def append_event(path: Path, model: str, event: str, reason: str, **fields: Any) -> dict[str, Any]:
    """Append an event row (``event`` names it, ``reason`` says why, ``fields`` add details such as
    ``at_step``); returns the row."""
    if "step" in fields:
        raise ValueError("an event row has no 'step' key (readers take it for a step row); use 'at_step'")
    row = {EVENT: event, "model": model, "reason": reason, **fields, "time": time.time()}
    _append(path, row)
    return row


def _append(path: Path, row: dict[str, Any]) -> None:
    with _locked(path):
        append_jsonl(path, row)


def truncate_after(path: Path, model: str, step: int) -> int:
    """Drop ``model``'s rows with a step above ``step`` (and torn lines); returns how many were dropped."""
    with _locked(path):
        rows = _read_all(path)
        kept = [
            row for row in rows if row.get("model") != model or EVENT in row or row.get("step", 0) <= step
        ]
        dropped = len(rows) - len(kept)
        if path.exists() and (dropped or len(rows) != _line_count(path)):
            write_bytes_atomic(path, "".join(json.dumps(row) + "\n" for row in kept).encode())
    return dropped


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.with_name(path.name + ".lock").open("a") as lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in NO_POSIX_LOCKS:
                raise
            _warn_once(path, exc)
            with _exclusive_file(path.with_name(path.name + ".xlock")):
                yield
            return
        try:
            yield
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)


def _warn_once(path: Path, exc: OSError) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning(
            "%s: POSIX locks do not work on this file system (%s); locking with an O_EXCL lock file instead",
            path,
            exc,
        )


@contextlib.contextmanager
def _exclusive_file(lock: Path) -> Iterator[None]:
    """Hold ``lock`` (created with O_EXCL, atomic on NFSv3+ and local file systems) while inside."""
    token = secrets.token_hex(8)
    mine = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": token, "time": time.time()})
    while True:
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            _take_if_stale(lock)
            time.sleep(XLOCK_POLL_S)
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(mine)
        break
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if lock.read_text() == mine:  # not taken over meanwhile (we were stuck past XLOCK_STALE_S)
                lock.unlink()


def _take_if_stale(lock: Path) -> None:
    """Remove ``lock`` if its holder is dead (this host) or it is older than XLOCK_STALE_S; logged."""
    try:
        text = lock.read_text()
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    try:
        holder = json.loads(text)
    except ValueError:
        holder = {}  # being written this instant, or garbage: only its age can tell
    dead = holder_dead(holder.get("host"), int(holder.get("pid", 0)))
    if not dead and age <= XLOCK_STALE_S:
        return
    aside = lock.with_name(f"{lock.name}.stale-{secrets.token_hex(4)}")
    try:
        os.rename(lock, aside)  # one taker wins the rename
    except FileNotFoundError:
        return
    if aside.read_text() != text:  # another taker replaced it meanwhile: a fresh lock, put it back
        with contextlib.suppress(FileExistsError):
            os.link(aside, lock)
    else:
        log.warning("%s: taking over a lock file left by %s (%.0f s old)", lock, holder or "?", age)
    aside.unlink(missing_ok=True)


def _line_count(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())
