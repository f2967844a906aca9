"""A client array over many nodes (issue 31): on the dev cluster's partition ``wide`` (16 nodes), one array
of 32 tasks runs one episode each against two servers (``proposer`` and ``solver``, serving only). Every
task commits its episode exactly once and both servers recorded it; the tasks ran on all 16 nodes; and the
whole run opened the servers' rendezvous files only as tasks started, never to poll a server that answers
(opens counted by the kernel: inotify on ``RUN/servers``)."""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from support import run_module, topology_dict, wait_until, write_topology

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.client_store import read_results
from ajet_hpc.storage.episode_store_reader import EpisodeReader

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

# 32 tasks, 2 a node (a wide node has 2 CPUs, a task takes 1): the whole array runs at once, so it takes
# all 16 nodes, and every property below shows at that size. Each task's start-up (an interpreter, the
# client's imports) is most of the test's CPU: 256 tasks cost 3 minutes of CI, 64 a minute more than 32.
# tools/bench/scale.py measures the server at thousands of open episodes.
TASKS, NODES = 32, 16
IN_OPEN, IN_Q_OVERFLOW = 0x20, 0x4000


class Opens:
    """Files opened in one folder, by name, as the kernel reports them (inotify ``IN_OPEN``), read by a
    thread as they come. The kernel merges an event into an identical one not yet read, so the counts are
    lower bounds of the opens made: a bound from above holds, one from below would not."""

    def __init__(self, folder: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(folder), IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {folder}")
        self.counts: Counter[str] = Counter()
        self.overflowed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if not select.select([self.fd], [], [], 0.2)[0]:
                continue
            data = os.read(self.fd, 1 << 16)
            at = 0
            while at < len(data):
                _, mask, _, size = struct.unpack_from("iIII", data, at)
                name = data[at + 16 : at + 16 + size].rstrip(b"\0").decode()
                self.overflowed |= bool(mask & IN_Q_OVERFLOW)
                if mask & IN_OPEN and name:
                    self.counts[name] += 1
                at += 16 + size

    def close(self) -> Counter[str]:
        self._stop.set()
        self._thread.join()
        os.close(self.fd)
        return self.counts


def topology(run: Path) -> dict:
    data = topology_dict(run, backend="slurm", array=TASKS)
    server = data["servers"][0]
    data["servers"] = [dict(server, name="proposer"), dict(server, name="solver")]
    data["clients"][0].update(
        name="pairs",
        agent="ajet_hpc.environments.propose_solve.agent:solve",
        tasks="builtin:propose_solve",
        servers=["proposer", "solver"],
        partition="wide",
        max_tasks=TASKS,  # one task, one episode, per array task
        mem="250M",
    )
    return data


def test_32_tasks_over_16_nodes_commit_each_episode_once_and_never_poll(tmp_path: Path) -> None:
    run = tmp_path / "run"
    topology_file = write_topology(tmp_path, topology(run))
    written = run_module("ajet_hpc.launch", str(topology_file), "--no-submit")
    assert written.returncode == 0, written.stderr + written.stdout
    opens = Opens(run / "servers")  # before any job starts: every read of a rendezvous is seen
    jobs: dict[str, str] = {}
    started = time.monotonic()
    try:
        done = run_module("ajet_hpc.launch", str(topology_file))
        assert done.returncode == 0, done.stderr + done.stdout
        jobs = {entry["name"]: entry["job_id"] for entry in json.loads((run / "jobs.json").read_text())}
        array = jobs["clients-pairs"]

        def tasks_done() -> list | None:
            states = [s for s in slurmcli.job_states([array]) if "_" in s.job_id]
            return states if len(states) == TASKS and all(s.state == "COMPLETED" for s in states) else None

        finished = wait_until(tasks_done, 900, f"the {TASKS} array tasks to complete", poll_s=2)
        nodes = {state.nodes for state in finished}
        print(f"{TASKS} tasks on {len(nodes)} nodes in {time.monotonic() - started:.0f} s")
    finally:
        subprocess.run(["scancel", *jobs.values()], check=False, capture_output=True)
    counts = opens.close()

    assert len(nodes) == NODES, sorted(nodes)
    results = [r for i in range(TASKS) for r in read_results(run / "data" / "clients" / "pairs" / f"{i}.h5")]
    assert sorted(Counter((r.task_id, r.repeat) for r in results).values()) == [1] * TASKS  # exactly once
    for model in ("proposer", "solver"):
        reader = EpisodeReader(run / "data" / f"{model}.h5")
        try:
            states = {s["episode_id"]: s["state"] for s in reader.summaries()}
        finally:
            reader.close()
        assert all(states[r.episode_ids[model]] == "finished" for r in results), model

    for model in ("proposer", "solver"):  # torch computes with the job's 1 CPU, not the host's cores
        (log,) = (run / "logs" / f"server-{model}").glob("*_log.out")
        assert "(torch.float32, 1 thread(s))" in log.read_text()

    assert not opens.overflowed
    for model in ("proposer", "solver"):  # one read as each task starts; polling would be many per task
        assert 0 < counts[f"{model}.json"] <= 2 * TASKS, counts
