"""The client store: which (task_id, repeat) pairs one client array task has finished, and their results.

One store per array task, one writer (the runner of that task, possibly from several threads)::

    RUN/data/clients/<group>/<index>.h5           HDF5 view: one row per result, a commit counter written last
    RUN/data/clients/<group>/<index>.h5.journal   append-only journal: the durable truth

An HDF5 file cut at an arbitrary byte offset (power loss, a full quota) usually cannot be opened at all: its
metadata lives anywhere in the file. So the HDF5 file is a *view*, and durability comes from the journal:

- The journal is a sequence of records ``MAGIC(4) | length(u32 LE) | crc32(length bytes + payload)(u32 LE)
  | payload``; the payload is canonical UTF-8 JSON (which never holds the byte 0xFF that starts MAGIC). The
  first record is the header (format, group, index, created_at); every other record is one result. The
  journal is born whole (written to a temporary file, fsynced, renamed): it is never seen without its header.
- ``commit`` appends one record with a single ``write``: **a result is committed once its record is written**,
  and ``commit`` returns only then. It is then in the kernel's page cache: it survives the process being
  killed. Records reach the storage in group commits: one fsync at most every ``sync_interval_s`` (default
  30 s) for every record written since, by the commit itself when the interval has passed, else by the store's
  sync thread when it does, and at ``close``; so a task committing a result a second fsyncs once per 30 of
  them, not once per result (docs/scaling.md). A node that dies loses at most the last interval's records:
  their episodes were ended at the servers first, and the runner's next start commits them from there
  (``commit_recorded``), so nothing runs or trains twice. The HDF5 row is written after the record (columns
  first, the ``committed`` counter attribute last, then ``flush``); every row carries the crc32 of the
  result's payload.
- ``open`` reads both files. From the journal it keeps every whole record up to the first torn one (a torn
  tail is what truncation leaves); from the HDF5 file every row under the counter whose checksum matches. The
  store is the journal's results followed by any the HDF5 file holds that the journal lost. Whatever disagrees
  with that (a torn journal tail, rows past the counter, an unreadable or lagging HDF5 file) is rewritten from
  it: the journal by atomic replace, the HDF5 file by atomic rebuild. An HDF5 file whose writer did not close
  it (its ``writer_open`` attribute is still 1) is always rebuilt: a killed writer can leave HDF5's own
  structures (global heap, B-trees) damaged where every row still verifies, and appending then fails.

Recovery guarantee, for a journal truncated at byte offset ``k``: the store holds every result whose journal
record ends at or before ``k`` (plus any a readable HDF5 file still holds), each exactly as committed, and
nothing else. ``StoreCorrupt`` is raised only when no header survives: the journal's header record does not
end before ``k`` (or the journal is missing) *and* the HDF5 file cannot be read. Damage that truncation cannot
explain (a bad record with whole records after it, a file that is not a journal, a group/index mismatch) also
raises ``StoreCorrupt`` rather than dropping results silently.

HDF5 files are opened with ``locking=False``: shared file systems without locks (NFS) fail otherwise. One
writer per store, across hosts: ``open`` takes the store's writer lease (``<index>.h5.lease``, the server
store's :mod:`ajet_hpc.storage.lease`: link-based, no POSIX locks) before it reads or rewrites anything, and
``commit`` confirms it; a second runner of the same task, from any host, is refused with the live holder's
name, and a lease whose heartbeat stopped is taken over (logged).

A commit that fails (disk full, quota, I/O error) leaves the store at its last commit and raises
:class:`CommitFailed`; so does every later commit: the runner must stop (and a requeue resume from the store).
A group fsync that fails does the same to every later commit.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ajet_hpc.storage.files import fsync_dir, write_bytes_atomic
from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.lease import HeldLease, LeaseTiming, acquire_lease

log = logging.getLogger(__name__)

_open_here: set[str] = set()  # stores open in this process (resolved paths): a second open is refused
_open_here_lock = threading.Lock()

FORMAT = 1
JOURNAL_SUFFIX = ".journal"
MAGIC = b"\xffAJR"
_FRAME = struct.Struct("<4sII")  # magic, payload length, crc32 of (length bytes + payload)
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


class StoreCorrupt(Exception):
    """A client store that cannot be used as it is; the message names the file and what is wrong."""


class CommitFailed(RuntimeError):
    """A commit could not be made durable (disk full, quota, I/O error); the store takes no more commits.
    Everything committed before is intact; reopening the store (a restart, a requeue) resumes from it."""


@dataclass(frozen=True)
class Result:
    task_id: str
    repeat: int
    reward: float
    rewards: dict[str, float]
    episode_ids: dict[str, str]
    transcript: str | None
    metadata: dict
    finished_at: float

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.repeat)


def journal_path(path: Path) -> Path:
    """The journal that goes with the HDF5 file ``path``: ``<index>.h5.journal``."""
    return path.with_name(path.name + JOURNAL_SUFFIX)


# --- encoding -------------------------------------------------------------------------------------------


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _record(result: Result) -> dict[str, Any]:
    if not isinstance(result.task_id, str):
        raise TypeError(f"task_id must be a str, not {type(result.task_id).__name__}")
    if isinstance(result.repeat, bool) or not isinstance(result.repeat, int | np.integer):
        raise TypeError(f"repeat must be an int, not {type(result.repeat).__name__}")
    if result.transcript is not None and not isinstance(result.transcript, str):
        raise TypeError(f"transcript must be a str or None, not {type(result.transcript).__name__}")
    if not isinstance(result.metadata, dict):
        raise TypeError(f"metadata must be a dict, not {type(result.metadata).__name__}")
    return {
        "kind": "result",
        "task_id": result.task_id,
        "repeat": int(result.repeat),
        "reward": float(result.reward),
        "rewards": {str(name): float(value) for name, value in result.rewards.items()},
        "episode_ids": {str(name): str(value) for name, value in result.episode_ids.items()},
        "transcript": result.transcript,
        "metadata": result.metadata,
        "finished_at": float(result.finished_at),
    }


def _result_from_record(record: dict[str, Any]) -> Result:
    return Result(
        task_id=record["task_id"],
        repeat=int(record["repeat"]),
        reward=float(record["reward"]),
        rewards={str(k): float(v) for k, v in record["rewards"].items()},
        episode_ids={str(k): str(v) for k, v in record["episode_ids"].items()},
        transcript=record["transcript"],
        metadata=dict(record["metadata"]),
        finished_at=float(record["finished_at"]),
    )


def _payload(result: Result) -> bytes:
    return _canonical(_record(result)).encode("utf-8")


def _normalized(result: Result) -> tuple[Result, bytes]:
    """The result exactly as it reads back after a reopen, and its journal payload (TypeError/ValueError
    for a result that cannot be stored: nothing is written then)."""
    stored = _result_from_record(json.loads(_payload(result)))
    return stored, _payload(stored)  # canonical form of what reads back (int dict keys became str...)


def unstorable_reason(result: Result) -> str | None:
    """Why ``result`` cannot be committed (a value that is no JSON, text with a lone surrogate, which UTF-8
    and so the journal cannot hold), naming where; None when it can. Checked before an episode ends, so
    that such a result aborts its episode at once instead of failing its commit afterwards."""
    try:
        _normalized(result)
    except (TypeError, ValueError) as exc:
        where = _surrogate_path({"metadata": result.metadata, "transcript": result.transcript})
        if where is not None:
            return f"{where} holds a lone surrogate, which is not valid Unicode and cannot be stored"
        return f"{type(exc).__name__}: {exc}"
    return None


def _surrogate_path(value: Any, path: str = "outcome") -> str | None:
    if isinstance(value, str):
        return path if any("\ud800" <= ch <= "\udfff" for ch in value) else None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, child in items:
        if isinstance(key, str) and _surrogate_path(key) is not None:
            return f"{path} (the key {key!r})"
        found = _surrogate_path(child, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found is not None:
            return found
    return None


def _frame(payload: bytes) -> bytes:
    length = struct.pack("<I", len(payload))
    return MAGIC + length + struct.pack("<I", zlib.crc32(payload, zlib.crc32(length))) + payload


def _parse_frame(data: bytes, offset: int) -> tuple[bytes, int] | None:
    """(payload, end) of the whole, checksummed record at ``offset``; None if it is torn or damaged."""
    body = offset + _FRAME.size
    if body > len(data):
        return None
    magic, length, crc = _FRAME.unpack_from(data, offset)
    end = body + length
    if magic != MAGIC or end > len(data):
        return None
    payload = data[body:end]
    if zlib.crc32(payload, zlib.crc32(data[offset + 4 : offset + 8])) != crc:
        return None
    return payload, end


def _next_frame(data: bytes, start: int) -> int | None:
    """Offset of the first whole record at or after ``start``, if any."""
    at = data.find(MAGIC, start)
    while at >= 0:
        if _parse_frame(data, at) is not None:
            return at
        at = data.find(MAGIC, at + 1)
    return None


# --- reading both files (never writes) ------------------------------------------------------------------


@dataclass
class _JournalScan:
    exists: bool
    header: dict[str, Any] | None = None
    results: list[Result] = field(default_factory=list)
    valid_end: int = 0  # the byte after the last whole record
    size: int = 0
    problem: str = ""


def _scan_journal(path: Path) -> _JournalScan:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return _JournalScan(exists=False, problem="missing")
    scan = _JournalScan(exists=True, size=len(data))
    if not MAGIC.startswith(data[: len(MAGIC)]):
        raise StoreCorrupt(f"{path}: not a client store journal (it does not start with {MAGIC!r})")
    offset = 0
    seen: set[tuple[str, int]] = set()
    while (frame := _parse_frame(data, offset)) is not None:
        payload, end = frame
        try:
            record = json.loads(payload)
            kind = record["kind"]
            if (kind == "header") != (offset == 0):
                raise ValueError(f"a {kind!r} record where a {'header' if offset == 0 else 'result'} belongs")
            if kind == "header":
                scan.header = {k: record[k] for k in ("format", "group", "index", "created_at")}
            else:
                result = _result_from_record(record)
                if result.key in seen:
                    raise ValueError(f"{result.key} is recorded twice")
                seen.add(result.key)
                scan.results.append(result)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreCorrupt(f"{path}: record at byte {offset} is whole but invalid: {exc}") from exc
        offset = end
    scan.valid_end = offset
    if offset < len(data):
        later = _next_frame(data, offset + 1)
        if later is not None:
            raise StoreCorrupt(
                f"{path}: damaged record at byte {offset} with whole records after it (byte {later}); "
                "this is not a torn tail, and dropping it would lose committed results"
            )
    if scan.header is None:
        scan.problem = f"its header record is cut short ({len(data)} bytes)"
    return scan


@dataclass
class _Hdf5Scan:
    exists: bool
    header: dict[str, Any] | None = None
    results: list[Result] = field(default_factory=list)
    clean: bool = False  # every row is under the counter and verifies
    problem: str = ""


def _scan_hdf5(path: Path) -> _Hdf5Scan:
    if not path.exists():
        return _Hdf5Scan(exists=False, problem="missing")
    scan = _Hdf5Scan(exists=True)
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
            verified = zlib.crc32(_payload(result)) == int(columns["crc"][row])
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
    return _result_from_record(
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
        "rewards": _canonical(result.rewards),
        "episode_ids": _canonical(result.episode_ids),
        "metadata": _canonical(result.metadata),
        "transcript": result.transcript or "",
        "has_transcript": result.transcript is not None,
        "crc": zlib.crc32(_payload(result)),
    }


@dataclass
class _Recovered:
    header: dict[str, Any]
    results: list[Result]
    journal_ok: bool  # the journal holds exactly these results, nothing after them
    hdf5_ok: bool  # the HDF5 file was closed cleanly and holds exactly these results
    notes: list[str] = field(default_factory=list)  # what open repairs, for the log


def _recover(path: Path) -> _Recovered | None:
    """What the two files of a store hold together; None when neither exists."""
    journal = journal_path(path)
    jscan, hscan = _scan_journal(journal), _scan_hdf5(path)
    if not jscan.exists and not hscan.exists:
        return None
    header = jscan.header or hscan.header
    if header is None:
        raise StoreCorrupt(
            f"{path}: the store header is gone: journal {journal} {jscan.problem}, and {path.name} "
            f"{hscan.problem}. Its committed results cannot be recovered; move both files away to start "
            "this array task afresh (it will re-run its episodes)."
        )
    if header["format"] != FORMAT:
        raise StoreCorrupt(f"{path}: store format {header['format']}, this code reads format {FORMAT}")
    if jscan.header and hscan.header and _identity(jscan.header) != _identity(hscan.header):
        raise StoreCorrupt(
            f"{journal} belongs to group/index {_identity(jscan.header)} but {path} to "
            f"{_identity(hscan.header)}: the two files are from different stores"
        )
    results = list(jscan.results)
    known = {result.key: result for result in results}
    notes = []
    for result in hscan.results:
        if result.key not in known:
            results.append(result)
        elif known[result.key] != result:
            notes.append(f"{path}: row {result.key} differs from its journal record; the journal's is kept")
    if not jscan.exists:
        notes.append(f"{journal}: missing; rewritten from {path.name}")
    elif jscan.header is None or jscan.valid_end < jscan.size:
        lost = jscan.size - jscan.valid_end
        notes.append(f"{journal}: {jscan.problem or 'torn tail'}; {lost} bytes after the last whole record")
    if len(results) > len(jscan.results):
        notes.append(f"{path}: {len(results) - len(jscan.results)} results recovered that the journal lacked")
    journal_ok = jscan.header is not None and jscan.valid_end == jscan.size and results == jscan.results
    hdf5_ok = hscan.clean and hscan.header == header and hscan.results == results
    if not hdf5_ok:
        notes.append(f"{path}: {hscan.problem or 'behind the journal'}; rebuilt from the journal")
    return _Recovered(header, results, journal_ok, hdf5_ok, notes)


def _identity(header: dict[str, Any]) -> tuple[str, int]:
    return (header["group"], header["index"])


def read_results(path: Path) -> list[Result]:
    """The committed results of a store, read without writing anything (for status tools). A store being
    written concurrently reads as some consistent prefix of its commits."""
    recovered = _recover(Path(path))
    if recovered is None:
        raise FileNotFoundError(f"{path}: no client store here (nor {journal_path(Path(path)).name})")
    return recovered.results


# --- writing ----------------------------------------------------------------------------------------------


def _write_journal(path: Path, header: dict[str, Any], results: list[Result]) -> None:
    """Replace the journal with one holding ``header`` and ``results`` (atomic: old or new, never a mix)."""
    frames = [_frame(_canonical({"kind": "header", **header}).encode("utf-8"))]
    frames += [_frame(_payload(result)) for result in results]
    write_bytes_atomic(path, b"".join(frames))
    fsync_dir(path.parent)


def _build_hdf5(path: Path, header: dict[str, Any], results: list[Result]) -> None:
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


SYNC_INTERVAL_S = 30.0
"""Longest time a written record waits for its fsync (the group commit interval): a task fsyncs its journal
at most once per 30 s, so 10,000 committing tasks make at most 333 fsyncs a second, and a task committing a
result every 3 s or more often pays at most 0.1 fsyncs per result. What a dead node loses of the last
interval was ended at the servers first; the next start commits it from there (``commit_recorded``)."""
LEASE_TIMING = LeaseTiming(heartbeat_s=60.0, timeout_s=240.0)
"""A client store's writer lease: one heartbeat a minute (an fsync of the lease file, no name looked up:
``lease.HeldLease.renew``), so that 10,000 tasks make about 170 heartbeat fsyncs a second, not 2,000. The
price: a task that dies on a node that stays up elsewhere (another host, another Slurm job) leaves a lease
that its successor takes over after 4 minutes; a dead process on the same host, or a requeue of the same
job, is taken over at once."""
VIEW_MIN_FREE = 1 << 20
"""Below this much free space, the HDF5 view is closed rather than written: an HDF5 write that fails on a
full disk can leave the library unable to close the file (a crash, with HDF5 2.0)."""
_ABANDONED: list[h5py.File] = []  # HDF5 views let go of after a failed write (see ``_Hdf5View.let_go``)


def _free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class _Hdf5View:
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


class _LeaseWatch:
    """Receives the heartbeat thread's news that the lease was taken over (``commit`` checks it anyway)."""

    def lost(self) -> None:
        log.error("a client store's writer lease was taken over: its commits are refused from now on")


