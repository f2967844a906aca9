"""Exactly once through a server restart, with real processes and real HTTP: episode keys ended before
the restart stay ended (a resuming client's begin is refused with the recorded result and the keys are
listed for it), the finished episodes of a half-complete task group go back into the collector, and the
first step trains them together with the repeat that ran after the restart: each episode once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from support import REPO, run_module, topology_dict, wait_until, write_topology

from ajet_hpc.client.handshake import run_client
from ajet_hpc.client.session import EpisodeAPI, KeyEnded
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.rundir import RunDir

pytestmark = pytest.mark.slow


def start_server(run: Path, log: Path) -> subprocess.Popen:
    out = log.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "ajet_hpc.server", str(run)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
    )


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=90)


def run_episode(api: EpisodeAPI, task: str, repeat: int, reward: float) -> dict:
    begun = api.begin(task, "math", {"repeat": repeat}, repeat)
    chat = openai.OpenAI(base_url=begun["base_url"], api_key=begun["api_key"], max_retries=0)
    chat.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": f"{task}?"}], max_tokens=4
    )
    return api.end(begun["episode_id"], reward, None, {}, key=("math", task, repeat))


def connect(
    run: Path, previous: rendezvous.Rendezvous | None = None
) -> tuple[EpisodeAPI, rendezvous.Rendezvous]:
    def ready() -> rendezvous.Rendezvous | None:
        found = rendezvous.read(run / "servers" / "policy.json")
        if found is None or (previous is not None and found.started_at == previous.started_at):
            return None
        return found if found.state == "training" else None

    record: rendezvous.Rendezvous = wait_until(ready, 300, "the server's rendezvous")
    return EpisodeAPI(record.url, RunDir.at(run).read_secret()), record


def test_keys_and_half_complete_groups_survive_a_server_restart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = topology_dict(run)
    data["clients"] = []
    data["servers"][0]["trainer"] = {
        "ranks": 1,
        "zero_stage": 2,
        "tasks_per_batch": 2,
        "repeats": 2,
        "total_steps": 1,
        "max_staleness": 4,
    }
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)), "--no-submit")
    assert done.returncode == 0, done.stderr + done.stdout
    log = tmp_path / "server.log"
    server = start_server(run, log)
    try:
        api, first = connect(run)
        ended = {(t, r): run_episode(api, t, r, float(r)) for t, r in (("t0", 0), ("t0", 1), ("t1", 0))}
        retried = api.end(ended["t0", 0]["episode_id"], 0.0, None, {})  # the answer was lost: again
        assert retried["duplicate"] and retried["episode_id"] == ended["t0", 0]["episode_id"]
        with pytest.raises(KeyEnded):
            api.begin("t0", "math", {}, 0)
        refusals(api, ended["t0", 0]["episode_id"], RunDir.at(run).read_secret())
        api.close()
        stop(server)  # t1 lacks its repeat 1: no batch yet, nothing trained

        server = start_server(run, log)
        api, _ = connect(run, first)
        listed = api.ended("math")
        assert {key: e["episode_id"] for key, e in listed.items()} == {
            key: e["episode_id"] for key, e in ended.items()
        }
        with pytest.raises(KeyEnded, match=ended["t0", 1]["episode_id"]):
            api.begin("t0", "math", {}, 1)
        last = run_episode(api, "t1", 1, 1.0)
        rows = wait_until(lambda: _rows(run), 300, "the first step")
        assert rows[0]["recovered_episodes"] == 3 and rows[0]["episodes"] == 4
        journal = [
            json.loads(line) for line in (run / "ckpt" / "policy" / "consumed.jsonl").read_text().split()
        ]
        trained = {e["episode_id"] for e in ended.values()} | {last["episode_id"]}
        assert [(j["step"], set(j["trained"])) for j in journal] == [(1, trained)]
        wait_until(lambda: server.poll() is not None, 120, "the server to finish")
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
    with EpisodeReader(run / "data" / "policy.h5") as reader:
        finished = [s for s in reader.summaries() if s["state"] == "finished"]
        steps = reader.steps()
    keys = [(s["task_id"], s["metadata"]["repeat"]) for s in finished]
    assert sorted(keys) == [("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1)]  # one episode per key
    assert [s["step"] for s in steps] == [1] and set(steps[0]["episode_ids"]) == trained
    assert "restored 3 finished episode(s)" in log.read_text()


def refusals(api: EpisodeAPI, finished_id: str, secret: str) -> None:
    """Bad ends get a 4xx naming the problem, and change nothing: a finished episode's other reward, an
    end naming another key, an episode this server never began."""
    http = run_client(api.url, secret)
    other = http.post(f"/v1/episodes/{finished_id}/end", json={"reward": 0.5})
    assert other.status_code == 409 and other.json()["error"]["code"] == "episode_finished"
    begun = api.begin("t9", "math", {}, 0)
    wrong = http.post(f"/v1/episodes/{begun['episode_id']}/end", json={"reward": 1.0, "group": "tools"})
    assert wrong.status_code == 409 and "belongs to group 'math'" in wrong.json()["error"]["message"]
    unknown = http.post("/v1/episodes/ep-0000/end", json={"reward": 1.0})
    assert unknown.status_code == 404 and "unknown episode" in unknown.json()["error"]["message"]
    assert http.get(f"/v1/episodes/{begun['episode_id']}").json()["state"] == "open"  # unchanged
    api.abort(begun["episode_id"], "test over")
    http.close()


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
