"""Client runtimes, the parts that build nothing: cache keys, where runtimes go, and how each backend (and the
hand-written sbatch lines) starts a group's jobs with its runtime's python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import topology_dict

from ajet_hpc.config import ConfigError, load_topology
from ajet_hpc.launch import runtimes
from ajet_hpc.launch.backends.local import LocalBackend
from ajet_hpc.launch.backends.slurm import SlurmBackend
from ajet_hpc.launch.cli import hand_commands
from ajet_hpc.launch.plan import HetJobSpec, JobSpec, build_plan
from ajet_hpc.storage.rundir import RunDir


def setup_envs(tmp_path: Path, files: dict[str, str]) -> Path:
    envs = tmp_path / "envs"
    envs.mkdir()
    for name, text in files.items():
        (envs / name).write_text(text)
    return envs


def groups_topology(tmp_path: Path, envs: Path, env_by_group: dict[str, str | None], **cluster):
    data = topology_dict(tmp_path / "run", **cluster)
    template = data["clients"][0]
    data["clients"] = [{**template, "name": g, "env": env} for g, env in env_by_group.items()]
    return load_topology(data, envs_dir=envs)


def test_key_follows_content_kind_and_interpreter() -> None:
    key = runtimes.runtime_key(b"numpy==2.0\n", "venv")
    assert key == runtimes.runtime_key(b"numpy==2.0\n", "venv", runtimes.interpreter_identity())
    assert len(key) == 64
    others = {
        runtimes.runtime_key(b"numpy==2.1\n", "venv"),
        runtimes.runtime_key(b"numpy==2.0\n", "conda"),
        runtimes.runtime_key(b"numpy==2.0\n", "venv", "cpython-3.12.1-x86_64 /opt/other-venv"),
    }
    assert key not in others and len(others) == 3
    assert sys.prefix in runtimes.interpreter_identity()


def test_kinds_by_suffix() -> None:
    assert runtimes.env_kind("agent.txt") == "venv"
    assert runtimes.env_kind("agent.yml") == runtimes.env_kind("agent.YAML") == "conda"
    assert runtimes.env_kind("agent.toml") is None


def test_runtimes_live_in_the_run_keyed_by_content_and_groups_share_one(tmp_path: Path) -> None:
    envs = setup_envs(tmp_path, {"a.txt": "pkg==1\n", "b.txt": "pkg==2\n", "a-copy.txt": "pkg==1\n"})
    topology = groups_topology(tmp_path, envs, {"x": "a.txt", "y": "b.txt", "z": "a.txt", "w": None})
    run = RunDir.for_topology(topology)
    planned = runtimes.plan_runtimes(topology, run, envs)
    assert set(planned) == {"x", "y", "z"}  # w runs in the launcher's environment
    key = runtimes.runtime_key(b"pkg==1\n", "venv")
    assert planned["x"].path == run.root / "envs" / f"a-{key[:12]}"
    assert planned["x"] is planned["z"] and planned["x"].groups == ("x", "z")
    assert planned["y"].path != planned["x"].path
    assert not planned["x"].complete
    assert runtimes.describe(planned) == [
        f"client runtime (venv) for client groups 'x', 'z' (env {envs / 'a.txt'}): {planned['x'].path} "
        "(would be built)",
        f"client runtime (venv) for client group 'y' (env {envs / 'b.txt'}): {planned['y'].path} "
        "(would be built)",
    ]


def test_shared_cache_relative_to_the_launch_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    envs = setup_envs(tmp_path, {"a.txt": "pkg==1\n"})
    monkeypatch.chdir(tmp_path)
    topology = groups_topology(tmp_path, envs, {"x": "a.txt"}, env_cache="cache/envs")
    (runtime,) = runtimes.plan_runtimes(topology, RunDir.for_topology(topology), envs).values()
    assert runtime.path.parent == tmp_path / "cache" / "envs"


def test_unknown_kind_and_missing_file_name_the_field(tmp_path: Path) -> None:
    envs = setup_envs(tmp_path, {"a.toml": "x\n", "a.txt": "pkg\n"})
    topology = groups_topology(tmp_path, envs, {"x": "a.txt", "y": "a.toml"})
    run = RunDir.for_topology(topology)
    with pytest.raises(ConfigError, match=r"clients\[1\]\.env: cannot build 'a.toml'.*\*\.txt"):
        runtimes.plan_runtimes(topology, run, envs)
    elsewhere = tmp_path / "elsewhere"  # relaunched from a directory without the env file
    topology = groups_topology(tmp_path, envs, {"x": "a.txt"})
    with pytest.raises(ConfigError, match=r"clients\[0\]\.env: cannot read environment file .*elsewhere"):
        runtimes.plan_runtimes(topology, run, elsewhere)


def test_conda_file_without_conda_names_the_group_and_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    envs = setup_envs(tmp_path, {"agent.yml": "dependencies: [python=3.11]\n"})
    topology = groups_topology(tmp_path, envs, {"tools": "agent.yml"})
    planned = runtimes.plan_runtimes(topology, RunDir.for_topology(topology), envs)
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # a login node where conda is not loaded
    with pytest.raises(runtimes.RuntimeBuildError) as err:
        runtimes.ensure_all(planned, progress=lambda line: None)
    assert "client group 'tools'" in str(err.value)
    assert str(envs / "agent.yml") in str(err.value)
    assert "`conda` or `mamba`" in str(err.value)
    assert not planned["tools"].complete and not planned["tools"].path.exists()


def test_every_backend_starts_a_group_with_its_runtime_python(tmp_path: Path) -> None:
    envs = setup_envs(tmp_path, {"a.txt": "pkg==1\n"})
    topology = groups_topology(tmp_path, envs, {"math": "a.txt", "plain": None})
    run = RunDir.for_topology(topology)
    pythons = runtimes.pythons(runtimes.plan_runtimes(topology, run, envs))
    python = pythons["math"]
    plan = build_plan(topology, pythons=pythons)
    jobs = {job.name: job for job in plan if isinstance(job, JobSpec)}
    assert jobs["clients-math"].python == python
    assert jobs["server-policy"].python is None and jobs["clients-plain"].python is None

    slurm = SlurmBackend(python="/launcher/python")
    assert f"{python} -u -m submitit.core._submit" in slurm.render(
        jobs["clients-math"], run, topology.cluster
    )
    assert "/launcher/python -u" in slurm.render(jobs["server-policy"], run, topology.cluster)
    assert "/launcher/python -u" in slurm.render(jobs["clients-plain"], run, topology.cluster)
    local = LocalBackend(python="/launcher/python").render(jobs["clients-math"], run, topology.cluster)
    assert local.splitlines()[1].startswith(f"{python} -u -m ajet_hpc.client")

    (het,) = [
        job for job in build_plan(topology, hetjob=True, pythons=pythons) if isinstance(job, HetJobSpec)
    ]
    script = slurm.render(het, run, topology.cluster)
    assert any(
        line.startswith("srun --het-group=1") and f" {python} -u -m ajet_hpc.client" in line
        for line in script.splitlines()
    )

    lines = hand_commands(topology, run, pythons)
    assert lines[1].startswith(f"sbatch --export=ALL,AJET_PYTHON={python} ") and " -p cpu " in lines[1]
    assert "--export" not in lines[2]  # no runtime: the script finds .venv itself


def _child(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_asking_for_pip_leaves_setuptools_importable_in_the_launcher() -> None:
    """The launcher asks whether it has pip before it builds a runtime, then may import vLLM (the LoRA
    check), which imports setuptools through torch. Asked through ``importlib.util.find_spec``, setuptools'
    distutils shim (Python < 3.12) switched the process to the standard library's distutils and that
    import failed: a CI run lost five vLLM tests and the LoRA check that way, after the runtime tests ran in
    the same worker. The first child shows the hazard; the second, our way of asking."""
    hazard = _child('import importlib.util; importlib.util.find_spec("pip"); import setuptools')
    if sys.version_info < (3, 12):
        assert hazard.returncode != 0 and "_distutils" in hazard.stderr, hazard.stderr[-2000:]
    ours = _child(
        "from ajet_hpc.launch.runtimes import launcher_has_pip\n"
        "assert launcher_has_pip()\n"
        "import setuptools, distutils.core\n"
        "assert '_distutils' in distutils.core.__file__, distutils.core.__file__\n"
        "print('ok')"
    )
    assert ours.returncode == 0 and ours.stdout.strip() == "ok", ours.stderr[-2000:]
