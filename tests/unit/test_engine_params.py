"""The engines' shared rules, without an engine: sampling parameters, prompt room, stop strings,
sampling maths, settings and model specs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from ajet_hpc.engine.base import EngineError, PromptTooLong, SamplingParams, check_prompt, fit_max_tokens
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.transformers_engine import TransformersSettings, completes_stop_string, job_cpus, sample
from ajet_hpc.engine.vllm_engine import VllmSettings


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", "1"),
        ("stop", ("",)),
        ("stop", (3,)),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", ("a",)),
    ],
)
def test_sampling_params_refuse_bad_values_naming_the_field(field: str, value: object) -> None:
    args = {"max_tokens": 8, field: value}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**args)  # type: ignore[arg-type]  # the bad value under test


def test_sampling_params_freeze_lists_and_know_greedy() -> None:
    # lists on purpose (as JSON gives them): frozen into tuples
    params = SamplingParams(max_tokens=4, stop=["a", "bc"], stop_token_ids=[5])  # type: ignore[arg-type]
    assert params.stop == ("a", "bc") and params.stop_token_ids == (5,)
    hash(params)
    assert SamplingParams(max_tokens=1, temperature=0).greedy
    assert not SamplingParams(max_tokens=1).greedy


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "expected"),
    [(10, 5, 5), (10, 100, 22), (31, 100, 1), (1, 1, 1)],
)
def test_max_tokens_is_clamped_to_the_room_left(prompt_len: int, max_tokens: int, expected: int) -> None:
    assert fit_max_tokens(prompt_len, max_tokens, max_model_len=32) == expected


@pytest.mark.parametrize("prompt_len", [32, 40])
def test_no_room_for_one_token_is_prompt_too_long(prompt_len: int) -> None:
    with pytest.raises(PromptTooLong, match=r"at most 31 tokens"):
        fit_max_tokens(prompt_len, 1, max_model_len=32)
    assert issubclass(PromptTooLong, EngineError)


def test_prompt_must_be_in_vocabulary_and_not_empty() -> None:
    assert check_prompt([0, 5, 9], vocab_size=10, max_tokens=4, max_model_len=32) == 4
    with pytest.raises(EngineError, match=r"out of the vocabulary \[0, 10\): \[10, -1\]"):
        check_prompt([1, 10, -1], vocab_size=10, max_tokens=4, max_model_len=32)
    with pytest.raises(EngineError, match="empty"):
        check_prompt([], vocab_size=10, max_tokens=4, max_model_len=32)
    for odd in (True, 2.0, "3", None):  # in range by value, but not token ids
        with pytest.raises(EngineError, match=r"out of the vocabulary"):
            check_prompt([1, odd, 2], vocab_size=10, max_tokens=4, max_model_len=32)  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("text", "new_chars", "hit"),
    [
        ("abc</s>", 1, True),  # the last token completed the stop string
        ("abc</s>", 3, True),
        ("abc</s>x", 1, False),  # it ended before the new text
        ("ab</", 2, False),
        ("</s>", 4, True),
        ("abc", 0, False),
    ],
)
def test_stop_string_must_end_in_the_new_text(text: str, new_chars: int, hit: bool) -> None:
    assert completes_stop_string(text, new_chars, ("</s>", "zz")) is hit


def test_sampling_reports_raw_logprobs_whatever_the_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    raw = torch.log_softmax(logits, dim=-1)
    generator = torch.Generator().manual_seed(0)
    token, logprob = sample(logits, SamplingParams(max_tokens=1, temperature=0), generator)
    assert (token, logprob) == (0, pytest.approx(float(raw[0])))
    for temperature in (0.3, 1.0, 2.5):
        for _ in range(20):
            token, logprob = sample(logits, SamplingParams(max_tokens=1, temperature=temperature), generator)
            assert logprob == pytest.approx(float(raw[token]))


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(max_tokens=1, top_p=0.75), generator)[0] for _ in range(300)}
    assert draws == {0, 1}
    draws = {sample(logits, SamplingParams(max_tokens=1, top_p=0.1), generator)[0] for _ in range(50)}
    assert draws == {0}


def test_a_seed_makes_sampling_reproducible() -> None:
    logits = torch.zeros(50)
    params = SamplingParams(max_tokens=1, seed=4)

    def draws() -> list[int]:
        generator = torch.Generator().manual_seed(4)
        return [sample(logits, params, generator)[0] for _ in range(10)]

    assert draws() == draws() and len(set(draws())) > 1


@pytest.mark.parametrize("settings", [VllmSettings, TransformersSettings])
def test_engine_settings_refuse_bad_values(settings: type) -> None:
    with pytest.raises(ValueError, match="dtype"):
        settings(dtype="float64")
    with pytest.raises(ValueError, match="max_model_len"):
        settings(max_model_len=1)
    if settings is VllmSettings:
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            settings(gpu_memory_utilization=1.5)


def test_model_spec_resolves_local_folders_and_refuses_the_rest(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(EngineError, match=re.escape(f"{folder} has no config.json")):
        resolve_model(str(folder), tmp_path / "cache")
    with pytest.raises(EngineError, match=r"is not a folder.*never downloaded"):
        resolve_model("Qwen/Qwen2.5-0.5B", tmp_path / "cache")
    with pytest.raises(EngineError, match="unknown built-in model 'builtin:huge'"):
        resolve_model("builtin:huge", tmp_path / "cache")
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder), tmp_path / "cache") == folder.resolve()


def test_the_transformers_engine_takes_the_jobs_cpus_not_the_nodes_cores() -> None:
    """Slurm's grant caps the cores the process may run on (a cluster without core binding runs a 1-CPU
    job on a node of many cores); a grant that cannot be read leaves the cores."""
    cores = len(os.sched_getaffinity(0))
    assert job_cpus({"SLURM_CPUS_PER_TASK": "1"}) == 1
    assert job_cpus({"SLURM_CPUS_PER_TASK": str(cores + 7)}) == cores
    assert job_cpus({}) == job_cpus({"SLURM_CPUS_PER_TASK": "two"}) == job_cpus({"SLURM_CPUS_PER_TASK": "0"})
    assert job_cpus({}) == cores
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        TransformersSettings(cpu_threads=0)
