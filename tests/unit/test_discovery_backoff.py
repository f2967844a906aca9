"""A client whose server is away: how often it reads the rendezvous on shared storage, and that a stop
(SIGTERM, a cancel) ends its wait at once (issue 31)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path

import pytest

from ajet_hpc.client.discovery import POLL_MAX_S, WaitStopped, next_poll_s, wait_for_server
from ajet_hpc.storage.rundir import RunDir


def reads_in(seconds: float, seed: int) -> list[float]:
    rng, now, pause, reads = random.Random(seed), 0.0, 0.0, []
    while now < seconds:
        reads.append(now)
        pause = next_poll_s(pause, rng=rng)
        now += pause
    return reads


@pytest.mark.parametrize("seed", range(5))
def test_an_away_server_is_read_ever_less_often_then_at_most_every_20_s_with_jitter(seed: int) -> None:
    reads = reads_in(3600, seed)
    after_first_minute = [t for t in reads if t >= 60]
    gaps = [b - a for a, b in itertools.pairwise(after_first_minute)]
    assert all(POLL_MAX_S <= gap <= POLL_MAX_S * 1.25 for gap in gaps)  # at most 3 reads a minute
    assert len([t for t in reads if t < 60]) <= 8  # 1, 2, 4, 8, 16 s, then the cap
    assert len(set(round(g, 3) for g in gaps)) > len(gaps) // 2  # jittered: tasks drift apart


def test_a_stop_ends_the_wait_at_once(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    (tmp_path / "run" / "servers").mkdir(parents=True)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(WaitStopped, match="no rendezvous file yet"):
        wait_for_server(run, "policy", stop=stop)
    assert time.monotonic() - started < 5
