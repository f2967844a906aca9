"""The run directory: frozen topology, secret, resume and refusal of a changed topology."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from support import topology_dict

from ajet_hpc.config import load_topology
from ajet_hpc.storage.rundir import RunDir, RunDirError


def test_prepare_creates_layout_and_private_secret(tmp_path: Path) -> None:
    run = RunDir.for_topology(load_topology(topology_dict(tmp_path / "run")))
    assert run.prepare(load_topology(topology_dict(tmp_path / "run"))) == "created"
    for folder in ("servers", "logs", "data", "ckpt"):
        assert (run.root / folder).is_dir()
    assert stat.S_IMODE(run.secret_file.stat().st_mode) == 0o600
    assert len(run.read_secret()) == 64


def test_relaunch_resumes_and_keeps_the_secret(tmp_path: Path) -> None:
    topology = load_topology(topology_dict(tmp_path / "run"))
    run = RunDir.for_topology(topology)
    run.prepare(topology)
    secret = run.read_secret()
    assert run.prepare(topology) == "resumed"
    assert run.read_secret() == secret
    assert run.load_topology() == topology


def test_changed_topology_is_refused_without_force(tmp_path: Path) -> None:
    topology = load_topology(topology_dict(tmp_path / "run"))
    run = RunDir.for_topology(topology)
    run.prepare(topology)
    changed = load_topology(topology_dict(tmp_path / "run", array=5))
    with pytest.raises(RunDirError, match=r"(?s)different topology.*-  array: 3.*\+  array: 5.*--force"):
        run.prepare(changed)
    assert run.load_topology() == topology
    assert run.prepare(changed, force=True) == "replaced"
    assert run.load_topology() == changed
    assert len(list(run.root.glob("topology.*.yaml"))) == 1  # the old one is kept


def test_loose_secret_permissions_are_tightened(tmp_path: Path) -> None:
    topology = load_topology(topology_dict(tmp_path / "run"))
    run = RunDir.for_topology(topology)
    run.prepare(topology)
    run.secret_file.chmod(0o644)
    run.prepare(topology)
    assert stat.S_IMODE(run.secret_file.stat().st_mode) == 0o600


def test_at_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="is not a run directory"):
        RunDir.at(tmp_path)
