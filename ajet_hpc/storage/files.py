"""Files on shared storage that survive a crash at any instant: the one home of these helpers.

- whole files are replaced atomically (a temporary file in the same folder, fsync, rename): a reader sees
  the old or the new file, never a mix;
- append-only JSON-lines logs (metrics, journals, events) get whole lines, each fsynced before the call
  returns; a line torn by a crash is closed off by the next append and skipped by readers;
- a folder is fsynced after a rename or create in it where the entry itself must survive a power loss;
- a holder of a lock or lease written as ``{"host", "pid"}`` is known dead only on its own host.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, payload: Any) -> None:
    write_bytes_atomic(path, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any | None:
    """The parsed file, or None when it does not exist (a rename is atomic: no partial reads)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def append_jsonl(
    path: Path, row: Any, sort_keys: bool = False, default: Callable[[Any], Any] | None = None
) -> None:
    """Append ``row`` as one JSON line, durable on return. A last line torn by a crash (no newline) is
    closed off first, so that this row stays whole; ``read_jsonl`` skips the torn one. ``default``: as
    for ``json.dumps`` (e.g. ``str`` for paths in a log row)."""
    line = json.dumps(row, sort_keys=sort_keys, separators=(",", ":"), default=default).encode() + b"\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as handle:
        if handle.tell() and not _ends_with_newline(path):
            handle.write(b"\n")
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: Path) -> Iterator[Any]:
    """The rows of a JSON-lines file in order; torn or unparsable lines (a crash mid-write) are skipped."""
    if not path.exists():
        return
    with open(path, "rb") as handle:
        for line in handle:
            try:
                yield json.loads(line)
            except ValueError:
                continue


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder (their renames are durable already)
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (someone else's process counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_dead(host: str | None, pid: int | None) -> bool:
    """True only when the holder ran on this host and its process is gone: a holder on another host may
    be alive (its lock or lease is judged by age instead)."""
    return host == socket.gethostname() and pid is not None and not pid_alive(int(pid))
