"""Writing closed episodes and training steps to the server store, off the event loop.

The registry hands every closed episode to ``EpisodeRecorder.submit``; a single thread appends them to
``RUN/data/<model>.h5`` in order (HDF5 writes never block serving). ``close`` drains the queue.

Group commit: the thread takes everything queued (up to ``commit_max_episodes`` records) and commits it as
one group, one fsync for all (``EpisodeWriter.append_records``). A lone record is committed at once; while
records keep arriving, a group waits for more at most ``commit_interval_ms`` after its first record. The
fsync of one group is the time in which the next one gathers, so a busy server pays one fsync per group, an
idle one no delay. ``written`` futures and ``on_written`` callbacks are told only after their group's commit.

A record whose append fails (a full disk, a quota) is kept, in order, and written again before the next
record and every ``RETRY_S`` meanwhile: once space is back nothing is lost. Until then ``written`` says
False (the episode API answers an end with 503 instead of a success the store does not back) and
``unwritten_ids`` names the episodes still waiting (left out of the ended keys a client may commit).

``on_written`` callbacks (the trainer's batch collector) get each episode once it is in the store, on the
event loop that closed it: nothing is trained that a server dying on a full disk would not find again in its
store at restart, so no episode is trained, lost and run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ajet_hpc.config.store import StoreConfig
from ajet_hpc.storage.episode_store_writer import EpisodeWriter, UnstorableRecord
from ajet_hpc.storage.records import EpisodeRecord, StepRecord

log = logging.getLogger(__name__)
_STOP = object()
WRITE_WAIT_S = 120.0
RETRY_S = 5.0  # a failed append is tried again this often, and before the next record
COMMIT_INTERVAL_MS = 5.0  # the longest a commit group waits for more records (StoreConfig's default)


@dataclass(frozen=True)
class _Closed:
    """A closed episode on its way to the store, with what to tell once it is there."""

    record: EpisodeRecord
    episode: Any  # ajet_hpc.server.episodes.Episode
    loop: asyncio.AbstractEventLoop | None  # the loop that closed it (the callbacks run there)


class EpisodeRecorder:
    """The store's writer thread: records in, commit groups out (see the module's docstring)."""

    @classmethod
    def from_config(cls, path: Path, store: StoreConfig) -> EpisodeRecorder:
        """The recorder of a server's ``store:`` section (group commit bounds)."""
        return cls(
            path, commit_interval_ms=store.commit_interval_ms, commit_max_episodes=store.commit_max_episodes
        )

    def __init__(
        self, path: Path, *, commit_interval_ms: float = COMMIT_INTERVAL_MS, commit_max_episodes: int = 64
    ) -> None:
        if commit_interval_ms < 0 or commit_max_episodes < 1:
            raise ValueError(
                f"commit_interval_ms must be >= 0 (got {commit_interval_ms}) and commit_max_episodes >= 1 "
                f"(got {commit_max_episodes})"
            )
        self.path = path
        self.commit_interval_s = commit_interval_ms / 1000.0
        self.commit_max = commit_max_episodes
        self.writer = EpisodeWriter(path)
        self._queue: queue.Queue = queue.Queue()
        self.failed = 0  # appends that failed (each retried until it is written)
        self._taken = 0  # records taken from the queue (the recorder thread's sequence numbers)
        self._committed = 0  # records committed: always the first ones taken
        self._unwritten: list = []  # records taken, not yet committed, oldest first (the recorder thread's)
        self._unwritten_ids: frozenset[str] = frozenset()  # their episode ids, for other threads
        self._on_written: list[Callable[[Any], None]] = []
        self._thread = threading.Thread(target=self._drain, name="episode-recorder", daemon=True)
        self._thread.start()

    def on_written(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(episode)`` for each submitted episode once it is in the store (on the event loop
        that submitted it, else on the recorder's thread)."""
        self._on_written.append(callback)

    def submit(self, episode) -> None:
        """Queue a closed episode (``ajet_hpc.server.episodes.Episode``) for the store."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self._queue.put(_Closed(EpisodeRecord.from_episode(episode), episode, loop))

    def submit_record(self, record: EpisodeRecord) -> None:
        """Queue an episode's record alone (no callbacks)."""
        self._queue.put(_Closed(record, None, None))

    def submit_step(self, record: StepRecord) -> None:
        self._queue.put(record)

    def _drain(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=RETRY_S if self._unwritten else None)
            except queue.Empty:
                self._retry()
                continue
            markers: list[tuple[int, Any]] = []  # (records taken before it, marker)
            for item in self._gather(first):
                if item is _STOP or isinstance(item, threading.Event) or callable(item):
                    markers.append((self._taken, item))
                else:
                    self._taken += 1
                    self._unwritten.append(item)
            self._retry()
            for taken, marker in markers:
                if isinstance(marker, threading.Event):  # flush marker
                    marker.set()
                elif marker is not _STOP:  # an event loop's marker: told whether all before it is stored
                    marker(self._committed >= taken)
            if any(marker is _STOP for _, marker in markers):
                return

    def _gather(self, first: Any) -> list:
        """``first`` and what follows it in the queue, up to ``commit_max`` records: a group. Stops at once
        when the queue is empty after a lone record; with several, waits for more until
        ``commit_interval_s`` after ``first``. A flush (or close) ends the group: its caller waits for it.
        ``written()`` markers do not: every end posts one, and ends arriving together are what a group
        gathers."""
        items = [first]
        records = int(_is_record(first))
        deadline = time.monotonic() + self.commit_interval_s
        while not _ends_group(items[-1]) and records < self.commit_max:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                wait = deadline - time.monotonic()
                if records <= 1 or wait <= 0:
                    break
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    break
            items.append(item)
            records += _is_record(item)
        return items

    def _retry(self) -> None:
        """Commit the waiting records in order, in groups of at most ``commit_max``; stop at the first group
        that fails (kept, in order, for the next try)."""
        while self._unwritten:
            group = self._unwritten[: self.commit_max]
            try:
                group = self._commit(group)
            except Exception as error:
                self.failed += 1
                if self.failed == 1 or self.failed % 100 == 0:
                    log.exception("could not write to the episode store %s", self.path)
                else:
                    log.error("could not write to the episode store %s: %s", self.path, error)
                log.warning(
                    "%d record(s) wait for the episode store (retried every %.0f s): nothing is lost while "
                    "this process lives; free space where %s lies",
                    len(self._unwritten),
                    RETRY_S,
                    self.path,
                )
                break
            del self._unwritten[: len(group)]
            self._committed += len(group)
            for item in group:
                if isinstance(item, _Closed) and item.episode is not None:
                    self._tell_written(item)
        self._unwritten_ids = frozenset(
            item.record.episode_id for item in self._unwritten if isinstance(item, _Closed)
        )

    def _commit(self, group: list) -> list:
        """Append ``group`` as one commit; returns what was committed: the whole group, or the records
        before one that can never be stored (which stays first in line, and fails each retry)."""
        records = [item if isinstance(item, StepRecord) else item.record for item in group]
        try:
            self.writer.append_records(records)
        except UnstorableRecord as error:
            if error.index == 0:
                raise
            group = group[: error.index]
            self.writer.append_records(records[: error.index])
        return group

    def _tell_written(self, item: _Closed) -> None:
        if item.loop is None:
            self._hand_on(item.episode)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the server stops, nothing trains
            item.loop.call_soon_threadsafe(self._hand_on, item.episode)

    def _hand_on(self, episode) -> None:
        """On the loop that closed ``episode``: give it to the callbacks."""
        for callback in self._on_written:
            callback(episode)

    def unwritten_ids(self) -> frozenset[str]:
        """The episodes closed but not yet in the store (their appends failed and are being retried)."""
        return self._unwritten_ids

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far was tried; False after ``timeout_s``. Once the recorder is
        closed (its thread gone: the server stops, and a signal's save comes after), answers at once."""
        written = threading.Event()
        self._queue.put(written)
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive():
            if written.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                return False
        return written.is_set() or not self._unwritten

    async def written(self) -> bool:
        """Wait (without blocking the event loop) until everything queued so far was tried: True when it is
        all in the store, False when some append failed (and waits for a retry) or took over
        ``WRITE_WAIT_S``."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue.put(lambda stored: loop.call_soon_threadsafe(_resolve, done, stored))
        try:
            return await asyncio.wait_for(done, WRITE_WAIT_S)
        except TimeoutError:
            log.error("the episode store %s did not take an episode within %.0f s", self.path, WRITE_WAIT_S)
            return False

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=60)
        self.writer.close()


def _ends_group(item: Any) -> bool:
    return item is _STOP or isinstance(item, threading.Event)


def _is_record(item: Any) -> bool:
    return isinstance(item, _Closed | StepRecord)


def _resolve(future: asyncio.Future, stored: bool) -> None:
    if not future.done():
        future.set_result(stored)
