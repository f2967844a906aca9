"""The launcher against hostile neighbours and unlucky setups: values written into #SBATCH lines
(issue 14 item 12), a shared runtime cache another user could change (item 11), and duplicate jobs when
Slurm cannot answer (item 3)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from support import topology_dict

from ajet_hpc.config import ConfigError, load_topology
from ajet_hpc.launch import runtimes
from ajet_hpc.storage.rundir import RunDir


@pytest.mark.parametrize("field", ["account", "qos"])
@pytest.mark.parametrize("value", ["proj\ntouch /tmp/pwned", "proj\r", "a b", "proj;id", "$(id)", "'x'"])
def test_account_and_qos_that_would_split_an_sbatch_line_are_refused(
    tmp_path: Path, field: str, value: str
) -> None:
    data = topology_dict(tmp_path / "run", backend="slurm", **{field: value})
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
