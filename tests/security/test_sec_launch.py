"""The launcher against hostile neighbours and unlucky setups: values written into #SBATCH lines
(issue 14 item 12), a shared runtime cache another user could change (item 11), and duplicate jobs when
Slurm cannot answer (item 3)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import topology_dict

from ajet_hpc.config import ConfigError, load_topology
from ajet_hpc.launch import registry, runtimes
from ajet_hpc.launch.cli import main as launch_main
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.rundir import RunDir


@pytest.mark.parametrize("field", ["account", "qos"])
@pytest.mark.parametrize("value", ["proj\ntouch /tmp/pwned", "proj\r", "a b", "proj;id", "$(id)", "'x'"])
def test_account_and_qos_that_would_split_an_sbatch_line_are_refused(
    tmp_path: Path, field: str, value: str
) -> None:
    setting: dict[str, Any] = {field: value}  # the cluster's account or qos
    data = topology_dict(tmp_path / "run", backend="slurm", **setting)
    with pytest.raises(ConfigError) as caught:
        load_topology(data)
    assert f"cluster.{field}" in str(caught.value)


@pytest.mark.parametrize("value", ["proj-1", "ml_team.gpu", "high", "p+q@site"])
def test_ordinary_account_and_qos_names_pass(tmp_path: Path, value: str) -> None:
    topology = load_topology(topology_dict(tmp_path / "run", backend="slurm", account=value, qos=value))
    assert (topology.cluster.account, topology.cluster.qos) == (value, value)


def cached_runtime(tmp_path: Path) -> runtimes.Runtime:
    """A complete runtime in a shared cache folder, as an earlier launch left it."""
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "agent.txt").write_text("pkg==1\n")
    data = topology_dict(tmp_path / "run", env_cache=str(tmp_path / "cache"))
    data["clients"][0]["env"] = "agent.txt"
    topology = load_topology(data, envs_dir=envs)
    runtime = runtimes.plan_runtimes(topology, RunDir.for_topology(topology), envs)["math"]
    (runtime.path / "bin").mkdir(parents=True, mode=0o755)
    os.symlink(sys.executable, runtime.python)
    (runtime.path / runtimes.MARKER).write_text(json.dumps({"key": runtime.key}))
    for path in (runtime.path, runtime.path / "bin", runtime.path / runtimes.MARKER):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return runtime


def test_a_private_cached_runtime_is_reused(tmp_path: Path) -> None:
    runtime = cached_runtime(tmp_path)
    said: list[str] = []
    assert runtimes.ensure(runtime, progress=said.append) == runtime.python
    assert "reusing" in said[0]


@pytest.mark.parametrize("where", [".", "bin", runtimes.MARKER])
@pytest.mark.parametrize("bits", [stat.S_IWGRP, stat.S_IWOTH])
def test_a_cached_runtime_others_can_write_is_refused(tmp_path: Path, where: str, bits: int) -> None:
    runtime = cached_runtime(tmp_path)
    target = runtime.path / where
    target.chmod(stat.S_IMODE(target.stat().st_mode) | bits)
    with pytest.raises(runtimes.RuntimeBuildError) as caught:
        runtimes.ensure(runtime, progress=lambda _: None)
    message = str(caught.value)
    assert "refusing the cached runtime" in message and "writable by others" in message
    assert str(target.resolve() if where == "." else target) in message


def test_a_cached_runtime_of_another_owner_is_named(tmp_path: Path) -> None:
    runtime = cached_runtime(tmp_path)
    # Owning a file as another user needs root (chown); the check takes the uid to compare with instead.
    other = os.getuid() + 1
    reason = runtimes.untrusted_reason(runtime.path, uid=other)
    assert reason == f"{runtime.path} is owned by uid {os.getuid()}, not by you (uid {other})"
    assert runtimes.untrusted_reason(runtime.path) is None


# ---------------------------------------------------------------------------------------- duplicate jobs
# A real Slurm cannot be made to fail on demand (the dev cluster's controller answers, or the test would
# have to stop it for everyone), so these put small stand-ins for sinfo/squeue/scontrol/sbatch first on
# PATH: sinfo answers, squeue and scontrol answer as told, and sbatch only notes that it was called.
def fake_slurm(folder: Path, scontrol: str) -> Path:
    """Stand-in Slurm tools in ``folder``; ``scontrol``: the body of its shell script. Returns the file
    that sbatch writes when called."""
    folder.mkdir()
    called = folder / "sbatch-called"
    scripts = {
        "sinfo": "#!/bin/sh\nprintf 'cpu\\ngpu*\\n'\n",
        "squeue": "#!/bin/sh\necho 'squeue: error: Unable to contact slurm controller' >&2\nexit 1\n",
        "scontrol": f"#!/bin/sh\n{scontrol}\n",
        "sbatch": f"#!/bin/sh\ntouch {called}\necho 'sbatch: error: fake' >&2\nexit 1\n",
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return called


def launched_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RunDir, dict]:
    """A run launched earlier on Slurm: its directory and its job registry (a server job, a client array)."""
    data = topology_dict(tmp_path / "run", backend="slurm")
    run = RunDir.for_topology(load_topology(data))
    run.prepare(load_topology(data))
    registry.record(
        run,
        [
            registry.SubmittedJob("server-policy", "slurm", "101", ["101"], "logs/server-policy", ["policy"]),
            registry.SubmittedJob(
                "clients-math", "slurm", "102", ["102_0", "102_1", "102_2"], "logs/clients-math", ["math"]
            ),
        ],
    )
    monkeypatch.chdir(tmp_path)
    return run, data


def test_resume_refuses_when_slurm_cannot_say_which_jobs_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    run, _ = launched_run(tmp_path, monkeypatch)
    down = "echo 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2\nexit 1"
    called = fake_slurm(tmp_path / "bin", down)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    jobs_before = run.jobs_file.read_text()
    assert launch_main([str(run.root)]) != 0
    err = capsys.readouterr().err
    assert (
        "cannot tell whether job 101 (server-policy)" in err and "Unable to contact slurm controller" in err
    )
    assert "nothing was submitted" in err
    assert not called.exists() and run.jobs_file.read_text() == jobs_before


def test_a_job_slurm_no_longer_knows_reads_as_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_slurm(tmp_path / "bin", "echo 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert slurmcli.job_states(["101"]) == []


def test_force_refuses_to_replace_a_topology_whose_jobs_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    run, data = launched_run(tmp_path, monkeypatch)
    running = 'echo "JobId=$4 JobState=RUNNING Partition=gpu NodeList=n1 Reason=None"'
    called = fake_slurm(tmp_path / "bin", running)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    data["clients"][0]["array"] = 5  # a changed topology
    frozen = run.topology_file.read_text()
    source = tmp_path / "changed.yaml"
    source.write_text(yaml.safe_dump(data, sort_keys=False))
    assert launch_main([str(source), "--force"]) != 0
    err = capsys.readouterr().err
    assert "--force would replace the topology" in err and "server-policy (job 101)" in err
    assert "python -m ajet_hpc.cancel" in err
    assert not called.exists() and run.topology_file.read_text() == frozen
