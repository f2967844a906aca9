"""The server store's writer: appends one model's closed episodes and training steps to RUN/data/<model>.h5.

One writer per store, the server process (:class:`EpisodeWriter`, called from its recorder thread, one
lock), holding the store's writer lease (:mod:`ajet_hpc.storage.lease`); it creates the file, or reopens it
recovering to the last commit: after a crash it shrinks every dataset back to the ``commit`` counter. The
file is in HDF5 SWMR mode, so readers (:mod:`ajet_hpc.storage.episode_store_reader`) read it while it is
written. An append is committed when it returns: its data written, flushed and fsynced, then the ``commit``
counter written and flushed. ``append_records`` commits several records as one group (one fsync for all:
what makes a busy server's recorder cheap; the group is committed all or nothing). The big columns go to the
file a full chunk at a time, compressed here (inline, or on the writer's threads) and written once; the open
chunk lives in a tail slot until it fills, and ``seal`` / ``close`` make the file whole for plain HDF5
readers. The records it takes, and their encoding: :mod:`ajet_hpc.storage.records`; the counter:
:mod:`ajet_hpc.storage.episode_store_commit`; the layout and its reasons: :mod:`ajet_hpc.storage.h5_layout`,
docs/storage.md.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from ajet_hpc.storage.episode_store_commit import SPACE_INDEX, read_commit
from ajet_hpc.storage.h5_layout import (
    OFFSETS,
    ROWS,
    SEALED,
    SPACES,
    TAIL,
    StoreError,
    check_not_truncated,
    clear_stale_write_flags,
    clear_write_flags,
    commit_check,
    create_file,
    open_file,
    open_uncached,
    repair_truncated,
    write_at,
    writer_identity,
)
from ajet_hpc.storage.h5_sealed_columns import SealedColumn
from ajet_hpc.storage.lease import HeldLease, Lease, LeaseLost, LeaseTiming, acquire_lease, close_detached
from ajet_hpc.storage.records import (
    Append,
    EpisodeRecord,
    StepRecord,
    encode_episode,
    encode_step,
    join_appends,
)

__all__ = ["EpisodeWriter", "UnstorableRecord", "WriterStats"]

log = logging.getLogger(__name__)

_COMPRESS_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))  # threads compressing a group's chunks
_Chunk = tuple[SealedColumn, int, np.ndarray, Future[bytes] | None]
"""A chunk a group filled: its column, index, data, and its compression (None: compressed at write time)."""


class UnstorableRecord(StoreError):
    """A record that can never be stored (not closed, metadata not JSON, ids outside int32), refused before
    the file is touched; ``index`` is its position in the records handed to ``append_records``."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


@dataclass
class WriterStats:
    """What a writer has done since it was opened (read by the recorder's tests and the benchmark)."""

    commits: int = 0  # commit groups (an append_episode or append_step is a group of one)
    episodes: int = 0  # committed episodes
    steps: int = 0  # committed steps
    fsyncs: int = 0  # fsyncs of the store's file: one per commit, one at close
    failed: int = 0  # appends that failed while writing (disk full, I/O error), nothing committed


_OPEN_WRITERS: set[str] = set()
_OPEN_WRITERS_LOCK = threading.Lock()


