"""The server's recorder on a full disk (issue 14, item 1): an episode whose append fails is kept and
written once space is back; until then ``written`` says False (the end answers 503, not a success the store
does not back) and the episode is not among the keys a client may commit. The disk is a real tmpfs with a
size limit, filled by a ballast file (as in test_sec_stores.py)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import Harness
from support import fill_disk, tmpfs
from test_sec_stores import make_record

from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.server import recorder as recorder_module
from ajet_hpc.server.recorder import EpisodeRecorder
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.episode_store_writer import EpisodeWriter


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "4m") as mount:
        yield mount


def test_episodes_that_meet_a_full_disk_are_written_once_space_is_back(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(recorder_module, "RETRY_S", 0.5)
    EpisodeWriter(small_disk / "policy.h5", chunk_tokens=1024).close()  # chunks that fit a 4 MiB disk
    recorder = EpisodeRecorder(small_disk / "policy.h5")
    try:
        for i in range(3):
            recorder.submit_record(make_record(i))
        assert asyncio.run(recorder.written()) is True
        ballast = fill_disk(small_disk, 600_000)
        submitted = 3
        while asyncio.run(recorder.written()):  # big episodes until one does not fit
            recorder.submit_record(make_record(submitted, turns=8, answer=50))
            submitted += 1
            assert submitted < 10_000, "the disk never ran full"
        waiting = recorder.unwritten_ids()
        assert f"ep-{submitted - 1}" in waiting and recorder.failed >= 1
        recorder.submit_record(make_record(submitted))  # queued behind the failed one, in order
        submitted += 1
        assert asyncio.run(recorder.written()) is False
        ballast.unlink()
        deadline = time.monotonic() + 30
        while recorder.unwritten_ids() and time.monotonic() < deadline:
            time.sleep(0.2)  # retried every RETRY_S without a new record
        assert recorder.unwritten_ids() == frozenset()
        assert asyncio.run(recorder.written()) is True
    finally:
        recorder.close()
    with EpisodeReader(small_disk / "policy.h5") as reader:
        ids = [s["episode_id"] for s in reader.summaries()]
    assert ids == [f"ep-{i}" for i in range(submitted)]  # every episode once, in order: nothing lost
    assert os.path.getsize(small_disk / "policy.h5") > 0


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory):
    harness = Harness("transformers", resolve_model("builtin:tiny", tmp_path_factory.mktemp("models")))
    yield harness
    harness.close()


def test_an_end_the_store_cannot_take_is_answered_503_and_not_offered_for_commit(
    harness: Harness, small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real API: an end whose episode the store cannot take yet gets 503 ``store_unavailable``
    (not a success a client would commit), its key is left out of ``/v1/episodes/ended``, nothing is handed
    to training (``on_written``: the trainer's collector), and the same end again, once space is back,
    answers the recorded result."""
    monkeypatch.setattr(recorder_module, "RETRY_S", 0.5)
    EpisodeWriter(small_disk / "policy.h5", chunk_tokens=1024).close()
    server = harness.serve(store=small_disk / "policy.h5")
    recorder = server.ctx.recorder
    assert isinstance(recorder, EpisodeRecorder)
    trainable: list[tuple[str, bool]] = []  # (episode id, on the server's event loop thread)
    recorder.on_written(lambda episode: trainable.append((episode.episode_id, _on_a_loop())))
    try:
        ballast = fill_disk(small_disk, 600_000)
        filler = 0
        while asyncio.run(recorder.written()):  # big episodes until the store stops taking them
            recorder.submit_record(make_record(filler, turns=8, answer=50))
            filler += 1
            assert filler < 10_000, "the disk never ran full"
        begun = server.begin(task_id="t1", group="math", repeat=0)
        reply = server.end(begun["episode_id"], 1.0, group="math", task_id="t1", repeat=0)
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "store_unavailable"
        ended = httpx.get(f"{server.url}/v1/episodes/ended", params={"group": "math"}, headers=server.admin)
        assert ended.json()["ended"] == []  # not in the store: no client may commit it yet
        assert trainable == []  # nor may the trainer take it: a server dying now would not find it again
        ballast.unlink()
        deadline = time.monotonic() + 30
        while not trainable and time.monotonic() < deadline:
            time.sleep(0.2)
        assert trainable == [(begun["episode_id"], True)]
        again = server.end(begun["episode_id"], 1.0, group="math", task_id="t1", repeat=0)
        assert again.status_code == 200 and again.json()["duplicate"] is True, again.text
        ended = httpx.get(f"{server.url}/v1/episodes/ended", params={"group": "math"}, headers=server.admin)
        assert [e["episode_id"] for e in ended.json()["ended"]] == [begun["episode_id"]]
    finally:
        recorder.close()
    with EpisodeReader(small_disk / "policy.h5") as reader:
        ids = [s["episode_id"] for s in reader.summaries()]
    assert ids.count(begun["episode_id"]) == 1 and len(ids) == filler + 1


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