def _take_lease(path: Path, timing: LeaseTiming, wait_s: float) -> HeldLease:
    """The writer lease of client store ``path``, waiting up to ``wait_s`` for a live holder to let go."""
    watch = _LeaseWatch()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lease = acquire_lease(path, timing, watch.lost)
        except StoreError as exc:
            if "another process writes this store" not in str(exc) or time.monotonic() >= deadline:
                raise
            log.info("%s: waiting for its writer lease (%s)", path, exc)
            time.sleep(min(timing.heartbeat_s, max(0.05, deadline - time.monotonic())))
            continue
        lease.watch = watch  # type: ignore[attr-defined]  # the callback holds it weakly
        return lease


class ClientStore:
    """The results of one client array task. Open with ``ClientStore.open``; safe to use from many threads."""

    def __init__(
        self,
        path: Path,
        header: dict[str, Any],
        results: list[Result],
        hdf5: _Hdf5View,
        lease: HeldLease | None = None,
        sync_interval_s: float = SYNC_INTERVAL_S,
    ) -> None:
        self.path = path
        self._lease = lease
        self.journal_path = journal_path(path)
        self.group: str = header["group"]
        self.index: int = header["index"]
        self._header = header
        self._lock = threading.Lock()
        self._results = {result.key: result for result in results}
        self._journal_fd = os.open(self.journal_path, os.O_WRONLY | os.O_APPEND)
        self._journal_size = os.fstat(self._journal_fd).st_size
        self._hdf5: _Hdf5View | None = hdf5
        self._failed: BaseException | None = None
        self._closed = False
        self._open_key: str | None = None  # set by ``open``: this process's claim on the path
        self.sync_interval_s = sync_interval_s
        self.fsyncs = 0  # group fsyncs of the journal so far (docs/scaling.md counts them per commit)
        self._synced_at = time.monotonic()
        self._unsynced = False  # records written since the last fsync
        self._sync_wake = threading.Condition(self._lock)
        self._syncer = threading.Thread(target=self._sync_loop, name=f"sync {path.name}", daemon=True)
        self._syncer.start()

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        group: str,
        index: int,
        lease_timing: LeaseTiming | None = None,
        lease_wait_s: float | None = None,
        sync_interval_s: float = SYNC_INTERVAL_S,
    ) -> ClientStore:
        """Create the store at ``path``, or reopen it: recover to the last commit, drop anything past it.

        Takes the store's writer lease first. Held by a live writer, the lease is waited for up to
        ``lease_wait_s`` (default: the lease timeout and a heartbeat: a writer that died on another node
        goes stale by then); after that :class:`~ajet_hpc.storage.h5_layout.StoreError` names the holder."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        key = str(path.resolve())
        with _open_here_lock:  # the lease would see its own process and take itself over
            if key in _open_here:
                raise StoreError(
                    f"{path} is already open in this process: close it first (one writer per store; "
                    "share the open ClientStore, which is safe from many threads)"
                )
            _open_here.add(key)
        try:
            timing = lease_timing or LEASE_TIMING
            lease = _take_lease(
                path, timing, timing.timeout_s + timing.heartbeat_s if lease_wait_s is None else lease_wait_s
            )
            try:
                store = cls._open_leased(path, group, index, lease, sync_interval_s)
            except BaseException:
                lease.release()
                raise
        except BaseException:
            with _open_here_lock:
                _open_here.discard(key)
            raise
        store._open_key = key
        return store

    @classmethod
    def _open_leased(
        cls, path: Path, group: str, index: int, lease: HeldLease, sync_interval_s: float
    ) -> ClientStore:
        recovered = _recover(path)
        if recovered is None:
            header = {"format": FORMAT, "group": group, "index": int(index), "created_at": time.time()}
            recovered = _Recovered(header, [], journal_ok=False, hdf5_ok=False)
        elif _identity(recovered.header) != (group, index):
            raise StoreCorrupt(
                f"{path}: this store belongs to group {recovered.header['group']!r} index "
                f"{recovered.header['index']}, but was opened as group {group!r} index {index}"
            )
        header, results = recovered.header, recovered.results
        for note in recovered.notes:
            log.warning("recovering %s", note)
        if not recovered.journal_ok:
            _write_journal(journal_path(path), header, results)  # first: the journal is the truth
        if not recovered.hdf5_ok:
            _build_hdf5(path, header, results)
        hdf5 = _Hdf5View(path)
        try:
            store = cls(path, header, results, hdf5, lease, sync_interval_s)
        except BaseException:
            hdf5.handle.close()
            raise
        log.info("%s: opened with %d committed results", path, len(results))
        return store

    def committed(self) -> set[tuple[str, int]]:
        with self._lock:
            return set(self._results)

    def results(self) -> list[Result]:
        """Every committed result, in commit order, exactly as it reads back after a reopen."""
        with self._lock:
            return list(self._results.values())

    def commit(self, result: Result) -> None:
        """Commit one result: its journal record is written when this returns (it survives the process),
        and fsynced within ``sync_interval_s`` (it survives the node). A second commit of the same
        (task_id, repeat) raises ValueError, so does a result that cannot be stored as JSON."""
        stored, payload = _normalized(result)
        frame = _frame(payload)
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.path}: the store is closed")
            if self._failed is not None:
                raise CommitFailed(
                    f"{self.path}: an earlier commit failed ({self._failed}); it takes no more commits: "
                    "reopen the store to recover (a restart or requeue of the task resumes from it)"
                )
            if stored.key in self._results:
                raise ValueError(f"{self.path}: {stored.key} is already committed")
            if self._lease is not None:
                self._lease.confirm()  # LeaseLost: another runner owns the store now
            try:
                self._append_journal(frame)
            except OSError as exc:
                raise CommitFailed(
                    f"{self.path}: committing {stored.key} failed ({exc}); every earlier result is "
                    "committed, this one is not: free space, then resume from the store"
                ) from exc
            self._results[stored.key] = stored
            self._append_hdf5(stored)

    def _append_journal(self, frame: bytes) -> None:
        """Write one record; fsync it (and every record before it) when the group interval has passed,
        else wake the sync thread to do it then. Called with the lock held."""
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(self._journal_fd, view) :]
            self._unsynced = True
            if time.monotonic() - self._synced_at >= self.sync_interval_s:
                self._fsync()
            else:
                self._sync_wake.notify()
        except BaseException as exc:
            self._failed = exc
            try:  # leave no torn record behind, or later records would sit after it
                os.ftruncate(self._journal_fd, self._journal_size)
                os.fsync(self._journal_fd)
            except OSError:
                log.exception("%s: could not cut a failed append back", self.journal_path)
            raise
        self._journal_size += len(frame)

    def _fsync(self) -> None:
        """fsync the journal: every record written so far is durable. Called with the lock held."""
        os.fsync(self._journal_fd)
        self.fsyncs += 1
        self._unsynced = False
        self._synced_at = time.monotonic()

    def _sync_loop(self) -> None:
        """The group commit: records written within an interval of the last fsync get one fsync when the
        interval ends. A failed fsync fails the store (every later commit raises ``CommitFailed``)."""
        with self._lock:
            while not self._closed:
                if not self._unsynced or self._failed is not None:
                    self._sync_wake.wait()
                    continue
                due = self._synced_at + self.sync_interval_s - time.monotonic()
                if due > 0:
                    self._sync_wake.wait(due)
                    continue
                try:
                    self._fsync()
                except OSError as exc:
                    self._failed = exc
                    log.error(
                        "%s: fsync of the journal failed (%s): the store takes no more commits",
                        self.journal_path,
                        exc,
                    )

    def _append_hdf5(self, result: Result) -> None:
        """The journal already holds the result; a failure here leaves the view to be rebuilt."""
        if self._hdf5 is None:
            return
        free = _free_bytes(self.path.parent)
        if free is not None and free < VIEW_MIN_FREE:
            log.error(
                "%s: %d bytes free on its file system: the HDF5 view stops here (the journal goes on; the "
                "view is rebuilt from it on close or the next open)",
                self.path,
                free,
            )
            try:
                self._hdf5.close()
            except Exception:
                log.exception("%s: closing the HDF5 view failed", self.path)
            self._hdf5 = None
            return
        try:
            self._hdf5.append(result)
        except Exception:
            log.exception("%s: HDF5 view fell behind; it is rebuilt from the journal on close", self.path)
            with contextlib.suppress(Exception):
                self._hdf5.let_go()
            self._hdf5 = None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sync_wake.notify()
            try:
                if self._unsynced and self._failed is None:
                    self._fsync()
            except OSError:
                log.exception("%s: the last fsync of the journal failed", self.journal_path)
            try:
                free = _free_bytes(self.path.parent)
                if self._hdf5 is not None:
                    self._hdf5.close()
                elif self._failed is None and (free is None or free >= VIEW_MIN_FREE):
                    _build_hdf5(self.path, self._header, list(self._results.values()))
            except Exception:
                log.exception("%s: HDF5 view not brought up to date; the next open rebuilds it", self.path)
            finally:
                self._hdf5 = None
                os.close(self._journal_fd)
                if self._lease is not None:
                    self._lease.release()
                with _open_here_lock:
                    _open_here.discard(self._open_key or "")

    def __enter__(self) -> ClientStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
