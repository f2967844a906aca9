"""Task-source specs (``environments/sources.py``): the ``reasoning_gym:<dataset>[?k=v...]`` spec, its
refusals, and a runtime without the library; a malformed spec of any kind is refused by the launcher before
anything is written or submitted, naming the field. The training run with the real reasoning-gym package is
tests/component/test_environments.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from ajet_hpc.config import ConfigError, validate_topology
from ajet_hpc.environments.reasoning_gym.source import parse_spec
from ajet_hpc.environments.sources import TaskSourceError, open_source, source_issues
from ajet_hpc.launch.cli import main


def test_the_spec_names_a_dataset_and_typed_config_fields() -> None:
    spec = "reasoning_gym:chain_sum?size=200&seed=1&min_terms=2&p=0.5&flag=true&word=abc&x=nan"
    assert parse_spec(spec) == (
        "chain_sum",
        {"size": 200, "seed": 1, "min_terms": 2, "p": 0.5, "flag": True, "word": "abc", "x": "nan"},
    )
    assert parse_spec("reasoning_gym:gcd") == ("gcd", {})


def _topology(spec: str, eval_spec: str | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {
        "name": "g",
        "agent": "ajet_hpc.environments.reasoning_gym.agent:solve",
        "tasks": spec,
        "servers": ["policy"],
    }
    if eval_spec is not None:
        group["eval"] = {"tasks": eval_spec}
    return {
        "run": {"name": "r"},
        "servers": [{"name": "policy", "model": "builtin:tiny"}],
        "clients": [group],
    }


BAD_SPECS = [
    ("reasoning_gym:Chain-Sum", "dataset name"),
    ("reasoning_gym:", "dataset name"),
    ("reasoning_gym:gcd?size", "key=value"),
    ("reasoning_gym:gcd?size=1&size=2", "key=value"),
    ("reasoning_gym:gcd?Size=1", "key=value"),
    ("tasks.json", ".jsonl"),  # was test_config.py's bad_task_source
    ("builtin:no/such", "builtin:<name>"),
    (".jsonl", "invalid task file"),
]


@pytest.mark.parametrize(("spec", "words"), BAD_SPECS)
def test_bad_specs_are_refused_at_launch_naming_the_field(spec: str, words: str) -> None:
    topology = validate_topology(_topology(spec))  # the config layer knows no task-source syntax
    with pytest.raises(ConfigError) as caught:
        raise ConfigError(source_issues(topology))
    assert "clients[0].tasks: " in str(caught.value) and words in str(caught.value)
    assert [issue.path for issue in caught.value.issues] == ["clients[0].tasks"]


def test_a_bad_eval_spec_names_its_own_field() -> None:
    issues = source_issues(validate_topology(_topology("builtin:arithmetic", "reasoning_gym:gcd?size")))
    assert [(issue.path, "key=value" in issue.message) for issue in issues] == [
        ("clients[0].eval.tasks", True)
    ]


def test_good_specs_raise_no_issue() -> None:
    for spec in [
        "builtin:arithmetic",
        "data/tasks.jsonl",
        "/abs/t.jsonl",
        "my_pkg.tasks:load",
        "reasoning_gym:gcd",
    ]:
        assert source_issues(validate_topology(_topology(spec))) == []


@pytest.mark.parametrize(("spec", "words"), BAD_SPECS[:1] + BAD_SPECS[5:6])
def test_the_launcher_exits_2_before_writing_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: str, words: str
) -> None:
    data = _topology(spec)
    data["run"]["dir"] = str(tmp_path / "run")
    data["cluster"] = {"backend": "local"}
    config = tmp_path / "topology.json"
    config.write_text(json.dumps(data))
    assert main([str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "clients[0].tasks" in err and words in err
    assert not (tmp_path / "run").exists()


def test_a_runtime_without_reasoning_gym_is_told_which_env_to_use() -> None:
    spec = "reasoning_gym:gcd?size=3&seed=1"
    if importlib.util.find_spec("reasoning_gym") is None:  # the launcher's environment: not installed
        with pytest.raises(TaskSourceError, match=r"env: reasoning-gym\.txt"):
            open_source(spec)
    else:  # a runtime with it: three tasks of the dataset, in order
        assert [t.id for t in open_source(spec)] == ["gcd-1-0", "gcd-1-1", "gcd-1-2"]


def test_builtin_task_sets_keep_their_names() -> None:
    """``tasks: builtin:<name>`` names are unchanged by the move into environments/."""
    for name in [
        "arithmetic",
        "arithmetic_eval",
        "code",
        "guess",
        "propose_solve",
        "prisoners_dilemma",
        "tools",
    ]:
        assert next(open_source(f"builtin:{name}")).id
    with pytest.raises(TaskSourceError, match="no built-in task source 'nope'"):
        open_source("builtin:nope")
