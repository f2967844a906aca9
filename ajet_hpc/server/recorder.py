"""Writing closed episodes and training steps to the server store, off the event loop.

The registry hands every closed episode to ``EpisodeRecorder.submit``; a single thread appends them to
``RUN/data/<model>.h5`` in order (HDF5 writes never block serving). ``close`` drains the queue.

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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ajet_hpc.storage.episode_store import EpisodeRecord, EpisodeWriter, StepRecord

log = logging.getLogger(__name__)
_STOP = object()
WRITE_WAIT_S = 120.0
RETRY_S = 5.0  # a failed append is tried again this often, and before the next record


@dataclass(frozen=True)
class _Closed:
    """A closed episode on its way to the store, with what to tell once it is there."""

    record: EpisodeRecord
    episode: Any  # ajet_hpc.server.episodes.Episode
    loop: asyncio.AbstractEventLoop | None  # the loop that closed it (the callbacks run there)


class EpisodeRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer = EpisodeWriter(path)
        self._queue: queue.Queue = queue.Queue()
        self.failed = 0  # appends that failed (each retried until it is written)
        self._unwritten: list = []  # records whose append failed, oldest first (the recorder thread's)
        self._unwritten_ids: frozenset[str] = frozenset()  # their episode ids, for other threads
        self._on_written: list[Callable[[Any], None]] = []
        self._waiting: Counter[tuple[str, str]] = Counter()  # (group, task): closed, not yet handed on
        self._waiting_lock = threading.Lock()
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
        with self._waiting_lock:
            self._waiting[_task_of(episode)] += 1
        self._queue.put(_Closed(EpisodeRecord.from_episode(episode), episode, loop))

    def waiting(self, group: str, task_id: str) -> int:
        """Episodes of a task closed but not yet handed to the ``on_written`` callbacks: the trainer's
        collector counts them as still coming (else a task group whose other repeats are on their way to
        the store would look as if they can no longer arrive)."""
        with self._waiting_lock:
            return self._waiting[(group, task_id)]

    def submit_record(self, record: EpisodeRecord) -> None:
        """Queue an episode's record alone (no callbacks)."""
        self._queue.put(_Closed(record, None, None))

    def submit_step(self, record: StepRecord) -> None:
        self._queue.put(record)

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=RETRY_S if self._unwritten else None)
            except queue.Empty:
                self._retry()
                continue
            if item is _STOP:
                self._retry()
                return
            if isinstance(item, threading.Event):  # flush marker
                item.set()
                continue
            if callable(item):  # flush marker of an event loop: told whether everything is in the store
                item(not self._unwritten)
                continue
            self._unwritten.append(item)
            self._retry()

    def _retry(self) -> None:
        """Append the waiting records in order; stop at the first that fails again (kept for later)."""
        while self._unwritten:
            item = self._unwritten[0]
            try:
                if isinstance(item, StepRecord):
                    self.writer.append_step(item)
                else:
                    self.writer.append_episode(item.record)
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
            self._unwritten.pop(0)
            if isinstance(item, _Closed) and item.episode is not None:
                self._tell_written(item)
        self._unwritten_ids = frozenset(
            item.record.episode_id for item in self._unwritten if isinstance(item, _Closed)
        )

    def _tell_written(self, item: _Closed) -> None:
        if item.loop is None:
            self._hand_on(item.episode)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the server stops, nothing trains
            item.loop.call_soon_threadsafe(self._hand_on, item.episode)

    def _hand_on(self, episode) -> None:
        """On the loop that closed ``episode``: no longer waiting, and given to the callbacks, in one go."""
        with self._waiting_lock:
            key = _task_of(episode)
            self._waiting[key] -= 1
            if self._waiting[key] <= 0:
                del self._waiting[key]
        for callback in self._on_written:
            callback(episode)

    def unwritten_ids(self) -> frozenset[str]:
        """The episodes closed but not yet in the store (their appends failed and are being retried)."""
        return self._unwritten_ids

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far was tried; False after ``timeout_s``."""
        written = threading.Event()
        self._queue.put(written)
        return written.wait(timeout_s)

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


def _task_of(episode) -> tuple[str, str]:
    return (episode.group or "", episode.task_id or episode.episode_id)


def _resolve(future: asyncio.Future, stored: bool) -> None:
    if not future.done():
        future.set_result(stored)
