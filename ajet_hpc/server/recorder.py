"""Writing closed episodes and training steps to the server store, off the event loop.

The registry hands every closed episode to ``EpisodeRecorder.submit``; a single thread appends them to
``RUN/data/<model>.h5`` in order (HDF5 writes never block serving). ``close`` drains the queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from pathlib import Path

from ajet_hpc.storage.episode_store import EpisodeRecord, EpisodeWriter, StepRecord

log = logging.getLogger(__name__)
_STOP = object()
WRITE_WAIT_S = 120.0


class EpisodeRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer = EpisodeWriter(path)
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name="episode-recorder", daemon=True)
        self._thread.start()
        self.failed = 0

    def submit(self, episode) -> None:
        """Queue a closed episode (``ajet_hpc.server.episodes.Episode``) for the store."""
        self._queue.put(EpisodeRecord.from_episode(episode))

    def submit_step(self, record: StepRecord) -> None:
        self._queue.put(record)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if isinstance(item, threading.Event):  # flush marker
                item.set()
                continue
            if callable(item):  # flush marker of an event loop
                item()
                continue
            try:
                if isinstance(item, StepRecord):
                    self.writer.append_step(item)
                else:
                    self.writer.append_episode(item)
            except Exception:
                self.failed += 1
                log.exception("could not write to the episode store %s", self.path)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until everything queued so far is written; False after ``timeout_s``."""
        written = threading.Event()
        self._queue.put(written)
        return written.wait(timeout_s)

    async def written(self) -> None:
        """Wait (without blocking the event loop) until everything queued so far is in the store."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._queue.put(lambda: loop.call_soon_threadsafe(_resolve, done))
        try:
            await asyncio.wait_for(done, WRITE_WAIT_S)
        except TimeoutError:
            log.error("the episode store %s did not take an episode within %.0f s", self.path, WRITE_WAIT_S)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=60)
        self.writer.close()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
