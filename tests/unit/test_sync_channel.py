"""The weight sync's control plane between a rank and the server (``trainer.protocol.sync_channel``): ranks
started while the engine loads (``Coordinator.prestart``) wait for the sync server's ENGINE_UP marker
before they open their transfer group, and stop waiting when the server is gone; a job that ends during a
sync interrupts the rank's calls; rank 0 learns whether the server took its ``update_weights`` or it was
withdrawn (take-or-withdraw, before it sends). Real files, a real serving task."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from pathlib import Path
from typing import TypedDict

import pytest

from ajet_hpc.trainer.protocol.sync_channel import (
    ENGINE_UP,
    FileSyncClient,
    SyncFailed,
    SyncInterrupted,
    SyncServer,
    announce_job_ending,
    clear,
    wait_for_engine,
)


class Waited(TypedDict, total=False):
    up: bool  # what wait_for_engine returned
    s: float  # how long it waited


class Interrupted(TypedDict, total=False):
    error: str  # the SyncInterrupted message
    s: float  # how long the call waited before it


def test_a_rank_waits_for_the_engine_then_its_calls_are_answered(tmp_path: Path) -> None:
    folder = tmp_path / "sync"
    folder.mkdir()
    (folder / ENGINE_UP).touch()  # left by an earlier job
    clear(folder)  # the coordinator, before the ranks start
    assert not (folder / ENGINE_UP).exists()
    calls: list[tuple[str, object]] = []

    async def handler(method: str, argument: object) -> str:
        calls.append((method, argument))
        return "ok"

    waited: Waited = {}

    def rank() -> None:
        started = time.monotonic()
        waited["up"] = wait_for_engine(folder, alive=lambda: True, poll_s=0.01)
        waited["s"] = time.monotonic() - started
        FileSyncClient(folder, timeout_s=30).start_weight_update()

    thread = threading.Thread(target=rank)
    thread.start()

    async def serve_later() -> None:
        await asyncio.sleep(0.3)  # the engine loads
        assert not (folder / ENGINE_UP).exists() and thread.is_alive()
        server = asyncio.create_task(SyncServer(folder, handler, poll_s=0.01).serve())
        while thread.is_alive():
            await asyncio.sleep(0.01)
        server.cancel()

    asyncio.run(serve_later())
    thread.join()
    assert waited["up"] is True and waited["s"] >= 0.3
    assert calls == [("start_weight_update", None)]


def test_a_rank_stops_waiting_when_the_server_is_gone(tmp_path: Path) -> None:
    checks = iter([True, True, False])
    assert wait_for_engine(tmp_path, alive=lambda: next(checks), poll_s=0.01) is False


def test_a_call_waiting_when_the_job_ends_is_interrupted_and_never_run(tmp_path: Path) -> None:
    """The server saves on its job's signal with its event loop blocked: a rank's call waiting for an answer
    stops at the job-ending marker (well before its timeout) and takes its call back; a later call is not
    even sent. When the loop goes on, the sync server runs nothing, and lets the engine resume once."""
    folder = tmp_path / "sync"
    folder.mkdir()
    client = FileSyncClient(folder, timeout_s=60)
    outcome: Interrupted = {}

    def rank() -> None:
        started = time.monotonic()
        try:
            client.start_weight_update()
        except SyncInterrupted as stopped:
            outcome["error"], outcome["s"] = str(stopped), time.monotonic() - started

    thread = threading.Thread(target=rank)
    thread.start()
    while not list(folder.glob("call-*.pkl")):  # the call is written; nobody answers (the loop is blocked)
        time.sleep(0.01)
    announce_job_ending(folder)
    thread.join(10)
    assert not thread.is_alive() and outcome["s"] < 10
    assert "job is ending" in str(outcome["error"]) and "start_weight_update" in str(outcome["error"])
    assert not list(folder.glob("call-*.pkl"))  # taken back: never run once the loop goes on
    with pytest.raises(SyncInterrupted):
        client.finish_weight_update()
    assert not list(folder.glob("call-*.pkl"))

    ran: list[str] = []
    abandoned: list[bool] = []

    async def handler(method: str, argument: object) -> None:
        ran.append(method)

    async def abandon() -> None:
        abandoned.append(True)

    async def loop_goes_on() -> None:
        (folder / "call-late-000001.pkl").write_bytes(pickle.dumps({"method": "update_weights"}))
        server = asyncio.create_task(SyncServer(folder, handler, poll_s=0.01, abandon=abandon).serve())
        while not (folder / "done-late-000001.pkl").exists():
            await asyncio.sleep(0.01)
        server.cancel()

    asyncio.run(loop_goes_on())
    assert ran == [] and abandoned == [True]
    answer = pickle.loads((folder / "done-late-000001.pkl").read_bytes())
    assert answer["ok"] is False and answer["job_ending"] is True


def test_rank_0_sends_only_once_the_server_took_update_weights(tmp_path: Path) -> None:
    """The engine receives inside ``update_weights`` while rank 0 sends, in the same collectives, so rank 0
    waits until the server took that call. A call the job's end catches before the server took it (the
    server's loop blocked by the save) is withdrawn, and the wait says so: rank 0 never starts sending to
    receivers that will not come. A call the server took is not withdrawn: its engine runs it, the wait
    returns, and only the answer, which the job's end makes moot, is given up."""
    withdrawn_folder = tmp_path / "withdrawn"
    client = FileSyncClient(withdrawn_folder, timeout_s=60)
    receiving = client.expect("update_weights")
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.update_weights({"names": []})
        except SyncFailed as error:
            errors.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    while not list(withdrawn_folder.glob("call-*.pkl")):
        time.sleep(0.01)
    with pytest.raises(SyncFailed, match="did not take update_weights"):
        receiving.wait_taken(0.2)  # nobody serves the folder
    announce_job_ending(withdrawn_folder)
    with pytest.raises(SyncInterrupted, match="update_weights"):
        receiving.wait_taken(10)
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], SyncInterrupted)
    assert not list(withdrawn_folder.glob("call-*.pkl")) and not list(withdrawn_folder.glob("taken-*"))

    taken_folder = tmp_path / "taken"
    client = FileSyncClient(taken_folder, timeout_s=60)
    ran: list[str] = []
    release = threading.Event()

    async def handler(method: str, argument: object) -> None:
        ran.append(method)
        await asyncio.to_thread(release.wait, 30)  # the engine receives

    async def serve() -> None:
        server = asyncio.create_task(SyncServer(taken_folder, handler, poll_s=0.01).serve())
        while not release.is_set() or list(taken_folder.glob("taken-*")):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        server.cancel()

    serving = threading.Thread(target=asyncio.run, args=(serve(),))
    serving.start()
    receiving = client.expect("update_weights")
    errors.clear()
    thread = threading.Thread(target=call)
    thread.start()
    receiving.wait_taken(10)  # returns: rank 0 may send
    assert ran == ["update_weights"]
    announce_job_ending(taken_folder)  # the save begins while the engine receives
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], SyncInterrupted)
    receiving.wait_taken(0)  # still taken, never withdrawn
    release.set()
    serving.join(10)
    assert not serving.is_alive() and ran == ["update_weights"]
    assert [p.name for p in taken_folder.glob("done-*")] and not list(taken_folder.glob("taken-*"))
