"""A client runner whose store runs out of space (issue 14, item 1): it runs no episode it cannot record,
stops with a clear error and a non-zero exit, and a restart resumes from the store's last commit, the
episode that failed to commit included (the server had recorded it). Real processes, a real server on the
tiny model, a real full file system (a 2 MiB tmpfs mounted on the group's store folder; unmounted in
``finally``)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, fill_disk, run_module, topology_dict, wait_until, write_topology

from ajet_hpc.client.array_task import EXIT_STORE_FAILED
from ajet_hpc.storage.client_store import read_results
from ajet_hpc.storage.episode_store_reader import EpisodeReader

pytestmark = pytest.mark.slow
TASKS = 30


def _runner(run: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ajet_hpc.client", str(run), "--group", "math", "--index", "0", "--once"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def _start_runner(run: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "ajet_hpc.client", str(run), "--group", "math", "--index", "0", "--once"]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_runner_stops_when_its_store_is_full_and_resumes_after(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = topology_dict(run, array=1)
    data["clients"][0] |= {"max_tasks": TASKS, "in_flight": 1}
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)), "--no-submit")
    assert done.returncode == 0, done.stderr + done.stdout
    folder = run / "data" / "clients" / "math"
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)], check=True)
    log = (tmp_path / "server.log").open("ab")
    server = subprocess.Popen(
        [sys.executable, "-m", "ajet_hpc.server", str(run)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        runner = _start_runner(run)
        journal = folder / "0.h5.journal"
        # tmpfs gives the journal a page at a time: fill the disk when its last page is nearly full
        near_page_end = lambda: journal.exists() and journal.stat().st_size % 4096 > 4096 - 700  # noqa: E731
        wait_until(near_page_end, 240, "the journal's first page to fill up", poll_s=0.02)
        ballast = fill_disk(folder, 0)  # the disk fills up while the runner runs
        out, err = runner.communicate(timeout=300)
        first = subprocess.CompletedProcess(runner.args, runner.returncode, out, err)
        assert first.returncode == EXIT_STORE_FAILED, first.stderr[-4000:]
        assert "its store could not record a result" in first.stderr
        assert "No space left on device" in first.stderr
        committed = len(read_results(folder / "0.h5"))
        assert 0 < committed < TASKS
        with EpisodeReader(run / "data" / "policy.h5") as reader:  # the server saw one episode more: the
            assert len(reader) == committed + 1  # failed commit; none began after it
        ballast.unlink()
        second = _runner(run)
        assert second.returncode == 0, second.stderr[-4000:]
        results = read_results(folder / "0.h5")
        assert len({r.key for r in results}) == len(results) == TASKS
        assert sum(bool(r.metadata.get("recovered")) for r in results) == 1  # recorded by the server
        with EpisodeReader(run / "data" / "policy.h5") as reader:
            assert len(reader) == TASKS  # each episode once
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_runner_whose_store_cannot_even_be_created_stops_with_the_store_exit(tmp_path: Path) -> None:
    """Full before the first episode: the runner names the problem and exits with ``EXIT_STORE_FAILED``
    (requeue-worthy), not a traceback and exit 1. No server is needed: the store opens first."""
    run = tmp_path / "run"
    topology = write_topology(tmp_path, topology_dict(run, array=1))
    done = run_module("ajet_hpc.launch", str(topology), "--no-submit")
    assert done.returncode == 0, done.stderr + done.stdout
    folder = run / "data" / "clients" / "math"
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], check=True)
    try:
        fill_disk(folder, 0)
        first = _runner(run)
        assert first.returncode == EXIT_STORE_FAILED, first.stderr[-4000:]
        assert "its store cannot be opened" in first.stderr and "No space left on device" in first.stderr
        assert "Traceback" not in first.stderr
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)
