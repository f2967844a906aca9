"""The ``reasoning_gym:<dataset>[?k=v...]`` task source: its spec, its refusals, and a runtime without the
library. The training run with the real package is tests/component/test_environments.py."""

from __future__ import annotations

import importlib.util

import pytest

from ajet_hpc.client.task_sources import TaskSourceError, open_source
from ajet_hpc.config import ConfigError, validate_topology
from ajet_hpc.config.fields import parse_reasoning_gym


def test_the_spec_names_a_dataset_and_typed_config_fields() -> None:
    spec = "reasoning_gym:chain_sum?size=200&seed=1&min_terms=2&p=0.5&flag=true&word=abc&x=nan"
    assert parse_reasoning_gym(spec) == (
        "chain_sum",
        {"size": 200, "seed": 1, "min_terms": 2, "p": 0.5, "flag": True, "word": "abc", "x": "nan"},
    )
    assert parse_reasoning_gym("reasoning_gym:gcd") == ("gcd", {})


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("reasoning_gym:Chain-Sum", "dataset name"),
        ("reasoning_gym:", "dataset name"),
        ("reasoning_gym:gcd?size", "key=value"),
        ("reasoning_gym:gcd?size=1&size=2", "key=value"),
        ("reasoning_gym:gcd?Size=1", "key=value"),
    ],
)
def test_bad_specs_are_refused_at_launch_naming_the_field(spec: str, words: str) -> None:
    data = {
        "run": {"name": "r"},
        "servers": [{"name": "policy", "model": "builtin:tiny"}],
        "clients": [
            {"name": "g", "agent": "ajet_hpc.agents.reasoning:solve", "tasks": spec, "servers": ["policy"]}
        ],
    }
    with pytest.raises(ConfigError) as caught:
        validate_topology(data)
    assert "clients[0].tasks" in str(caught.value) and words in str(caught.value)


def test_a_runtime_without_reasoning_gym_is_told_which_env_to_use() -> None:
    spec = "reasoning_gym:gcd?size=3&seed=1"
    if importlib.util.find_spec("reasoning_gym") is None:  # the launcher's environment: not installed
        with pytest.raises(TaskSourceError, match=r"env: reasoning-gym\.txt"):
            open_source(spec)
    else:  # a runtime with it: three tasks of the dataset, in order
        assert [t.id for t in open_source(spec)] == ["gcd-1-0", "gcd-1-1", "gcd-1-2"]
