"""The recorder's group commit (issue 17, item 3): episodes queued together share one commit and one fsync,
counted by the writer itself (``EpisodeWriter.stats``); a lone episode is not held back; a group is cut at
``commit_max_episodes``; ``on_written`` callbacks and ``written()`` answer only once their group is
committed; steps keep their place in the queue. Real store files, the recorder's real thread.

To queue records "together" deterministically the tests hold the recorder thread inside an ``on_written``
callback (callbacks of episodes submitted outside an event loop run on that thread) while they submit."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from test_episode_store import make_record, make_step

from ajet_hpc.config import ServerConfig, StoreConfig
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.server.recorder import EpisodeRecorder
from ajet_hpc.storage.episode_store_reader import EpisodeReader


def _closed(i: int) -> Episode:
    """A closed server episode whose record is ``make_record(i)``."""
    record = make_record(i)
    tracker = type("Tracker", (), {"timelines": record.timelines})()
    episode = Episode(episode_id=record.episode_id, model="policy", tracker=tracker)
    episode.state, episode.reward, episode.ended_at = FINISHED, 1.0, 5.0
    return episode


class _Gate:
    """Holds the recorder thread in the ``on_written`` callback of the first episode until opened."""

    def __init__(self, recorder: EpisodeRecorder) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        self.first: str | None = None
        recorder.on_written(self._hold)

    def _hold(self, episode: Episode) -> None:
        if self.first is None:
            self.first = episode.episode_id
            self.entered.set()
            assert self.opened.wait(60)

    def close_on(self, recorder: EpisodeRecorder, episode: Episode) -> None:
        recorder.submit(episode)
        assert self.entered.wait(60)


def test_sixty_four_episodes_queued_together_cost_one_fsync(tmp_path: Path) -> None:
    recorder = EpisodeRecorder(tmp_path / "s.h5")
    gate = _Gate(recorder)
    try:
        gate.close_on(recorder, _closed(0))
        stats = recorder.writer.stats
        assert (stats.commits, stats.fsyncs, stats.episodes) == (1, 1, 1)
        for i in range(1, 65):
            recorder.submit_record(make_record(i))
        gate.opened.set()
        assert recorder.flush(60)
        assert (stats.commits, stats.fsyncs, stats.episodes) == (2, 2, 65)  # 64 episodes, one fsync
        later = [make_record(i) for i in range(65, 129)]
        for record in later:  # the same, without the gate: the thread may wake before all are queued
            recorder.submit_record(record)
        assert recorder.flush(60)
        assert stats.episodes == 129 and stats.fsyncs - 2 <= 64 / 8, stats
    finally:
        recorder.close()
    with EpisodeReader(tmp_path / "s.h5") as reader:
        assert [s["episode_id"] for s in reader.summaries()] == [f"ep-{i}" for i in range(129)]
        assert reader.episode("ep-64") == make_record(64)


def test_a_group_stops_at_the_count_and_waits_for_more_within_the_interval(tmp_path: Path) -> None:
    """With a long interval a group of several waits for more records until it holds the count: records
    submitted after the gate opened join the group already taken (one commit of 5, not 2 + 3); a flush
    ends the group waiting (its caller waits for it)."""
    recorder = EpisodeRecorder(tmp_path / "s.h5", commit_interval_ms=120_000, commit_max_episodes=5)
    gate = _Gate(recorder)
    try:
        gate.close_on(recorder, _closed(0))
        stats = recorder.writer.stats
        recorder.submit_record(make_record(1))
        recorder.submit_record(make_record(2))
        gate.opened.set()
        for i in range(3, 6):
            threading.Event().wait(0.05)  # the group of 2 is taken by now, and waits
            recorder.submit_record(make_record(i))
        deadline = time.monotonic() + 60
        while stats.episodes < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (stats.commits, stats.episodes) == (2, 6), stats
        for i in range(6, 18):
            recorder.submit_record(make_record(i))
        assert recorder.flush(60)  # the last group of 2 does not wait two minutes for 3 more
        assert stats.episodes == 18 and stats.commits >= 5, stats  # at most 5 per group
    finally:
        recorder.close()
    with EpisodeReader(tmp_path / "s.h5") as reader:
        assert [s["episode_id"] for s in reader.summaries()] == [f"ep-{i}" for i in range(18)]


def test_a_lone_episode_is_committed_at_once(tmp_path: Path) -> None:
    """An interval of two minutes does not hold back a record that arrives alone: ``written()`` (which does
    not end a group, unlike ``flush``) answers within 30 s."""
    recorder = EpisodeRecorder(tmp_path / "s.h5", commit_interval_ms=120_000)

    async def end_and_wait(i: int) -> bool:
        recorder.submit_record(make_record(i))
        return await asyncio.wait_for(recorder.written(), 30)

    try:
        for i in range(3):
            assert asyncio.run(end_and_wait(i)) is True
        assert recorder.writer.stats.commits == 3
    finally:
        recorder.close()


def test_callbacks_and_written_answer_after_the_commit_in_order(tmp_path: Path) -> None:
    """Each ``on_written`` call sees its episode committed (the writer's count covers it), in submission
    order; steps queued between episodes keep their place; ``written()`` on an event loop is True once
    everything before it is in the store."""
    recorder = EpisodeRecorder(tmp_path / "s.h5")
    gate = _Gate(recorder)
    seen: list[tuple[str, int]] = []
    recorder.on_written(lambda episode: seen.append((episode.episode_id, recorder.writer.stats.episodes)))
    try:
        gate.close_on(recorder, _closed(0))
        for i in range(1, 40):
            recorder.submit(_closed(i))
            if i % 10 == 0:
                recorder.submit_step(make_step(i // 10))
        gate.opened.set()

        async def end_and_wait() -> bool:
            recorder.submit(_closed(40))
            return await recorder.written()

        assert asyncio.run(end_and_wait()) is True
        assert recorder.flush(60)
    finally:
        recorder.close()
    assert [episode_id for episode_id, _ in seen] == [f"ep-{i}" for i in range(41)]
    assert all(committed >= int(episode_id[3:]) + 1 for episode_id, committed in seen), seen
    # 1 before the gate, then 39 episodes + 3 steps, with ep-40 if it came within the commit interval
    assert recorder.writer.stats.commits in (2, 3)
    with EpisodeReader(tmp_path / "s.h5") as reader:
        assert [s["step"] for s in reader.steps()] == [1, 2, 3]
        assert len(reader) == 41


def test_store_config_reaches_the_recorder(tmp_path: Path) -> None:
    server = ServerConfig.model_validate(
        {"name": "a", "model": "builtin:tiny", "store": StoreConfig(commit_interval_ms=2.0)}
    )
    recorder = EpisodeRecorder.from_config(tmp_path / "s.h5", server.models[0].store)  # as process.serve
    recorder.close()
    assert (recorder.commit_interval_s, recorder.commit_max) == (0.002, 64)
    assert (
        ServerConfig.model_validate({"name": "a", "model": "builtin:tiny"}).models[0].store == StoreConfig()
    )
    for bad in ({"commit_max_episodes": 0}, {"commit_interval_ms": -1.0}, {"commit_every": 3}):
        with pytest.raises(ValueError, match=r"store\.commit"):
            ServerConfig.model_validate({"name": "a", "model": "builtin:tiny", "store": bad})
    for name, field in StoreConfig.model_fields.items():
        assert field.description, name


def test_an_unstorable_record_in_a_group_lets_the_records_before_it_through(tmp_path: Path) -> None:
    """The records before it are committed as a group; it and those after it wait, in order (retried, as
    a record whose append failed always was), and are named by ``unwritten_ids``."""
    recorder = EpisodeRecorder(tmp_path / "s.h5")
    gate = _Gate(recorder)
    bad = make_record(3)
    bad.metadata = {"x": object()}
    try:
        gate.close_on(recorder, _closed(0))
        for record in (make_record(1), make_record(2), bad, make_record(4)):
            recorder.submit_record(record)
        gate.opened.set()
        assert recorder.flush(60)
        assert recorder.unwritten_ids() == frozenset({"ep-3", "ep-4"}) and recorder.failed == 1
        assert recorder.writer.stats.episodes == 3
    finally:
        recorder.close()
    with EpisodeReader(tmp_path / "s.h5") as reader:
        assert [s["episode_id"] for s in reader.summaries()] == ["ep-0", "ep-1", "ep-2"]


def test_a_flush_after_close_answers_at_once(tmp_path: Path) -> None:
    """A signal's save flushes the recorder; when the server already stopped (training complete, then the
    job's SIGTERM) the recorder is closed: the flush says whether all was stored, at once, instead of
    waiting out its budget for a thread that is gone (every finished run waited 20 s for it)."""
    recorder = EpisodeRecorder(tmp_path / "s.h5")
    recorder.submit_record(make_record(0))
    recorder.close()
    started = time.monotonic()
    assert recorder.flush(30)
    assert time.monotonic() - started < 5
