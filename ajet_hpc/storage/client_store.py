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

This module is the store (open, recover, commit, group fsync, close); its parts: the result and its
encoding (:mod:`ajet_hpc.storage.client_records`), the journal's framing, scan and rewrite
(:mod:`ajet_hpc.storage.client_store_journal`), the HDF5 view (:mod:`ajet_hpc.storage.client_store_view`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet_hpc.storage.client_records import Result, normalized, unstorable_reason
from ajet_hpc.storage.client_store_journal import (
    StoreCorrupt,
    encode_frame,
    journal_path,
    scan_journal,
    write_journal,
)
from ajet_hpc.storage.client_store_view import VIEW_MIN_FREE, Hdf5View, build_hdf5, free_bytes, scan_hdf5
from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.lease import HeldLease, LeaseTiming, acquire_lease

__all__ = [  # the store's public names, wherever they are defined
    "LEASE_TIMING",
    "SYNC_INTERVAL_S",
    "ClientStore",
    "CommitFailed",
    "Result",
    "StoreCorrupt",
    "journal_path",
    "read_results",
    "unstorable_reason",
]

log = logging.getLogger(__name__)

_open_here: set[str] = set()  # stores open in this process (resolved paths): a second open is refused
_open_here_lock = threading.Lock()

FORMAT = 1
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


class CommitFailed(RuntimeError):
    """A commit could not be made durable (disk full, quota, I/O error); the store takes no more commits.
    Everything committed before is intact; reopening the store (a restart, a requeue) resumes from it."""


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
    jscan, hscan = scan_journal(journal), scan_hdf5(path)
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
        hdf5: Hdf5View,
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
        self._hdf5: Hdf5View | None = hdf5
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
            write_journal(journal_path(path), header, results)  # first: the journal is the truth
        if not recovered.hdf5_ok:
            build_hdf5(path, header, results)
        hdf5 = Hdf5View(path)
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
        stored, payload = normalized(result)
        frame = encode_frame(payload)
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
        free = free_bytes(self.path.parent)
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
                free = free_bytes(self.path.parent)
                if self._hdf5 is not None:
                    self._hdf5.close()
                elif self._failed is None and (free is None or free >= VIEW_MIN_FREE):
                    build_hdf5(self.path, self._header, list(self._results.values()))
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
