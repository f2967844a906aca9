"""Client runtimes built for real (python -m venv, pip, offline from tiny wheels written by the test): the
cache, failed and interrupted builds, two launches at once, shadowing a package of the server's environment,
and the launcher's dry run / build / hand-written sbatch lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fixtures.wheels import PROBE, probe_wheel, requirements, write_wheel
from support import REPO, topology_dict, write_topology

from ajet_hpc.config import load_topology
from ajet_hpc.launch import runtimes
from ajet_hpc.launch.cli import main
from ajet_hpc.storage.client_store import read_results
from ajet_hpc.storage.rundir import RunDir

pytestmark = pytest.mark.slow


def one_runtime(tmp_path: Path, text: str, group: str = "math", name: str = "agent.txt") -> runtimes.Runtime:
    envs = tmp_path / "envs"
    envs.mkdir(exist_ok=True)
    (envs / name).write_text(text)
    data = topology_dict(tmp_path / "run")
    data["clients"][0].update(name=group, env=name)
    topology = load_topology(data, envs_dir=envs)
    return runtimes.plan_runtimes(topology, RunDir.for_topology(topology), envs)[group]


def run_python(python: Path | str, code: str) -> str:
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def version_in(python: Path | str, dist: str) -> str:
    """The installed version of ``dist`` as ``python`` sees it, or ``-``."""
    code = f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\n"
    code += "except m.PackageNotFoundError: print('-')"
    return run_python(python, code)


def test_build_once_then_reuse(tmp_path: Path) -> None:
    probe_wheel(tmp_path / "wheels", "1.0.0")
    runtime = one_runtime(tmp_path, requirements(tmp_path / "wheels", f"{PROBE}==1.0.0"))
    lines: list[str] = []
    python = runtimes.ensure(runtime, lines.append)
    assert python == runtime.python and runtime.complete
    assert any("building a venv" in line for line in lines)
    assert any(f"Successfully installed {PROBE}-1.0.0" in line for line in lines)
    # the agent's package and the runner's own dependencies both import; the runtime's own come first
    code = f"import {PROBE}, ajet_hpc, submitit, openai, h5py, sys; print({PROBE}.__version__, sys.prefix)"
    assert run_python(python, code) == f"1.0.0 {runtime.path}"
    marker = json.loads((runtime.path / runtimes.MARKER).read_text())
    assert marker["key"] == runtime.key

    stamp = (runtime.path / runtimes.MARKER).stat().st_mtime_ns
    again: list[str] = []
    runtimes.ensure(runtime, again.append)
    assert again == [f"client runtime for {runtime.who()}: reusing {runtime.path}"]
    assert (runtime.path / runtimes.MARKER).stat().st_mtime_ns == stamp


def test_failed_build_leaves_nothing_complete_and_names_the_file(tmp_path: Path) -> None:
    probe_wheel(tmp_path / "wheels", "1.0.0")
    runtime = one_runtime(tmp_path, requirements(tmp_path / "wheels", f"{PROBE}==9.9.9"), group="solver")
    with pytest.raises(runtimes.RuntimeBuildError) as err:
        runtimes.ensure(runtime, lambda line: None)
    message = str(err.value)
    assert message.startswith(f"client group 'solver' (env {tmp_path / 'envs' / 'agent.txt'}): building")
    assert "pip install exited with 1" in message
    assert f"No matching distribution found for {PROBE}==9.9.9" in message  # pip's own last lines
    assert str(runtime.log_file) in message and runtime.log_file.is_file()
    assert not runtime.complete and not runtime.path.exists()


def test_interrupted_build_is_not_reused(tmp_path: Path) -> None:
    probe_wheel(tmp_path / "wheels", "1.0.0")
    runtime = one_runtime(tmp_path, requirements(tmp_path / "wheels", f"{PROBE}==1.0.0"))
    (runtime.path / "bin").mkdir(parents=True)  # what a killed build leaves: a folder without the marker
    (runtime.path / "bin" / "python").write_text("not a python\n")
    lines: list[str] = []
    runtimes.ensure(runtime, lines.append)
    assert any("removing the incomplete runtime" in line for line in lines)
    assert version_in(runtime.python, PROBE) == "1.0.0"


def test_two_launches_at_once_build_one_runtime(tmp_path: Path) -> None:
    probe_wheel(tmp_path / "wheels", "1.0.0")
    runtime = one_runtime(tmp_path, requirements(tmp_path / "wheels", f"{PROBE}==1.0.0"))
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from ajet_hpc.launch import runtimes
        runtime = runtimes.Runtime(("math",), Path({str(runtime.env_file)!r}), "venv", {runtime.key!r},
                                   Path({str(runtime.path)!r}))
        runtimes.ensure(runtime)
        """
    )
    launches = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [launch.communicate(timeout=120)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0]
    assert sum("building a venv" in out for out in outputs) == 1
    assert sum("built meanwhile by another launch" in out or "reusing" in out for out in outputs) == 1
    assert version_in(runtime.python, PROBE) == "1.0.0"


