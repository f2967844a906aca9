"""The control plane of an in-memory weight sync, between the trainer's rank 0 and the server process.

vLLM's trainer-side transfer engines drive the engine through a ``VLLMWeightSyncClient`` (init, start,
update, finish) while they send. Here the engine (``AsyncLLM``) lives in the server process and the sender
in a rank, another process and perhaps another node, so the client is a small RPC over the trainer's work
dir on shared storage: the rank writes ``sync/call-<session>-<n>.pkl`` (method and arguments), the server's
:class:`SyncServer` runs it on the engine and answers with ``done-<session>-<n>.pkl``. Only the calls go
this way; the weights themselves travel over the transfer group (NCCL, CUDA IPC or gloo). Every wait has a
timeout, so a side that stops fails the step with an error naming it instead of hanging.

When its job goes down, the server saves inside a signal handler on the event loop's thread, and the loop
(which :class:`SyncServer` needs to answer) stays blocked while it waits for the step in flight. It first
leaves the :data:`JOB_ENDING` marker: a rank's call already waiting, or about to be made, then ends with
:class:`SyncInterrupted` instead of waiting for an answer that cannot come, and the step completes with its
weights withheld from the engine (the checkpoint the save asks for carries them to the requeued job).

A waiting call is either *taken* or *withdrawn*, never both: the server takes it by renaming
``call-<name>.pkl`` to ``taken-<name>.pkl`` before it runs it, the rank withdraws it by removing
``call-<name>.pkl``, and only one of the two finds the file. That matters for ``update_weights``: the engine
receives inside it while rank 0 sends, both in the same collectives, so rank 0 must not begin to send
before the server took the call (``FileSyncClient.expect`` and :meth:`Expected.wait_taken`): a call
withdrawn instead would leave it sending to receivers that never come, until the transfer's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ajet_hpc.storage.files import write_bytes_atomic

log = logging.getLogger(__name__)

METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")
ENGINE_UP = "engine-up"
"""The marker :class:`SyncServer` leaves in the folder when it starts, its engine serving: ranks started
while the engine still loads (``Coordinator.prestart``) open their transfer group only once it is there."""
JOB_ENDING = "job-ending"
"""The marker the server leaves when its job goes down and it saves (``Coordinator.save_on_signal``): it
answers no more calls."""


class SyncFailed(RuntimeError):
    """A weight sync did not complete; the message names the side that stopped."""


class SyncInterrupted(SyncFailed):
    """The server's job is ending (:data:`JOB_ENDING`): the sync stops, the step itself stands."""


def announce_job_ending(folder: Path) -> None:
    """The server's side, before it blocks to save: no call will be answered any more."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / JOB_ENDING).touch()


def job_ending(folder: Path) -> bool:
    return (Path(folder) / JOB_ENDING).exists()


def _write(path: Path, payload: dict) -> None:
    write_bytes_atomic(path, pickle.dumps(payload))


def _read(path: Path) -> dict | None:
    try:
        with open(path, "rb") as handle:
            return pickle.load(handle)
    except FileNotFoundError:
        return None


def clear(folder: Path) -> None:
    """Remove the calls and answers an earlier trainer left (called before the ranks start)."""
    if folder.is_dir():
        for stale in folder.iterdir():
            stale.unlink(missing_ok=True)


class Expected:
    """A call the rank is about to make, announced ahead (`FileSyncClient.expect`) so that another thread can
    wait for the server to take it (see the module doc)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self._settled = threading.Event()
        self._error: SyncFailed | None = None

    def taken(self) -> None:
        self._settled.set()

    def not_taken(self, error: SyncFailed) -> None:
        if not self._settled.is_set():
            self._error = error
            self._settled.set()

    def wait_taken(self, timeout_s: float) -> None:
        """Return once the server took the call (its engine runs it); raise SyncInterrupted when it was
        withdrawn because the job is ending, SyncFailed when it failed before the server had it."""
        if not self._settled.wait(timeout_s):
            raise SyncFailed(
                f"weight sync: the server did not take {self.method} within weight_sync_timeout_s="
                f"{timeout_s:g} (its engine stopped receiving, or the server is gone)"
            )
        if self._error is not None:
            raise self._error


