"""A client whose server is away: how often it reads the rendezvous on shared storage, and that a stop
(SIGTERM, a cancel) ends its wait at once (issue 31)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path

import pytest

from ajet_hpc.client.discovery import POLL_PER_OP_S, WaitStopped, next_poll_s, wait_for_server
from ajet_hpc.storage.rundir import RunDir


def reads_in(seconds: float, seed: int, metadata_ops: int) -> list[float]:
    rng, now, pause, reads = random.Random(seed), 0.0, 0.0, []
    while now < seconds:
        reads.append(now)
        pause = next_poll_s(pause, now, metadata_ops, rng=rng)
        now += pause
    return reads


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("metadata_ops", [1, 2])  # the file absent (a failed open), or there (open, fstat)
def test_an_away_server_is_read_often_in_the_first_minute_then_once_per_10_s_per_operation(
    seed: int, metadata_ops: int
) -> None:
    reads = reads_in(3600, seed, metadata_ops)
    first_minute = [t for t in reads if t < 60]
    assert first_minute[:4] == [0, 1, 3, 7] and len(first_minute) <= 16  # 1, 2, 4 s, then every 5-6.25 s
    assert all(b - a <= 6.25 for a, b in itertools.pairwise(first_minute))  # a starting server found soon
    after = [t for t in reads if t >= 60]
    gaps = [b - a for a, b in itertools.pairwise(after)]
    budget = POLL_PER_OP_S * metadata_ops  # one metadata operation per 10 s: 1,000/s for 10,000 tasks
    assert all(budget <= gap <= budget * 1.25 for gap in gaps)
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
