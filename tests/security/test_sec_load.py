"""Load on loopback, small: 50 concurrent agents (real ``openai`` clients) for 10 s against one real server
process on the tiny model and the vLLM engine, which batches them (tools/bench/load_agents.py, which also
takes the full 500 agents for 60 s and prints the latencies; docs/reliability.md has its figures).
Checked here: no answer >= 500 and no transport error, no 4xx to well-formed calls, and every episode
whose end was answered is in the server's store exactly once (nothing lost, nothing twice, nothing stored
that was not ended). No wall time is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
import load_agents

pytestmark = pytest.mark.slow


def test_50_agents_for_10_s_no_5xx_and_every_ended_episode_stored_once(tmp_path: Path) -> None:
    report = load_agents.run(agents=50, seconds=10, engine="vllm", turns=2, workdir=tmp_path)
    load_agents.show(report)
    tally = report.tally
    assert tally.server_errors == 0, tally.errors
    assert tally.transport_errors == 0, tally.errors
    assert tally.client_errors == 0, tally.errors
    assert len(tally.ended) >= 50, f"only {len(tally.ended)} episodes ended: the load did not run"
    assert not report.lost, f"{len(report.lost)} ended episodes missing from the store: {report.lost[:5]}"
    assert not report.duplicated, f"episodes stored more than once: {report.duplicated[:5]}"
    assert not report.unexpected, f"stored without an accepted end: {report.unexpected[:5]}"
    assert report.server_exit == 0, f"the server exited with {report.server_exit}"