class FileSyncClient:
    """The rank's ``VLLMWeightSyncClient`` (see the module doc). ``version`` is the policy version that the
    next ``finish_weight_update`` tags the weights with."""

    def __init__(self, folder: Path, timeout_s: float, alive: Callable[[], bool] | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.alive = alive or (lambda: True)
        self.session = uuid.uuid4().hex[:8]
        self.count = 0
        self.version: int | None = None
        self._expected: dict[str, Expected] = {}

    def expect(self, method: str) -> Expected:
        """Announce the next call of ``method``, made by another thread: the returned object tells when the
        server takes it."""
        expected = self._expected[method] = Expected(method)
        return expected

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.version
        self._call("finish_weight_update", None if version is None else str(version))

    def _call(self, method: str, argument: Any = None) -> Any:
        expected = self._expected.pop(method, None) or Expected(method)
        try:
            return self._make(method, argument, expected)
        except SyncFailed as error:
            expected.not_taken(error)  # no-op when the server had taken it
            raise
        finally:
            expected.not_taken(SyncFailed(f"weight sync: {method} ended before the server took it"))

    def _make(self, method: str, argument: Any, expected: Expected) -> Any:
        self._check_job_ending(method)
        self.count += 1
        name = f"{self.session}-{self.count:06d}"
        call_path = self.folder / f"call-{name}.pkl"
        taken_path, answer_path = self.folder / f"taken-{name}.pkl", self.folder / f"done-{name}.pkl"
        _write(call_path, {"method": method, "argument": argument, "sent": time.time()})
        deadline = time.monotonic() + self.timeout_s
        while (answer := _read(answer_path)) is None:
            if taken_path.exists():
                expected.taken()
            if job_ending(self.folder):
                self._withdraw(call_path, taken_path, answer_path, expected)
                self._check_job_ending(method)
            if time.monotonic() > deadline:
                raise SyncFailed(
                    f"weight sync: the server did not complete {method} within weight_sync_timeout_s="
                    f"{self.timeout_s:g} (its engine stopped receiving, or the server is gone)"
                )
            if not self.alive():
                raise SyncFailed(f"weight sync: the server went away during {method}")
            time.sleep(0.005)
        answer_path.unlink(missing_ok=True)
        if answer.get("job_ending"):
            self._check_job_ending(method)
        expected.taken()
        if not answer.get("ok"):
            raise SyncFailed(f"weight sync: the server's engine failed {method}: {answer.get('error')}")
        return answer.get("result")

    @staticmethod
    def _withdraw(call_path: Path, taken_path: Path, answer_path: Path, expected: Expected) -> None:
        """The job is ending: take the call back so the server never runs it once its loop goes on. When
        the server has it already (renamed to ``taken-``, or answered), its engine runs it: say so."""
        try:
            call_path.unlink()
        except FileNotFoundError:
            if taken_path.exists() or answer_path.exists():
                expected.taken()

    def _check_job_ending(self, method: str) -> None:
        if job_ending(self.folder):
            raise SyncInterrupted(f"weight sync: the server's job is ending; {method} is not sent")


def wait_for_engine(folder: Path, alive: Callable[[], bool], poll_s: float = 0.2) -> bool:
    """Wait until the server's engine serves (the :data:`ENGINE_UP` marker); False once ``alive()`` says
    the server is gone."""
    marker = Path(folder) / ENGINE_UP
    while not marker.exists():
        if not alive():
            return False
        time.sleep(poll_s)
    return True


Handler = Callable[[str, Any], Awaitable[Any]]
_background: set[asyncio.Future] = set()  # abandons that outlive their sync server's task


class SyncServer:
    """The server process's side: answers the rank's calls by running them on the engine, one at a time in
    the order sent. ``handler(method, argument)`` is the engine's coroutine for the call."""

    def __init__(
        self,
        folder: Path,
        handler: Handler,
        poll_s: float = 0.01,
        idle_poll_s: float = 0.1,
        busy_s: float = 2.0,
        abandon: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Calls are looked for every ``poll_s`` within ``busy_s`` of the last one (the calls of a sync come
        in a burst), else every ``idle_poll_s``: a run of days lists the folder ten times a second, not a
        hundred, on shared storage. ``abandon`` is awaited when a call finds the job ending (the engine
        resumes generation if a sync had paused it)."""
        self.folder = Path(folder)
        self.handler = handler
        self.abandon = abandon
        self._abandoned = False
        self.poll_s, self.idle_poll_s, self.busy_s = poll_s, idle_poll_s, busy_s
        self.busy_since: float | None = None  # monotonic time the call in progress began
        self._last_call = float("-inf")

    async def serve(self) -> None:
        """Run until cancelled. Its engine serves: the ranks may open their transfer group."""
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / ENGINE_UP).touch()
        try:
            while True:
                if not self._abandoned and job_ending(self.folder):
                    await self._abandon_once()
                calls = sorted(self.folder.glob("call-*.pkl"))
                if not calls:
                    recent = time.monotonic() - self._last_call < self.busy_s
                    await asyncio.sleep(self.poll_s if recent else self.idle_poll_s)
                    continue
                for path in calls:
                    await self._answer(path)
                self._last_call = time.monotonic()
        finally:
            if not self._abandoned and job_ending(self.folder):  # stopped as the job ends, before it looked
                _background.add(task := asyncio.ensure_future(self._abandon_once()))
                task.add_done_callback(_background.discard)

    async def _answer(self, path: Path) -> None:
        call = _read(path)
        name = path.name.removeprefix("call-")
        if call is None:  # withdrawn by the rank since the listing
            return
        method = call.get("method")
        if job_ending(self.folder):  # the rank stopped waiting for it: never run, answered for the record
            if not _take(path, None):
                return
            log.info("weight sync: %s not run, the job is ending", method)
            await self._abandon_once()
            _write(self.folder / f"done-{name}", {"ok": False, "job_ending": True, "error": "job ending"})
            return
        taken = self.folder / f"taken-{name}"
        if not _take(path, taken):
            log.info("weight sync: %s withdrawn by the rank (its job is ending)", method)
            return
        self.busy_since = time.monotonic()
        try:
            if method not in METHODS:
                raise ValueError(f"unknown weight-sync call {method!r}")
            result = await self.handler(method, call.get("argument"))
            answer = {"ok": True, "result": result}
        except Exception as error:  # answered to the rank, which fails its step with it
            log.exception("weight sync: %s failed", method)
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        finally:
            self.busy_since = None
        _write(self.folder / f"done-{name}", answer)
        taken.unlink(missing_ok=True)

    async def _abandon_once(self) -> None:
        if self._abandoned:
            return
        self._abandoned = True
        if self.abandon is not None:
            try:  # shielded: the server's shutdown cancels this task, and the engine must resume all the same
                await asyncio.shield(self.abandon())
            except Exception:  # the job is going down: logged, never raised into the loop
                log.exception("weight sync: abandoning the sync in progress failed")


def _take(call: Path, taken: Path | None) -> bool:
    """The server's side of the take-or-withdraw race (see the module doc): rename the call to ``taken``
    (remove it when None); False when the rank withdrew it first."""
    try:
        if taken is None:
            call.unlink()
        else:
            call.rename(taken)
    except FileNotFoundError:
        return False
    return True