class EpisodeWriter:
    """Appends episodes and steps to one store; creates it, or reopens it recovering to the last commit.

    Takes the store's writer lease first (:class:`StoreError` naming the live writer if another process
    holds it) and keeps it while open. Thread-safe (one lock). Each append is committed when it returns (all
    the records of an ``append_records`` in one commit: one fsync, all or nothing). A failed append (disk
    full, quota, file size limit, I/O error) commits nothing and raises :class:`StoreError`: the writer
    lets go of the file without writing to it again, and the next append reopens it at the last commit
    (repairing a file the failure cut short), so once space is back, appends work again; until then each
    append fails with the reason. A writer whose lease was taken over closes itself without touching the
    file again.
    """

    def __init__(
        self, path: Path, *, chunk_tokens: int = 65536, lease_timing: LeaseTiming | None = None
    ) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._file: h5py.File | None = None
        self._closed = False  # close() was called, or the lease was taken over
        self._failure: str | None = None  # why the file is let go of, after a failed append
        self.stats = WriterStats()
        self._pool: ThreadPoolExecutor | None = None  # compresses filled chunks (created on first use)
        key = os.path.realpath(self.path)
        with _OPEN_WRITERS_LOCK:
            if key in _OPEN_WRITERS:
                raise StoreError(
                    f"{self.path}: already open for writing in this process; one writer per store"
                )
            _OPEN_WRITERS.add(key)
        try:
            self._lease = acquire_lease(self.path, lease_timing or LeaseTiming(), self._on_lease_lost)
        except BaseException:
            _release(key, None)
            raise
        self._release = weakref.finalize(self, _release, key, self._lease)  # also when dropped unclosed
        try:
            if not self.path.exists():
                create_file(self.path, chunk_tokens)
            self._open()
        except BaseException:
            self._lease.release()
            self._release()
            raise

    @property
    def lease(self) -> Lease:
        """The writer lease this writer holds (host, pid, Slurm job, last heartbeat)."""
        return self._lease.lease

    @property
    def closed(self) -> bool:
        """True after ``close``, and once the lease was taken over (not after a failed append: the next
        append reopens the store)."""
        return self._closed

    def _open(self) -> None:
        # A store whose last writer did not close it (a failed append, a kill) may hold chunk-index blocks
        # HDF5 never wrote (found 2026-12-01 after EFBIG: the next write of a compressed chunk then hangs in
        # HDF5's metadata retries), so such a store is not sealed by this writer (``seal``; the next
        # writer that opens it cleanly closed does). Known limitation, docs/storage.md.
        repaired = repair_truncated(self.path)
        self._unsealable = repaired or self._failure is not None or self._lease.taken_from is not None
        check_not_truncated(self.path)
        old = self._lease.taken_from
        clear_stale_write_flags(self.path, old.pid if old is not None else None)
        f = open_file(self.path, write=True)
        fd = f.id.get_vfd_handle()
        try:
            f.attrs["writer"] = writer_identity()
            f.swmr_mode = True  # from here on, every state of the file on disk is readable
            self._fd = fd
            self._commit = open_uncached(f, "commit")
            self._sealed = open_uncached(f, "sealed")
            self._data = {name: f[name] for name in (*ROWS, *OFFSETS)}
            chunk_tokens = int(f.attrs["chunk_tokens"])
            self._columns = {
                name: SealedColumn(f[name], open_uncached(f, f"{TAIL}/{name}"), space, chunk_tokens)
                for name, (_, space) in SEALED.items()
            }
            self._counts = read_commit(self._commit, self.path)
            self._recover(f)
        except BaseException:
            self._let_go(f, fd)
            raise
        self._file = f
        self._failure = None

    def _let_go(self, f: h5py.File, fd: int) -> None:
        """Close ``f`` after a failed write without writing to the store again (what HDF5 still had to
        write goes to a scratch file), and mark the store closed in its superblock: readers can open it,
        and a reopen goes back to the last commit."""
        close_detached(f.close, fd)
        try:
            clear_write_flags(self.path)
        except (OSError, StoreError) as exc:
            log.warning("%s: could not mark the store closed after a failed write: %s", self.path, exc)

    def _recover(self, f: h5py.File) -> None:
        """Check the committed state and shrink every dataset back to it."""
        count = {space: int(self._counts[i]) for i, space in enumerate(SPACES)}
        for name, (rows, target) in OFFSETS.items():
            ds, n = f[name], count[rows]
            if ds.shape[0] < n + 1 or int(ds[n]) != count[target]:
                raise StoreError(
                    f"{self.path}: {name} does not match the commit counter; the file is damaged"
                )
            ds.resize((n + 1,))
        for name in ROWS:
            if f[name].shape[0] < count[name]:
                raise StoreError(
                    f"{self.path}: {name} is shorter than the commit counter; the file is damaged"
                )
            f[name].resize((count[name],))
        sealed = self._sealed[:]
        for column in self._columns.values():
            on_disk = int(sealed[SPACE_INDEX[column.space]])
            if column.main.shape[0] < max(count[column.space] // column.chunk, on_disk) * column.chunk:
                raise StoreError(f"{self.path}: {column.main.name} lost sealed chunks; the file is damaged")
            column.recover(count[column.space], on_disk)
        f.flush()
        self._write_sealed()
        f.flush()
        for column in self._columns.values():
            column.drop_unsealed()
        f.flush()

    def _write_sealed(self) -> None:
        sealed = np.zeros(len(SPACES), np.int64)
        for column in self._columns.values():
            sealed[SPACE_INDEX[column.space]] = column.sealed
        write_at(self._sealed, 0, sealed)

    # --------------------------------------------------------------------------------------- appends
    def append_episode(self, record: EpisodeRecord) -> None:
        """Append one closed episode; committed on return."""
        self.append_records([record])

    def append_step(self, record: StepRecord) -> None:
        """Append one training step (metrics and samples); committed on return."""
        self.append_records([record])

    def append_records(self, records: Sequence[EpisodeRecord | StepRecord]) -> None:
        """Append episodes and steps as one commit group: their data written in order, one flush and fsync
        for all of them, then one write of the ``commit`` counter. Committed together on return; on any
        failure none of them is (all or nothing). Each record is encoded before the file is touched: one
        that cannot be stored raises :class:`UnstorableRecord` (its ``index``) and nothing is written.

        The chunks the group fills are compressed at write time on this thread when they deflate through
        ISA-L; through zlib, on the writer's threads while the records after them are still being encoded
        (``_compressor``)."""
        if not records:
            return
        what = _describe(records[0])
        if len(records) > 1:
            what = f"{len(records)} records ({what} to {_describe(records[-1])})"
        self._append(records, what)

    def _encode(self, record: EpisodeRecord | StepRecord, index: int) -> Append:
        try:
            return encode_step(record) if isinstance(record, StepRecord) else encode_episode(record)
        except (TypeError, ValueError, OverflowError) as exc:
            message = f"{self.path}: {_describe(record)} cannot be stored: {exc}"
            raise UnstorableRecord(message, index) from exc

    def _append(self, records: Sequence[EpisodeRecord | StepRecord], what: str) -> None:
        with self._lock:
            if self._closed:
                lost = self._lease.lost
                raise LeaseLost(lost) if lost else StoreError(f"{self.path}: the writer is closed")
            try:
                self._lease.confirm()
            except LeaseLost:
                self._detach()
                raise
            if self._file is None:
                self._reopen(what)
            assert self._file is not None
            encoded, full = self._stage(records)  # the file untouched yet (UnstorableRecord: nothing staged)
            try:
                self._write(self._file, encoded, full)
            except Exception as exc:
                self.stats.failed += 1
                self._failure = f"{type(exc).__name__}: {exc}"
                log.error("%s: writing %s failed (%s); letting go of the file", self.path, what, exc)
                self._let_go(self._file, self._fd)
                self._file = None
                raise StoreError(
                    f"{self.path}: writing {what} failed, nothing of it was committed ({exc}); every earlier "
                    "append is intact. If the disk or quota is full, free space: the next append reopens "
                    "the store at its last commit"
                ) from exc

    def _stage(self, records: Sequence[EpisodeRecord | StepRecord]) -> tuple[Append, list[_Chunk]]:
        """Encode ``records`` one by one into the columns' open chunks; each chunk filled on the way is
        handed to the compression threads at once, if there are any (``_compressor``). Returns the group's
        rows and offsets (its column values are in the chunks) and the filled chunks (``_Chunk``). A record
        that cannot be stored undoes the staging (nothing of the group stays) and raises."""
        saved = {name: column.save() for name, column in self._columns.items()}
        pool = self._compressor()
        encoded: list[Append] = []
        full: list[_Chunk] = []
        try:
            for index, record in enumerate(records):
                append = self._encode(record, index)
                for name, values in append.columns.items():
                    column = self._columns[name]
                    for k, data in column.stage(values):
                        full.append((column, k, data, pool.submit(column.compress, data) if pool else None))
                encoded.append(append)
        except BaseException:
            for _, _, _, job in full:
                if job is not None:
                    job.cancel()
            for name, column in self._columns.items():
                column.restore(saved[name])
            raise
        return join_appends(encoded, columns=False), full

    def _compressor(self) -> ThreadPoolExecutor | None:
        """The threads compressing filled chunks, or None: compressed inline at write time, on one core and
        wherever every column deflates through ISA-L. ISA-L deflates a benchmark episode's chunks in ~0.06 ms
        of CPU, less than what threads compressing beside the staging cost it in waits for the GIL (each
        staging call 3-4x slower): inline, groups of 64 went 1,791 -> 2,094 episodes/s (median of 16 runs
        each, alternating; tools/bench/README.md). With zlib (no ``isal``, or a level-4 store) deflate costs
        ~6x more and releases the GIL: the threads take it off the recorder's path."""
        if _COMPRESS_THREADS == 1 or all(column.fast_deflate for column in self._columns.values()):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_COMPRESS_THREADS, thread_name_prefix="store-compress")
        return self._pool

    def _reopen(self, what: str) -> None:
        """Reopen at the last commit after a failed append; StoreError (with both reasons) if it fails."""
        try:
            self._open()
        except Exception as exc:
            raise StoreError(
                f"{self.path}: {what} was not written: the store could not be reopened after a failed append "
                f"({self._failure}): {exc}. Nothing committed is lost; the next append tries again"
            ) from exc
        log.warning("%s: reopened at its last commit after a failed append; appending again", self.path)

    def _write(self, f: h5py.File, encoded: Append, full: list[_Chunk]) -> None:
        old = self._counts
        new = old.copy()
        for space, n in encoded.counts.items():
            new[SPACE_INDEX[space]] += n
        if full:  # a tail slot may be reused next: readers must see the seal first
            last = {id(column): (column, k) for column, k, _, _ in full}  # (each column's chunks in order)
            for column, k in last.values():
                column.reserve(k + 1)
            for column, k, data, job in full:
                column.seal(k, job.result() if job is not None else column.compress(data))
                column.recycle(data)
            f.flush()
            self._write_sealed()
            f.flush()
        for column in self._columns.values():
            column.write_tail()
        for name, rows in encoded.rows.items():
            write_at(self._data[name], int(old[SPACE_INDEX[name]]), rows)
        for name, lengths in encoded.lengths.items():
            rows_space, target = OFFSETS[name]
            ends = int(old[SPACE_INDEX[target]]) + np.cumsum(lengths, dtype=np.int64)
            write_at(self._data[name], int(old[SPACE_INDEX[rows_space]]) + 1, ends)
        f.flush()
        # This group's data (and the previous commit) on disk before the counter points to it.
        os.fsync(self._fd)
        self.stats.fsyncs += 1
        write_at(self._commit, 0, np.append(new, commit_check(new)))
        f.flush()
        self._counts = new
        self.stats.commits += 1
        self.stats.episodes += encoded.counts.get("episodes", 0)
        self.stats.steps += encoded.counts.get("steps", 0)

    def _on_lease_lost(self) -> None:
        """Called by the heartbeat thread when another process took the lease over."""
        with self._lock:
            self._detach()

    def _detach(self) -> None:
        """Close the file without writing to it (the new writer owns it now). Called with the lock held."""
        self._closed = True
        if self._file is None:
            return
        log.error("%s: the writer lease was taken over; closing this writer without writing", self.path)
        close_detached(self._file.close, self._fd)
        self._file = None

    def seal(self) -> None:
        """Make the file whole for any HDF5 reader: each column's open chunk (which this package's readers
        read from ``_tail/<column>``) is written into the column too, so that every dataset read whole with
        plain h5py, pandas or HDFView holds exactly the committed data (docs/storage.md, "Reading a store
        without ajet_hpc"). Called by ``close``; a server may also call it at a checkpoint (each call costs
        one compressed partial chunk per column of file space: see docs/storage.md). Commits nothing and
        changes nothing this package's readers read; a crash during it loses nothing."""
        with self._lock:
            if self._file is None or self._closed or self._unsealable:
                return
            for column in self._columns.values():
                column.seal_open()
            self._file.flush()
            os.fsync(self._fd)
            self.stats.fsyncs += 1

    def close(self) -> None:
        """Commit nothing new, seal (``seal``: the file read whole by any HDF5 tool holds everything
        committed), close the file, release the lease (a writer that lost it only lets go)."""
        with self._lock:
            self._closed = True
            if self._file is not None:
                try:
                    self._lease.confirm(force=True)
                except StoreError:
                    self._detach()
                else:
                    try:
                        if self._unsealable:
                            log.warning(
                                "%s: not sealed at close (its last writer had not closed it); EpisodeReader "
                                "reads all of it, plain HDF5 readers only its full chunks",
                                self.path,
                            )
                        else:
                            for column in self._columns.values():
                                column.seal_open()
                        self._file.flush()
                        os.fsync(self._fd)
                        self.stats.fsyncs += 1
                        self._file.close()
                    except Exception as exc:  # disk full at the very end: the commits are on disk
                        log.error(
                            "%s: closing the store failed (%s); it stays at its last commit", self.path, exc
                        )
                        self._let_go(self._file, self._fd)
                    self._file = None
        if self._pool is not None:
            self._pool.shutdown()
        self._lease.release()
        self._release()

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(record: EpisodeRecord | StepRecord) -> str:
    return f"step {record.step}" if isinstance(record, StepRecord) else f"episode {record.episode_id}"


def _release(key: str, lease: HeldLease | None) -> None:
    """Let another writer of this process open the store; a lease not released by ``close`` just stops
    its heartbeat (it then goes stale and the next writer takes it over)."""
    with _OPEN_WRITERS_LOCK:
        _OPEN_WRITERS.discard(key)
    if lease is not None:
        lease.stop()
