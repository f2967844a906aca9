"""The weight sync's control plane between a rank and the server (``trainer.sync_channel``): ranks started
while the engine loads (``Coordinator.prestart``) wait for the sync server's ENGINE_UP marker before they
open their transfer group, and stop waiting when the server is gone. Real files, a real serving task."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from ajet_hpc.trainer.sync_channel import ENGINE_UP, FileSyncClient, SyncServer, clear, wait_for_engine


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
