"""Hot swap of client groups through the real launcher CLI, without servers: every wrong request exits 2 with
a message that says what to do and changes nothing; a swap (with a stand-in backend) rewrites the frozen
topology so that a plain resume accepts it, and records itself in swaps.jsonl and jobs.json. Also the
runner's two parts of a swap: skipping what any store of the group committed, and draining open episodes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support import topology_dict

from ajet_hpc.client.runner import committed_in_group, resharded
from ajet_hpc.client.session import ClientStopping, EpisodeAPI
from ajet_hpc.config import load_topology
from ajet_hpc.launch import control, registry, swap
from ajet_hpc.launch.cli import main
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.storage.client_store import ClientStore, Result
from ajet_hpc.storage.rundir import RunDir, RunDirError

OLD = "ajet_hpc.environments.arithmetic.agent:solve"


def _finished_pid() -> str:
    process = subprocess.Popen(["true"])
    process.wait()
    return str(process.pid)


def _job(name: str, target: str, backend: str = "local") -> SubmittedJob:
    pid = _finished_pid()
    return SubmittedJob(name, backend, pid, [pid], f"logs/{name}", [target])


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    """A run directory whose server and client array were submitted (locally) and have finished."""
    data = topology_dict(tmp_path / "run", array=2)
    topology = load_topology(data)
    run = RunDir.for_topology(topology)
    run.prepare(topology)
    registry.record(run, [_job("server-policy", "policy"), _job("clients-math", "math")])
    rows = [{"step": s, "model": "policy", "policy_version": s} for s in (1, 2, 3)]
    (run.root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


CASES: dict[str, tuple[list[str], str]] = {
    "unknown group": (["--swap-clients", "maths"], r"no client group named 'maths'.*groups are: math"),
    "bad agent spec": (["--swap-clients", "math", "--agent", "no colon"], r"--agent: "),
    "agent not importable": (
        ["--swap-clients", "math", "--agent", "no_such_module_x:solve"],
        r"cannot import 'no_such_module_x'",
    ),
    "agent missing": (
        ["--swap-clients", "math", "--agent", "ajet_hpc.environments.arithmetic.agent:nope"],
        r"has no callable 'nope'",
    ),
    "zero array": (["--swap-clients", "math", "--array", "0"], r"--array: .*at least 1"),
    "agent alone": (["--agent", "tests.fixture_agents:arithmetic_swapped"], r"go with --swap-clients"),
    "swap and add": (["--swap-clients", "math", "--add-clients", "x.yaml"], r"either --swap-clients"),
    "with overrides": (["clients.math.array=4", "--swap-clients", "math"], r"overrides cannot be combined"),
    "with force": (["--swap-clients", "math", "--force"], r"--force cannot be combined"),
}


@pytest.mark.parametrize("case", CASES)
def test_wrong_swap_requests_exit_2_and_change_nothing(
    case: str, run: RunDir, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, message = CASES[case]
    before = run.topology_file.read_text(), run.jobs_file.read_text()
    err = _fails(capsys, str(run.root), *argv)
    assert err.startswith("error: ")
    assert re.search(message, err, flags=re.S), err
    assert (run.topology_file.read_text(), run.jobs_file.read_text()) == before
    assert not run.swaps_file.exists()


def test_runs_that_cannot_be_swapped_say_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = topology_dict(tmp_path / "run")
    topology = load_topology(data)
    run = RunDir.for_topology(topology)
    source = tmp_path / "topology.yaml"
    source.write_text(yaml.safe_dump(data))
    assert "is not a run directory" in _fails(capsys, str(source), "--swap-clients", "math")
    run.prepare(topology)
    assert "no jobs.json" in _fails(capsys, str(run.root), "--swap-clients", "math")
    registry.record(run, [_job("server-policy", "policy")])
    assert "was never submitted" in _fails(capsys, str(run.root), "--swap-clients", "math")

    het = topology_dict(tmp_path / "het", hetjob=True)
    het_run = RunDir.for_topology(load_topology(het))
    het_run.prepare(load_topology(het))
    registry.record(het_run, [_job("het-policy-math", "policy", backend="hetjob")])
    assert "cluster.hetjob: false" in _fails(capsys, str(het_run.root), "--swap-clients", "math")


def test_a_swap_in_progress_is_not_joined(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    holder = {"pid": os.getpid(), "host": os.uname().nodename, "since": 0}
    (run.root / "swap.lock").write_text(json.dumps(holder))
    err = _fails(capsys, str(run.root), "--swap-clients", "math", "--array", "3")
    assert "still in progress" in err and f"pid {os.getpid()}" in err
    assert run.load_topology().client("math").array == 2


class StandIn:
    """A backend that records what it was asked to submit."""

    name = "local"

    def __init__(self) -> None:
        self.jobs: list[Any] = []

    def submit(self, job, run, cluster) -> SubmittedJob:
        self.jobs.append(job)
        return SubmittedJob(job.name, "local", "4242", ["4242"], f"logs/{job.name}", [job.target])


def test_swap_rewrites_topology_records_it_and_a_plain_resume_accepts_it(
    run: RunDir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = StandIn()
    monkeypatch.setattr(swap, "get_backend", lambda name: backend)
    agent = "tests.fixture_agents:arithmetic_swapped"
    assert main([str(run.root), "--swap-clients", "math", "--agent", agent, "--array", "3"]) == 0
    out = capsys.readouterr().out
    assert "array  2 -> 3" in out and "policy at step 3" in out and "submitted clients-math" in out

    (job,) = backend.jobs
    assert (job.name, job.array) == ("clients-math", 3)
    group = run.load_topology().client("math")
    assert (group.agent, group.array) == (agent, 3)
    (kept,) = run.root.glob("topology.*.yaml")
    assert load_topology(kept).client("math").array == 2
    (row,) = swap.read_swaps(run)
    assert row["action"] == "swap" and row["group"] == "math"
    assert row["old"]["agent"] == OLD and row["old"]["array"] == 2
    assert row["new"] == {"agent": agent, "array": 3, "job_id": "4242"}
    assert row["servers_at_swap"]["policy"]["step"] == 3
    assert registry.latest(run)["clients-math"].job_id == "4242"
    (line,) = control.describe_swaps(run)  # python -m ajet_hpc.status shows it
    assert line.endswith(f"swap math: agent {OLD} -> {agent}, array 2 -> 3 (job 4242; policy step 3)")
    assert not (run.root / "swap.lock").exists()

    assert run.prepare(run.load_topology()) == "resumed"  # python -m ajet_hpc.launch RUN
    original = load_topology(topology_dict(run.root, array=2))
    with pytest.raises(RunDirError, match=r"changed while it ran \(see swaps.jsonl\)"):
        run.prepare(original)


def test_add_clients_validates_the_block_with_the_topology(
    run: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = StandIn()
    monkeypatch.setattr(swap, "get_backend", lambda name: backend)
    block = dict(topology_dict(run.root)["clients"][0], name="math2", array=1)
    path = tmp_path / "math2.yaml"

    path.write_text(yaml.safe_dump([block]))
    assert "one client-group block" in _fails(capsys, str(run.root), "--add-clients", str(path))
    path.write_text(yaml.safe_dump(dict(block, name="math")))
    assert "use --swap-clients math" in _fails(capsys, str(run.root), "--add-clients", str(path))
    path.write_text(yaml.safe_dump(dict(block, servers=["nobody"], arrays=2)))
    err = _fails(capsys, str(run.root), "--add-clients", str(path))
    assert "servers[0]: unknown server 'nobody'" in err or "arrays" in err
    assert not backend.jobs and len(run.load_topology().clients) == 1

    path.write_text(yaml.safe_dump(block))
    assert main([str(run.root), "--add-clients", str(path), "--array", "2"]) == 0
    assert [c.name for c in run.load_topology().clients] == ["math", "math2"]
    assert run.load_topology().client("math2").array == 2
    (row,) = swap.read_swaps(run)
    assert (row["action"], row["group"], row["old"]) == ("add", "math2", None)
    assert backend.jobs[0].name == "clients-math2"


def test_a_local_task_that_ignores_sigterm_is_killed(
    run: RunDir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lingering = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert lingering.stdout is not None and lingering.stdout.readline() == "ready\n"
    job = SubmittedJob("clients-math", "local", str(lingering.pid), [str(lingering.pid)], "logs/x", ["math"])
    monkeypatch.setattr(swap, "LOCAL_GRACE_S", 1.0)
    took, _ = swap._stop(run, run.load_topology(), job, 30.0, print)
    assert lingering.poll() is not None and took < 20
    assert "ignored SIGTERM for 1s" in capsys.readouterr().out


def _result(task: str, repeat: int) -> Result:
    return Result(task, repeat, 1.0, {"policy": 1.0}, {"policy": "ep"}, None, {}, 0.0)


def test_a_runner_skips_what_any_store_of_its_group_committed(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    folder = tmp_path / "data" / "clients" / "math"
    for index, keys in {0: [("t0", 0)], 1: [("t1", 0), ("t3", 1)], 2: [("t2", 0)]}.items():
        with ClientStore.open(folder / f"{index}.h5", group="math", index=index) as store:
            for key in keys:
                store.commit(_result(*key))
    (folder / "2.h5").unlink()  # the journal alone still counts
    assert committed_in_group(run, "math", mine=folder / "0.h5") == {("t1", 0), ("t3", 1), ("t2", 0)}
    assert committed_in_group(run, "other", mine=folder / "0.h5") == set()


def test_a_runner_reads_other_stores_only_when_the_group_was_split_otherwise(run: RunDir) -> None:
    """A task opens no store but its own unless an earlier topology sharded its group otherwise: at the start
    of a 10,000-task array, every task reading every other store would be 10^8 opens."""
    group = run.load_topology().clients[0]
    assert not resharded(run, group)  # never swapped
    kept = run.replace_topology(run.load_topology())  # a swap that changed the agent only
    assert not resharded(run, group)
    old = yaml.safe_load(kept.read_text())
    old["clients"][0]["array"] = 5  # the array was 5 tasks before
    kept.write_text(yaml.safe_dump(old))
    assert resharded(run, group)
    kept.write_text("{not yaml")  # unreadable: the safe side
    assert resharded(run, group)
    kept.write_text(yaml.safe_dump({**old, "clients": []}))  # the group was added later
    assert not resharded(run, group)


def test_drain_aborts_open_episodes_and_begins_no_more() -> None:
    calls: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.path, body))
        if request.url.path == "/v1/episodes":
            return httpx.Response(200, json={"episode_id": f"ep-{len(calls)}"})
        return httpx.Response(200, json={})

    api = EpisodeAPI("http://server", "secret")
    api._http = httpx.Client(base_url="http://server", transport=httpx.MockTransport(handler))
    first, second = api.begin("t0", "math", {}), api.begin("t1", "math", {})
    api.end(first["episode_id"], 1.0, None, {})
    assert api.drain("stopped by SIGTERM") == 1
    assert calls[-1] == (f"/v1/episodes/{second['episode_id']}/abort", {"reason": "stopped by SIGTERM"})
    with pytest.raises(ClientStopping):
        api.begin("t2", "math", {})
