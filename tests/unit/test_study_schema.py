"""The study file: errors that name the field (exit 2, nothing written or submitted), and the space a
study explores (grid expansion, seeds, the overrides of a trial)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from support import REPO

from ajet_hpc.config import ConfigError
from ajet_hpc.study.cli import main
from ajet_hpc.study.schema import SEED_PARAM, expand, load_study

BASE = str(REPO / "configs" / "quickstart.yaml")


def study_file(tmp_path: Path, **changes) -> Path:
    data = {
        "name": "s",
        "base": BASE,
        "dir": str(tmp_path / "study"),
        "space": {
            "servers.policy.trainer.lr": [0.001, 0.003],
            "servers.policy.trainer.merge.mode": ["linear"],
        },
        "seeds": [1, 2],
        "max_concurrent": 2,
    }
    data.update(changes)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"space": {"servers.policy.trainer.lrr": [0.1]}}, "space.servers.policy.trainer.lrr", "lrr"),
        ({"space": {"servers.nobody.trainer.lr": [0.1]}}, "space.servers.nobody.trainer.lr", "nobody"),
        ({"space": {"servers.policy.trainer.lr": ["fast"]}}, "space.servers.policy.trainer.lr", "fast"),
        ({"space": {}}, "(root)", "search space is empty"),
        ({"space": {"servers.policy.trainer.lr": []}}, "servers.policy.trainer.lr", "no values"),
        ({"max_concurrent": 0}, "max_concurrent", "greater than or equal to 1"),
        ({"overrides": ["cluster.nope=1"]}, "overrides", "nope"),
        ({"seed_path": "servers.policy.trainer.seeed"}, "seed_path", "seeed"),
        ({"sampler": "tpe"}, "max_trials", "required"),
        ({"space": {"servers.policy.trainer.lr": {"low": 0.01, "high": 0.001}}}, "space", "below high"),
        (
            {"sampler": "grid", "space": {"servers.policy.trainer.lr": {"low": 0.001, "high": 0.01}}},
            "space.servers.policy.trainer.lr",
            "num",
        ),
    ],
)
def test_bad_study_file_exits_2_naming_the_field(tmp_path, capsys, changes, field, words) -> None:
    path = study_file(tmp_path, **changes)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and words in err, err
    assert not (tmp_path / "study").exists()  # nothing written, nothing submitted


def test_grid_expands_ranges_and_seeds(tmp_path) -> None:
    space = {
        "servers.policy.trainer.lr": {"low": 0.001, "high": 0.1, "log": True, "num": 3},
        "servers.policy.trainer.merge.mode": ["linear", "tree"],
        "servers.policy.trainer.ranks": {"low": 1, "high": 2, "integer": True, "num": 2},
    }
    spec, base = load_study(study_file(tmp_path, space=space, seeds=[3, 4, 5]))
    assert spec.is_grid and base == Path(BASE)
    grid = spec.grid_space()
    assert [round(v, 6) for v in grid["servers.policy.trainer.lr"]] == [0.001, 0.01, 0.1]
    assert grid["servers.policy.trainer.ranks"] == [1, 2]
    assert grid[SEED_PARAM] == [3, 4, 5]
    points = expand(spec)
    assert len(points) == spec.grid_size() == spec.trial_budget() == 3 * 2 * 2 * 3
    assert len({tuple(sorted(p.items())) for p in points}) == len(points)
    overrides = spec.trial_overrides(points[0])
    assert overrides[-1] == "servers.policy.trainer.seed=3" or overrides[-1].endswith(".seed=3")
    assert "servers.policy.trainer.merge.mode=linear" in overrides
    assert load_study(study_file(tmp_path, space=space, max_trials=5))[0].trial_budget() == 5


def test_every_trial_override_validates_against_the_base(tmp_path) -> None:
    from ajet_hpc.config import load_topology

    spec, base = load_study(study_file(tmp_path, overrides=["servers.policy.trainer.total_steps=3"]))
    for point in expand(spec):
        topology = load_topology(base, spec.trial_overrides(point))
        trainer = topology.servers[0].trainer
        assert trainer is not None
        assert trainer.total_steps == 3 and trainer.seed == point[SEED_PARAM]
        assert math.isclose(trainer.lr, point["servers.policy.trainer.lr"])


def test_non_grid_space_needs_a_budget(tmp_path) -> None:
    space = {"servers.policy.trainer.lr": {"low": 0.001, "high": 0.01, "log": True}}
    with pytest.raises(ConfigError, match="max_trials"):
        load_study(study_file(tmp_path, space=space))
    spec, _ = load_study(study_file(tmp_path, space=space, max_trials=4))
    assert not spec.is_grid and spec.trial_budget() == 4


def test_without_optuna_the_command_names_the_extra(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "optuna", None)  # import optuna -> ImportError
    assert main([str(study_file(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "ajet_hpc[study]" in err and "Optuna" in err
    assert not (tmp_path / "study").exists()


def test_the_shipped_quickstart_study_validates() -> None:
    spec, base = load_study(REPO / "configs" / "study_quickstart.yaml")
    assert base == (REPO / "configs" / "quickstart.yaml").resolve()
    assert spec.grid_size() == 8 and spec.max_concurrent == 2  # lr × merge mode × 2 seeds