def test_a_pin_shadows_the_servers_package_and_leaves_it_alone(tmp_path: Path) -> None:
    base = version_in(sys.executable, "filelock")
    assert base != "-"  # a package of the server's environment (through huggingface_hub)
    write_wheel(tmp_path / "wheels", "filelock", "0.0.1", {"filelock/__init__.py": '__version__ = "0.0.1"\n'})
    runtime = one_runtime(tmp_path, requirements(tmp_path / "wheels", "filelock==0.0.1"))
    runtimes.ensure(runtime, lambda line: None)
    assert run_python(runtime.python, "import filelock; print(filelock.__version__)") == "0.0.1"
    assert version_in(runtime.python, "filelock") == "0.0.1"
    assert version_in(sys.executable, "filelock") == base
    assert run_python(sys.executable, "import filelock; print(filelock.__file__)").startswith(sys.prefix)


def test_launcher_dry_run_builds_nothing_then_no_submit_builds_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    probe_wheel(tmp_path / "wheels", "2.0.0")
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "probe.txt").write_text(requirements(tmp_path / "wheels", f"{PROBE}==2.0.0"))
    data = topology_dict(tmp_path / "run", backend="local")
    data["clients"][0]["env"] = "probe.txt"
    config = write_topology(tmp_path, data)
    monkeypatch.chdir(tmp_path)  # the launcher reads env files from ./envs

    assert main([str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "client runtime (venv) for client group 'math'" in out and "(would be built)" in out
    assert not (tmp_path / "run").exists()

    assert main([str(config), "--no-submit"]) == 0
    out = capsys.readouterr().out
    (runtime,) = (tmp_path / "run" / "envs").glob("probe-*/")
    assert "building a venv" in out and "runtime ready" in out
    (line,) = [line for line in out.splitlines() if "sbatch/clients.sbatch" in line]
    assert (
        line.strip().startswith(f"sbatch --export=ALL,AJET_PYTHON={runtime}/bin/python ")
        and " -p cpu " in line
    )
    assert version_in(runtime / "bin" / "python", PROBE) == "2.0.0"


def test_launcher_reports_a_failed_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "broken.txt").write_text(
        requirements(tmp_path / "no-wheels", "ajet-no-such-dist==1")
    )
    data = topology_dict(tmp_path / "run", backend="local")
    data["clients"][0]["env"] = "broken.txt"
    monkeypatch.chdir(tmp_path)
    assert main([str(write_topology(tmp_path, data)), "--detach"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: client group 'math' (env {tmp_path / 'envs' / 'broken.txt'}): building")
    assert not (tmp_path / "run" / "jobs.json").exists()  # nothing was submitted
    assert not [path for path in (tmp_path / "run" / "envs").iterdir() if path.is_dir()]  # no runtime left


def test_local_run_starts_each_group_in_its_runtime(tmp_path: Path) -> None:
    """The local backend end to end (the Slurm one: tests/cluster/test_client_runtimes.py)."""
    versions = {"one": "1.0.0", "two": "2.0.0"}
    (tmp_path / "envs").mkdir()
    for group, version in versions.items():
        probe_wheel(tmp_path / "wheels", version)
        (tmp_path / "envs" / f"{group}.txt").write_text(
            requirements(tmp_path / "wheels", f"{PROBE}=={version}")
        )
    run = tmp_path / "run"
    data = topology_dict(run, array=1)
    template = dict(data["clients"][0], agent="tests.fixture_agents:probe_version", max_tasks=2)
    data["clients"] = [{**template, "name": group, "env": f"{group}.txt"} for group in versions]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "ajet_hpc.launch", str(write_topology(tmp_path, data))],
        cwd=tmp_path,  # the launcher reads env files from ./envs; the jobs import tests.* through PYTHONPATH
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    assert "clients finished: 2/2" in done.stdout
    for group, version in versions.items():
        (runtime,) = (run / "envs").glob(f"{group}-*/")
        results = read_results(run / "data" / "clients" / group / "0.h5")
        assert len(results) == 2
        assert {(r.metadata["probe_version"], r.metadata["python_prefix"]) for r in results} == {
            (version, str(runtime))
        }
