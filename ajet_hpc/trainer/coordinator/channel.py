"""The coordinator's handle on the ranks (`TrainerChannel`): submit batches, await results and the ready
record, ask for a checkpoint or a stop, all through the work dir's files (:mod:`ajet_hpc.trainer.protocol`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.storage.files import read_json, write_json_atomic
from ajet_hpc.trainer.protocol.batch_file import write_batch
from ajet_hpc.trainer.protocol.checkpoints import TrainerState, read_trainer_state
from ajet_hpc.trainer.protocol.step_result import Failed, StepResult, read_result
from ajet_hpc.trainer.protocol.work_dir import WorkDir


class TrainerFailed(RuntimeError):
    """A step failed on a rank, or the trainer's processes are gone."""


_A = TypeVar("_A")
"""What a wait returns: a step's result, the ready record, a checkpoint's state."""


class TrainerChannel:
    """The coordinator's handle on the ranks: submit batches, await results, stop them.

    ``alive`` answers whether the rank processes still run (e.g. ``lambda: proc.poll() is None``); without
    it a dead trainer is noticed only by ``timeout_s``. ``log_path`` (the ranks' log) is quoted in errors.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        alive: Callable[[], bool] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.work = WorkDir(Path(work_dir))
        self._alive = alive
        self._log_path = log_path

    def submit(
        self, step: int, samples: list[Sample], save_checkpoint: bool = False, encoded: bytes | None = None
    ) -> Path:
        """Hand step ``step``'s batch to the ranks (removing a stale result of an abandoned run first);
        ``encoded``: the batch file's bytes made beforehand (`encode_batch`)."""
        self.work.result_file(step).unlink(missing_ok=True)
        return write_batch(self.work, step, samples, save_checkpoint, encoded)

    async def wait_result(
        self, step: int, poll_s: float = 0.05, timeout_s: float | None = None
    ) -> StepResult:
        """The result of step ``step``; ``TrainerFailed`` if the step failed or the ranks are gone,
        ``TimeoutError`` after ``timeout_s``."""
        return await self._wait(lambda: read_result(self.work, step), f"step {step}", poll_s, timeout_s)

    async def wait_ready(self, poll_s: float = 0.1, timeout_s: float | None = None) -> dict[str, Any]:
        """Rank 0's ready record once the ranks are up: ``{"step": last trained step, ...}``."""
        return await self._wait(self._read_ready, "the ranks to start", poll_s, timeout_s)

    def request_stop(self) -> None:
        """Ask the ranks to exit (at their next wait for a batch)."""
        self.work.root.mkdir(parents=True, exist_ok=True)
        self.work.stop.touch()

    def request_save(self, step: int) -> None:
        """Ask the ranks, which must be at step ``step``, to checkpoint it at their next wait for a batch."""
        self.work.save_refused.unlink(missing_ok=True)
        write_json_atomic(self.work.save_request, {"step": step})

    def wait_result_blocking(self, step: int, timeout_s: float, poll_s: float = 0.05) -> StepResult:
        """`wait_result` for a caller that cannot await (a signal handler on the event loop's thread)."""
        return self._wait_blocking(lambda: read_result(self.work, step), f"step {step}", poll_s, timeout_s)

    def wait_saved_blocking(self, step: int, timeout_s: float, poll_s: float = 0.05) -> TrainerState:
        """Block until the trusted checkpoint is step ``step`` (after `request_save`); its state."""

        def saved() -> TrainerState | Failed | None:
            refused = read_json(self.work.save_refused)
            if refused is not None and refused.get("step") == step:
                return Failed(str(refused.get("reason", "refused")))
            state = read_trainer_state(self.work)
            return state if state is not None and state.step == step else None

        return self._wait_blocking(saved, f"the checkpoint of step {step}", poll_s, timeout_s)

    def last_checkpoint_step(self) -> int | None:
        """The step of the last complete checkpoint, None when there is none."""
        state = read_trainer_state(self.work)
        return None if state is None else state.step

    def _read_ready(self) -> dict[str, Any] | Failed | None:
        payload = read_json(self.work.ready)
        if payload is not None and "error" in payload:
            return Failed(str(payload["error"]))
        return payload

    async def _wait(
        self, read: Callable[[], _A | Failed | None], what: str, poll_s: float, timeout_s: float | None
    ) -> _A:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (found := self._poll(read, what, deadline, timeout_s)) is None:
            await asyncio.sleep(poll_s)
        return found

    def _wait_blocking(
        self, read: Callable[[], _A | Failed | None], what: str, poll_s: float, timeout_s: float
    ) -> _A:
        deadline = time.monotonic() + timeout_s
        while (found := self._poll(read, what, deadline, timeout_s)) is None:
            time.sleep(poll_s)
        return found

    def _poll(
        self,
        read: Callable[[], _A | Failed | None],
        what: str,
        deadline: float | None,
        timeout_s: float | None,
    ) -> _A | None:
        """One look: the answer, None (not yet), or an error (failed, processes gone, past the deadline)."""
        found = read()
        if found is None and self._alive is not None and not self._alive():
            found = read()  # it may have been written just before the exit
            if found is None:
                raise TrainerFailed(f"the trainer's processes exited while waiting for {what}" + self._tail())
        if isinstance(found, Failed):
            raise TrainerFailed(f"{what} failed: {found.error}" + self._tail())
        if found is not None:
            return found
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no answer from the trainer for {what} within {timeout_s} s" + self._tail())
        return None

    def _tail(self, lines: int = 20) -> str:
        if self._log_path is None or not Path(self._log_path).is_file():
            return ""
        text = Path(self._log_path).read_text(errors="replace").splitlines()[-lines:]
        return f"\n--- last lines of {self._log_path} ---\n" + "\n".join(text)
