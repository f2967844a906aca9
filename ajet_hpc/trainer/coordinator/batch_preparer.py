"""The coordinator's batches, prepared: a step's batch collected, its samples built (credit, merging,
packing) and its batch file encoded, in a worker thread while the event loop goes on serving; with
``max_staleness`` > 0, the next step's while the ranks train the current one (docs/architecture.md, "The
coordinator's step"). Nothing is consumed here: the journal line and the batch file come with the step
(``loop.Coordinator._train_prepared``); a batch prepared but never sent goes back to the collector.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from ajet_hpc.algo.detokenize import TokenText
from ajet_hpc.algo.merge import MergeStats
from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.config import TrainerConfig
from ajet_hpc.trainer.coordinator.collector import Batch, BatchCollector
from ajet_hpc.trainer.coordinator.episodes_to_samples import build_samples, gc_paused
from ajet_hpc.trainer.coordinator.step_record import Prepared
from ajet_hpc.trainer.protocol.batch_file import encode_batch

SOURCES_POLL_S = 5.0
"""How often a coordinator waiting for a batch asks whether its clients' task sources are used up."""


class BatchPreparer:
    """Prepares the batches of one coordinator's steps from its collector. ``sources_ended`` says why no
    batch can come any more (None while one can); ``tokenizer`` gives the engine's tokenizer, asked for
    once, when text-level merging first needs it."""

    def __init__(
        self,
        config: TrainerConfig,
        collector: BatchCollector,
        sources_ended: Callable[[], str | None],
        tokenizer: Callable[[], Any],
    ) -> None:
        self.config, self.collector, self.sources_ended = config, collector, sources_ended
        self._tokenizer = tokenizer
        self.ahead: asyncio.Task | None = None  # preparing the next step's batch while the ranks train

    async def next_batch(self, version: int | None = None) -> Batch | None:
        """The collector's next batch (``version``: the policy that will train it); None once no batch can
        come: every feeding client task has used up its tasks and none formed for ``SOURCES_POLL_S``
        after that."""
        pending = asyncio.ensure_future(self.collector.next_batch(version))
        try:
            while True:
                done, _ = await asyncio.wait({pending}, timeout=SOURCES_POLL_S)
                if done or pending.done():
                    return pending.result()
                if self.sources_ended() is not None:
                    return None
        except asyncio.CancelledError:
            if pending.done() and not pending.cancelled() and pending.exception() is None:
                self.collector.put_back(pending.result())  # taken the moment this was cancelled
            raise
        finally:
            pending.cancel()

    async def take(self, step: int, retry: Batch | None) -> Prepared | None:
        """Step ``step``'s prepared batch: ``retry`` (a failed step's batch) built again, the batch prepared
        while the last step trained, or a new one; None when no batch can come any more."""
        if retry is not None:
            return await self.prepare(step, retry)
        if self.ahead is not None:
            ahead, self.ahead = self.ahead, None
            prepared = await ahead
            if prepared is None or prepared.step == step:
                return prepared
            self.collector.put_back(prepared.batch)  # prepared for another step (ranks restarted)
        return await self.prepare(step)

    def start_ahead(self, step: int) -> None:
        """Begin preparing step ``step``'s batch in a task of its own (``take`` gets it)."""
        self.ahead = asyncio.get_running_loop().create_task(self.prepare(step), name="prepare-next-batch")

    async def prepare(self, step: int, batch: Batch | None = None) -> Prepared | None:
        """Collect step ``step``'s batch (unless given), build its samples (credit, merging, packing) and
        encode its batch file, in a worker thread: the event loop goes on serving. Nothing is consumed:
        the journal line and the batch file come with the step. None: no batch can come any more.

        Cancelled after it took a batch, it puts the batch back in the collector once the build is over."""
        if batch is None:
            batch = await self.next_batch(version=step - 1)  # step n trains on policy n - 1
            if batch is None:
                return None
        taken = time.monotonic()
        save = step % self.config.save_every == 0 or step == self.config.total_steps
        build = asyncio.ensure_future(asyncio.to_thread(self.build, step, batch, save))
        try:
            samples, merging, encoded = await asyncio.shield(build)
        except asyncio.CancelledError:
            build.add_done_callback(lambda _: self.collector.put_back(batch))
            raise
        built = time.monotonic()
        work = [(taken - batch.collect_s, taken), (taken, built)]  # collecting, then building
        return Prepared(step, batch, samples, merging, encoded, save, work, taken, built)

    def build(self, step: int, batch: Batch, save: bool) -> tuple[list[Sample], MergeStats, bytes]:
        """(In a worker thread.) The batch's samples, what merging did, and the batch file's bytes; without
        the garbage collector's passes over every list alive (`gc_paused`)."""
        with gc_paused():
            samples, merging = build_samples(batch, self.config, self.decode)  # drops episodes at fault
            return samples, merging, encode_batch(step, samples, save) if samples else b""

    async def put_back_ahead(self) -> None:
        """The batch being prepared for a later step goes back to the collector, unconsumed."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return
        if not ahead.done():
            ahead.cancel()  # `prepare` puts back a batch it took
            return
        prepared = None if ahead.cancelled() or ahead.exception() else ahead.result()
        if prepared is not None:
            self.collector.put_back(prepared.batch)

    def cancel_ahead(self) -> None:
        """Stop preparing the next batch (training is over): a batch it took stays unconsumed."""
        if self.ahead is not None:
            self.ahead.cancel()

    @functools.cached_property
    def decode(self) -> TokenText:
        """The engine tokenizer's decode (special tokens kept, no cleanup) for text-level merging, with
        where it splits (``algo/detokenize.py``): built once, 0.8 s for Qwen's vocabulary."""
        return TokenText(self._tokenizer())
