"""Isolated client runtimes on the real dev Slurm cluster: two client groups of one run whose env files pin
conflicting versions of the same package (``ajet_dep_probe`` 1.0.0 and 2.0.0, tiny wheels written here) both
run; each group's agent reports the version it imported, and the server's environment is left as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.wheels import PROBE, probe_wheel, requirements
from support import REPO, topology_dict, wait_until, write_topology

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.client_store import read_results

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

ARRAY = 2
GROUPS = {"one": "1.0.0", "two": "2.0.0"}  # client group -> the probe version its env file pins

BASE_ENV = """
import importlib.metadata as m, json
print(json.dumps(sorted(f"{d.metadata['Name']}=={d.version}" for d in m.distributions())))
"""


def base_environment() -> list[str]:
    """Every distribution of the server's environment (the interpreter that runs the launcher and servers)."""
    done = subprocess.run([sys.executable, "-c", BASE_ENV], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def launch_from(folder: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """The launcher run from ``folder`` (its ``envs/`` holds the test's env files); jobs import the test
    agents through PYTHONPATH, which sbatch passes on."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", "ajet_hpc.launch", str(config)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def topology(tmp_path: Path, run: Path) -> Path:
    data = topology_dict(run, backend="slurm", array=ARRAY)
    data["servers"][0]["partition"] = "cpu"  # the test is about the clients: leave g1 to the GPU-minded tests
    template = data["clients"][0]
    template.update(agent="tests.fixture_agents:probe_version", max_tasks=4)
    data["clients"] = [{**template, "name": group, "env": f"probe-{group}.txt"} for group in GROUPS]
    return write_topology(tmp_path, data)


def test_groups_with_conflicting_pins_each_run_in_their_own_runtime(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    envs = tmp_path / "envs"
    envs.mkdir()
    for group, version in GROUPS.items():
        probe_wheel(wheels, version)
        (envs / f"probe-{group}.txt").write_text(requirements(wheels, f"{PROBE}=={version}"))
    before = base_environment()
    assert not any(line.lower().startswith(f"{PROBE}==") for line in before), "probe in the server's env"

    run = tmp_path / "run"
    done = launch_from(tmp_path, topology(tmp_path, run))
    assert done.returncode == 0, done.stderr + done.stdout
    assert done.stdout.count("building a venv") == 2
    jobs = {entry["name"]: entry for entry in json.loads((run / "jobs.json").read_text())}
    arrays = [jobs[f"clients-{group}"]["job_id"] for group in GROUPS]
    try:
        tasks = [task for group in GROUPS for task in jobs[f"clients-{group}"]["tasks"]]
        wait_until(lambda: _all_completed(arrays, tasks), 240, "every array task of both groups to complete")
        for group, version in GROUPS.items():
            (runtime,) = (run / "envs").glob(f"probe-{group}-*/")
            script = next((run / "logs" / f"clients-{group}").glob("*_submission.sh")).read_text()
            assert f"{runtime}/bin/python -u -m submitit.core._submit" in script
            results = [
                r for i in range(ARRAY) for r in read_results(run / "data" / "clients" / group / f"{i}.h5")
            ]
            assert len(results) == 4  # max_tasks, one repeat each
            for result in results:
                assert result.metadata["probe_version"] == version
                assert result.metadata["probe_metadata_version"] == version
                assert result.metadata["python_prefix"] == str(runtime)
    finally:
        subprocess.run(["scancel", *(entry["job_id"] for entry in jobs.values())], check=False)
    assert base_environment() == before  # nothing installed into, or removed from, the server's env


def _all_completed(arrays: list[str], tasks: list[str]) -> bool:
    states = {s.job_id: s.state for s in slurmcli.job_states(arrays)}
    failed = {task: state for task, state in states.items() if state in ("FAILED", "CANCELLED", "TIMEOUT")}
    assert not failed, f"client tasks ended badly: {failed}"
    return all(states.get(task) == "COMPLETED" for task in tasks)
