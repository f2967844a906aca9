"""The weight sync's control plane between a rank and the server (``trainer.sync_channel``): ranks started
while the engine loads (``Coordinator.prestart``) wait for the sync server's ENGINE_UP marker before they
open their transfer group, and stop waiting when the server is gone; a job that ends during a sync
interrupts the rank's calls. Real files, a real serving task."""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from pathlib import Path

import pytest

from ajet_hpc.trainer.sync_channel import (
    ENGINE_UP,
    FileSyncClient,
    SyncInterrupted,
    SyncServer,
    announce_job_ending,
    clear,
    wait_for_engine,
)


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

    waited: dict[str, object] = {}

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
    outcome: dict[str, object] = {}

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
