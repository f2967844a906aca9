"""The HDF5 view of a client store, ``<index>.h5``: one row per result (columns first, the ``committed``
counter attribute last, then ``flush``), each row carrying the crc32 of the result's journal payload. Its
scan, its atomic rebuild from the journal, and the open file a store appends to. The view is never the
truth (the journal is: :mod:`ajet_hpc.storage.client_store_journal`); the store that keeps both:
:mod:`ajet_hpc.storage.client_store`.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ajet_hpc.storage.client_records import Result, canonical, result_from_record, result_payload
from ajet_hpc.storage.files import fsync_dir

_CHUNK_ROWS = 256
_STR = h5py.string_dtype()
# HDF5 columns, one row per result; "crc" is crc32 of the result's journal payload.
_COLUMNS: dict[str, Any] = {
    "task_id": _STR,
    "repeat": np.int64,
    "reward": np.float64,
    "finished_at": np.float64,
    "rewards": _STR,  # JSON
    "episode_ids": _STR,  # JSON
    "metadata": _STR,  # JSON
    "transcript": _STR,
    "has_transcript": np.uint8,
    "crc": np.uint32,
}
_COUNTER = "committed"
# 1 while a writer has the file open. A writer that dies (SIGKILL, node lost) can leave HDF5's own structures
# (its global heap, B-trees) inconsistent even where every row still verifies, and appending then fails:
# such a file is rebuilt, never written into again.
_WRITING = "writer_open"
VIEW_MIN_FREE = 1 << 20
"""Below this much free space, the HDF5 view is closed rather than written: an HDF5 write that fails on a
full disk can leave the library unable to close the file (a crash, with HDF5 2.0)."""
_ABANDONED: list[h5py.File] = []  # HDF5 views let go of after a failed write (see ``Hdf5View.let_go``)


@dataclass
class Hdf5Scan:
    exists: bool
    header: dict[str, Any] | None = None
    results: list[Result] = field(default_factory=list)
    clean: bool = False  # every row is under the counter and verifies
    problem: str = ""


def scan_hdf5(path: Path) -> Hdf5Scan:
    if not path.exists():
        return Hdf5Scan(exists=False, problem="missing")
    scan = Hdf5Scan(exists=True)
    try:
        with h5py.File(path, "r", locking=False) as handle:
            attrs = handle.attrs
            scan.header = {
                "format": int(attrs["format"]),
                "group": str(attrs["group"]),
                "index": int(attrs["index"]),
                "created_at": float(attrs["created_at"]),
            }
            count = int(attrs[_COUNTER])
            writing = bool(attrs.get(_WRITING, True))
            columns = {
                name: (handle[name].asstr()[...] if dtype is _STR else handle[name][...])
                for name, dtype in _COLUMNS.items()
            }
    except Exception as exc:  # h5py raises OSError, KeyError, ValueError... for damaged files
        scan.problem = f"cannot be read ({type(exc).__name__}: {exc})"
        return scan
    rows = min(len(column) for column in columns.values())
    for row in range(min(count, rows)):
        try:
            result = _row_result(columns, row)
            verified = zlib.crc32(result_payload(result)) == int(columns["crc"][row])
        except (ValueError, KeyError, TypeError, AttributeError):
            verified = False
        if not verified:
            scan.problem = f"row {row} fails its checksum"
            return scan
        scan.results.append(result)
    if rows < count:
        scan.problem = f"its counter says {count} rows but it holds {rows}"
    elif any(len(column) != count for column in columns.values()):
        scan.problem = f"it holds rows past its counter ({count})"
    elif writing:
        scan.problem = "its last writer did not close it"
    else:
        scan.clean = True
    return scan


def _row_result(columns: dict[str, np.ndarray], row: int) -> Result:
    return result_from_record(
        {
            "task_id": str(columns["task_id"][row]),
            "repeat": columns["repeat"][row],
            "reward": columns["reward"][row],
            "rewards": json.loads(columns["rewards"][row]),
            "episode_ids": json.loads(columns["episode_ids"][row]),
            "transcript": str(columns["transcript"][row]) if columns["has_transcript"][row] else None,
            "metadata": json.loads(columns["metadata"][row]),
            "finished_at": columns["finished_at"][row],
        }
    )


def _row_values(result: Result) -> dict[str, Any]:
    return {
        "task_id": result.task_id,
        "repeat": result.repeat,
        "reward": result.reward,
        "finished_at": result.finished_at,
        "rewards": canonical(result.rewards),
        "episode_ids": canonical(result.episode_ids),
        "metadata": canonical(result.metadata),
        "transcript": result.transcript or "",
        "has_transcript": result.transcript is not None,
        "crc": zlib.crc32(result_payload(result)),
    }


def build_hdf5(path: Path, header: dict[str, Any], results: list[Result]) -> None:
    """Replace the HDF5 view with one holding ``results`` (written aside, fsynced, renamed)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        rows = [_row_values(result) for result in results]
        with h5py.File(tmp, "w", locking=False) as handle:
            for key, value in header.items():
                handle.attrs[key] = value
            for name, dtype in _COLUMNS.items():
                data = np.array([row[name] for row in rows], dtype=object if dtype is _STR else dtype)
                handle.create_dataset(name, data=data, dtype=dtype, maxshape=(None,), chunks=(_CHUNK_ROWS,))
            handle.attrs[_COUNTER] = len(rows)
            handle.attrs[_WRITING] = 0
        with open(tmp, "rb+") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Hdf5View:
    """The open HDF5 file of a store: rows appended, counter last, flushed."""

    def __init__(self, path: Path) -> None:
        self.handle = h5py.File(path, "r+", locking=False)
        self.rows = int(self.handle.attrs[_COUNTER])
        self.handle.attrs[_WRITING] = 1
        self.handle.flush()

    def append(self, result: Result) -> None:
        values = _row_values(result)
        for name in _COLUMNS:
            dataset = self.handle[name]
            dataset.resize((self.rows + 1,))
            dataset[self.rows] = values[name]
        self.handle.attrs[_COUNTER] = self.rows + 1
        self.handle.flush()
        self.rows += 1

    def close(self) -> None:
        fd = self.handle.id.get_vfd_handle()
        try:
            self.handle.attrs[_WRITING] = 0
            self.handle.flush()
            os.fsync(fd)
            self.handle.close()
        except Exception:
            self.let_go(fd)
            raise

    def let_go(self, fd: int | None = None) -> None:
        """Drop the view after a failed write (disk full) without writing to the file again. HDF5 cannot
        close a file whose metadata flush failed (its close crashes the process: seen with HDF5 2.0), so
        the handle is kept, never used again, its descriptor pointed at a scratch file. The file keeps
        ``writer_open`` 1, so the next open rebuilds it from the journal."""
        if fd is None:
            fd = self.handle.id.get_vfd_handle()
        with tempfile.TemporaryFile() as scratch:
            os.dup2(scratch.fileno(), fd)
        _ABANDONED.append(self.handle)
