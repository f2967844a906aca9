"""The server store: every closed episode and every training step of one model, in ``RUN/data/<model>.h5``.

One writer, the server process (:class:`EpisodeWriter`, called from its recorder thread, one lock), holding
the store's writer lease (:mod:`ajet_hpc.storage.lease`); any number of readers (:class:`EpisodeReader`),
also while the server writes: the file is in HDF5 SWMR mode. An append is committed when it returns: its
data written, flushed and fsynced, then the ``commit`` counter written and flushed. ``append_records``
commits several records as one group (one fsync for all: what makes a busy server's recorder cheap; the
group is committed all or nothing). Readers see only what the counter covers; a writer reopening the file
after a crash shrinks every dataset back to it. The records it takes and gives back, and their
encoding: :mod:`ajet_hpc.storage.records`; the layout and its reasons: :mod:`ajet_hpc.storage.h5_layout`,
docs/storage.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.storage.h5_layout import (
    LAYOUT_VERSION,
    OFFSETS,
    ROWS,
    SEALED,
    SPACES,
    TAIL,
    SealedColumn,
    SealedReader,
    StoreError,
    check_not_truncated,
    clear_stale_write_flags,
    clear_write_flags,
    commit_check,
    create_file,
    open_file,
    open_for_read,
    open_uncached,
    repair_truncated,
    write_at,
    writer_identity,
)
from ajet_hpc.storage.lease import HeldLease, Lease, LeaseLost, LeaseTiming, acquire_lease, close_detached
from ajet_hpc.storage.records import (
    Append,
    EpisodeRecord,
    StepRecord,
    encode_episode,
    encode_step,
    id_hash,
    join_appends,
)
from ajet_hpc.tracking.timeline import DriftEvent, Timeline

__all__ = [
    "LAYOUT_VERSION",
    "EpisodeReader",
    "EpisodeWriter",
    "StoreError",
    "UnstorableRecord",
    "WriterStats",
]

log = logging.getLogger(__name__)

_SPACE = {space: i for i, space in enumerate(SPACES)}
_BATCH = 8192  # episodes / steps parsed per read when building summaries
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


# ------------------------------------------------------------------------------------------- writer
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
            self._counts = _read_commit(self._commit, self.path)
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
            on_disk = int(sealed[_SPACE[column.space]])
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
            sealed[_SPACE[column.space]] = column.sealed
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
            new[_SPACE[space]] += n
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
            write_at(self._data[name], int(old[_SPACE[name]]), rows)
        for name, lengths in encoded.lengths.items():
            rows_space, target = OFFSETS[name]
            ends = int(old[_SPACE[target]]) + np.cumsum(lengths, dtype=np.int64)
            write_at(self._data[name], int(old[_SPACE[rows_space]]) + 1, ends)
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


def _read_commit(ds: h5py.Dataset, path: Path, tries: int = 50) -> np.ndarray:
    """The committed counts per space; retried while a concurrent write is seen half-done."""
    for _ in range(tries):
        ds.refresh()
        raw = ds[:]
        if len(raw) == len(SPACES) + 1 and int(raw[-1]) == commit_check(raw[:-1]):
            return raw[:-1].astype(np.int64)
        time.sleep(0.002)
    raise StoreError(f"{path}: the commit counter does not check out; the file is damaged")


# ------------------------------------------------------------------------------------------- reader
class EpisodeReader:
    """Reads a store, also while its writer appends: ``refresh()`` picks up what was committed since.

    Sees only committed episodes and steps. Random access by id is a hash lookup (the id map is extended
    on use after each refresh). Not thread-safe: one reader per thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open_for_read(self.path)
        try:
            f = self._file
            chunk_tokens = int(f.attrs["chunk_tokens"])
            self._commit = open_uncached(f, "commit")
            self._sealed_ds = open_uncached(f, "sealed")
            self._data = {name: f[name] for name in (*ROWS, *OFFSETS)}
            self._columns = {
                name: SealedReader(f[name], open_uncached(f, f"{TAIL}/{name}"), space, chunk_tokens)
                for name, (_, space) in SEALED.items()
            }
        except BaseException:
            self._file.close()
            raise
        self._counts = np.zeros(len(SPACES), np.int64)
        self._seals = np.zeros(len(SPACES), np.int64)
        self._ids: dict[int, int] = {}  # 64-bit hash of the id -> index of its latest record
        self._indexed = 0
        self._summaries: list[dict[str, Any]] = []
        self._steps: list[dict[str, Any]] = []
        self.refresh()

    def refresh(self) -> None:
        """See everything committed up to now."""
        counts = _read_commit(self._commit, self.path)
        if (counts < self._counts).any():
            raise StoreError(f"{self.path}: the commit counter went backwards; the file was replaced")
        self._seals = self._read_seals()
        for ds in self._data.values():
            ds.refresh()
        self._counts = counts

    def _read_seals(self) -> np.ndarray:
        self._sealed_ds.refresh()
        return self._sealed_ds[:]

    def _n(self, space: str) -> int:
        return int(self._counts[_SPACE[space]])

    def __len__(self) -> int:
        return self._n("episodes")

    def _read(self, requests: list[tuple[str, int, int]]) -> list[np.ndarray]:
        """Ranges of sealed columns. A range read from a tail slot is read again from the column when the
        ``sealed`` counter shows its chunk sealed meanwhile (the slot may have been reused)."""
        out: list[np.ndarray] = [np.zeros(0)] * len(requests)
        todo = list(range(len(requests)))
        while todo:
            from_tail: dict[int, int] = {}
            for i in todo:
                name, start, stop = requests[i]
                column = self._columns[name]
                out[i], chunk = column.read(int(start), int(stop), int(self._seals[_SPACE[column.space]]))
                if chunk is not None:
                    from_tail[i] = chunk
            if not from_tail:
                break
            self._seals = self._read_seals()
            todo = [
                i
                for i, k in from_tail.items()
                if self._seals[_SPACE[self._columns[requests[i][0]].space]] > k
            ]
        return out

    # --------------------------------------------------------------------------------------- episodes
    def episode(self, episode_id: str) -> EpisodeRecord:
        """The full record of ``episode_id`` (the latest one if it was stored twice)."""
        n = len(self)
        if self._indexed < n:
            hashes = self._data["episodes"].fields("id_hash")[self._indexed : n]
            self._ids.update(zip(hashes.tolist(), range(self._indexed, n), strict=True))
            self._indexed = n
        index = self._ids.get(id_hash(episode_id))
        if index is not None:
            record = self._episode_at(index)
            if record.episode_id == episode_id:
                return record
            # Two ids with the same 64-bit hash: look the id up among all of them.
            matches = [s["index"] for s in self.summaries() if s["episode_id"] == episode_id]
            if matches:
                return self._episode_at(matches[-1])
        raise KeyError(f"{self.path}: no episode {episode_id!r} among its {n} committed episodes")

    def _episode_at(self, index: int) -> EpisodeRecord:
        d = self._data
        (t0, t1), (j0, j1) = (
            d["episode_timeline_offsets"][index : index + 2],
            d["episode_json_offsets"][index : index + 2],
        )
        row, rows = d["episodes"][index], d["timelines"][t0:t1]
        tok_off, json_off = d["timeline_offsets"][t0 : t1 + 1], d["timeline_json_offsets"][t0 : t1 + 1]
        tokens, logprobs, mask, authors, tjson, ejson = self._read(
            [
                *((name, tok_off[0], tok_off[-1]) for name in ("tokens", "logprobs", "loss_mask", "authors")),
                ("timeline_json", json_off[0], json_off[-1]),
                ("episode_json", j0, j1),
            ]
        )
        tok_off, json_off, ttext = tok_off - tok_off[0], json_off - json_off[0], tjson.tobytes()
        timelines = []
        for i, trow in enumerate(rows):
            a, p, b = int(tok_off[i]), int(tok_off[i]) + int(trow["prompt_len"]), int(tok_off[i + 1])
            extra = json.loads(ttext[json_off[i] : json_off[i + 1]])
            timelines.append(
                Timeline(
                    prompt_ids=tokens[a:p].tolist(),
                    response_ids=tokens[p:b].tolist(),
                    response_logprobs=logprobs[p:b].tolist(),
                    token_authors=authors[a:b].tolist(),
                    loss_mask=mask[a:b].tolist(),
                    messages=extra["messages"],
                    tools=extra["tools"],
                    policy_version=int(trow["policy_version"]),
                    finish_reason=extra["finish_reason"],
                    drift=[DriftEvent(**event) for event in extra["drift"]],
                    reused_spans=[(int(s), int(e)) for s, e in extra["reused_spans"]],
                    started_at=float(trow["started_at"]),
                    finished_at=float(trow["finished_at"]),
                )
            )
        meta = json.loads(ejson.tobytes())
        return EpisodeRecord(
            episode_id=meta["episode_id"],
            model=meta["model"],
            task_id=meta["task_id"],
            group=meta["group"],
            state=meta["state"],
            reward=None if math.isnan(row["reward"]) else float(row["reward"]),
            turn_rewards=meta["turn_rewards"],
            reason=meta["reason"],
            metadata=meta["metadata"],
            started_at=float(row["started_at"]),
            ended_at=float(row["ended_at"]),
            timelines=timelines,
        )

    def summaries(self) -> list[dict[str, Any]]:
        """One dict per committed episode, in store order, without token data."""
        while len(self._summaries) < len(self):
            self._summaries += self._summarize(
                len(self._summaries), min(len(self), len(self._summaries) + _BATCH)
            )
        return [dict(s) for s in self._summaries]

    def _summarize(self, m: int, n: int) -> list[dict[str, Any]]:
        d = self._data
        rows, eto, ejo = (
            d["episodes"][m:n],
            d["episode_timeline_offsets"][m : n + 1],
            d["episode_json_offsets"][m : n + 1],
        )
        t0 = int(eto[0])
        trows, toff = d["timelines"][t0 : eto[-1]], d["timeline_offsets"][t0 : eto[-1] + 1]
        drift = np.concatenate([[0], np.cumsum(trows["n_drift"])])
        versions = trows["policy_version"].tolist()
        (ejson,) = self._read([("episode_json", ejo[0], ejo[-1])])
        etext, ejo = ejson.tobytes(), ejo - ejo[0]
        out = []
        for i in range(n - m):
            meta = json.loads(etext[ejo[i] : ejo[i + 1]])
            a, b = int(eto[i]) - t0, int(eto[i + 1]) - t0
            reward = float(rows["reward"][i])
            out.append(
                {
                    "index": m + i,
                    "episode_id": meta["episode_id"],
                    "task_id": meta["task_id"],
                    "group": meta["group"],
                    "state": meta["state"],
                    "reward": None if math.isnan(reward) else reward,
                    "turn_rewards": meta["turn_rewards"],
                    "calls": b - a,
                    "tokens": int(toff[b] - toff[a]),
                    "drift": int(drift[b] - drift[a]),
                    "policy_versions": sorted(set(versions[a:b])),
                    "started_at": float(rows["started_at"][i]),
                    "ended_at": float(rows["ended_at"][i]),
                    "reason": meta["reason"],
                    "metadata": meta["metadata"],
                }
            )
        return out

    # ------------------------------------------------------------------------------------------ steps
    def steps(self) -> list[dict[str, Any]]:
        """Per recorded step, in order: step, metrics, n_samples, episode_ids (distinct, in batch order)."""
        d, n = self._data, self._n("steps")
        if len(self._steps) < n:
            m = len(self._steps)
            rows, sso, sjo = (
                d["steps"][m:n],
                d["step_sample_offsets"][m : n + 1],
                d["step_json_offsets"][m : n + 1],
            )
            sample_off = d["sample_json_offsets"][sso[0] : sso[-1] + 1]
            sjson, ajson = self._read(
                [("step_json", sjo[0], sjo[-1]), ("sample_json", sample_off[0], sample_off[-1])]
            )
            stext, atext, sjo, sample_off = (
                sjson.tobytes(),
                ajson.tobytes(),
                sjo - sjo[0],
                sample_off - sample_off[0],
            )
            for i in range(n - m):
                a, b = int(sso[i] - sso[0]), int(sso[i + 1] - sso[0])
                ids = [
                    json.loads(atext[sample_off[k] : sample_off[k + 1]])["episode_id"] for k in range(a, b)
                ]
                self._steps.append(
                    {
                        "index": m + i,
                        "step": int(rows["step"][i]),
                        "metrics": json.loads(stext[sjo[i] : sjo[i + 1]])["metrics"],
                        "n_samples": b - a,
                        "episode_ids": list(dict.fromkeys(ids)),
                    }
                )
        return [dict(s) for s in self._steps]

    def step_samples(self, step: int) -> list[Sample]:
        """The samples of training step ``step`` (its latest record, if a resumed run recorded it twice)."""
        found = [s["index"] for s in self.steps() if s["step"] == step]
        if not found:
            raise KeyError(f"{self.path}: no step {step} among its {self._n('steps')} recorded steps")
        d, index = self._data, found[-1]
        s0, s1 = (int(x) for x in d["step_sample_offsets"][index : index + 2])
        rows, tok_off, json_off = (
            d["samples"][s0:s1],
            d["sample_token_offsets"][s0 : s1 + 1],
            d["sample_json_offsets"][s0 : s1 + 1],
        )
        names = ("sample_tokens", "sample_loss_mask", "sample_advantages", "sample_old_logprobs")
        tokens, mask, advantages, old, ajson = self._read(
            [*((name, tok_off[0], tok_off[-1]) for name in names), ("sample_json", json_off[0], json_off[-1])]
        )
        tok_off, json_off, atext = tok_off - tok_off[0], json_off - json_off[0], ajson.tobytes()
        samples = []
        for i, row in enumerate(rows):
            a, b = int(tok_off[i]), int(tok_off[i + 1])
            extra = json.loads(atext[json_off[i] : json_off[i + 1]])
            samples.append(
                Sample(
                    token_ids=tokens[a:b].tolist(),
                    loss_mask=mask[a:b].tolist(),
                    old_logprobs=old[a:b].tolist(),
                    advantages=advantages[a:b].tolist(),
                    policy_version=int(row["policy_version"]),
                    episode_id=extra["episode_id"],
                    task_id=extra["task_id"],
                    weight=float(row["weight"]),
                    weights=extra.get("weights"),
                    parents=extra.get("parents"),
                    calls=extra.get("calls", []),
                )
            )
        return samples

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EpisodeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
