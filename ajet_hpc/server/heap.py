"""The server process's heap and Python's cyclic garbage collector.

Two costs grow with what the process holds, and both are paid in the event loop's thread:

- **The start-up heap**: the loaded libraries, the engine client and the tokenizer (about 5·10^5 objects).
  Once the engine has started, ``freeze_startup_heap`` collects and freezes it (``gc.freeze``), as
  ``vllm serve`` does: no later collection traverses it.
- **The open episodes**: each holds its calls' messages, token ids and log-probabilities for minutes to hours.
  Every full collection traverses all of them, and a busy server makes several a second (the transient
  objects of requests in flight are promoted to the oldest generation, and a full collection follows once
  they exceed a quarter of it). At 4,096 open episodes the collector took a fifth of the server's time
  against 7 % at 256 (``tools/bench/scale.py``, which reports the collector's share per level).

``HeapAger`` keeps the second cost flat: every ``interval_s`` it runs one full collection, which traverses
only what is not frozen (the objects born since the last tick), and freezes the survivors. So the long-lived
objects, open episodes above all, leave the collector's sight within one interval; those that die later
by their reference count are freed as always. What is frozen and later becomes cyclic garbage is kept until
the next thaw: every ``thaw_every`` ticks the ager unfreezes everything, collects once (one pause of the
whole heap's traversal, logged) and freezes again. The garbage kept between thaws is bounded by what a
thaw finds, which the log shows.

Only for a process that serves until it exits (the server's own, ``ajet_hpc.server.process``): a test or a
notebook that builds an app in its own process keeps its collector as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

AGE_INTERVAL_S = 5.0
"""How often the ager collects what is young and freezes what survived: about as often as a busy server's
own full collections come, which traverse only the same young part once the rest is frozen."""
THAW_EVERY = 120
"""Every this many ticks (10 minutes at 5 s), a thaw: the whole heap unfrozen, collected and frozen again."""


def freeze_startup_heap() -> None:
    """Collect, then freeze the garbage collector's heap (``gc.freeze``), as vLLM's own server does once
    started: the objects of the loaded libraries, the engine client and the tokenizer (hundreds of
    thousands) are no longer traversed by every full collection while requests are served. Measured on
    the proxy benchmark's chat load: 11 % less CPU per request in the server process, 7 % more tokens/s
    (tools/bench/README.md)."""
    gc.collect()
    gc.freeze()


@dataclass
class Tick:
    """What one tick did: objects found to be cyclic garbage, seconds the event loop waited, a thaw or not."""

    collected: int
    seconds: float
    thawed: bool


class HeapAger:
    """Collects the young part of the heap and freezes its survivors every ``interval_s``; every
    ``thaw_every`` ticks, the whole heap (see the module's docstring)."""

    def __init__(self, interval_s: float | None = None, thaw_every: int | None = None) -> None:
        interval_s = AGE_INTERVAL_S if interval_s is None else interval_s
        thaw_every = THAW_EVERY if thaw_every is None else thaw_every
        if interval_s <= 0 or thaw_every < 1:
            raise ValueError(
                f"interval_s must be > 0 (got {interval_s}) and thaw_every >= 1 (got {thaw_every})"
            )
        self.interval_s, self.thaw_every = interval_s, thaw_every
        self.ticks = 0

    def tick(self) -> Tick:
        self.ticks += 1
        thaw = self.ticks % self.thaw_every == 0
        started = time.perf_counter()
        if thaw:
            gc.unfreeze()
        collected = gc.collect()
        gc.freeze()
        done = Tick(collected, time.perf_counter() - started, thaw)
        if thaw:
            log.info(
                "heap thawed: %d objects of cyclic garbage collected in %.2f s, %d objects frozen again",
                collected,
                done.seconds,
                gc.get_freeze_count(),
            )
        return done

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.tick()


@contextlib.asynccontextmanager
async def aging(ager: HeapAger | None = None) -> AsyncIterator[HeapAger]:
    """The ager's ticks while the server serves (the start-up heap frozen first)."""
    ager = ager or HeapAger()
    freeze_startup_heap()
    task = asyncio.create_task(ager.run(), name="heap-ager")
    try:
        yield ager
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
