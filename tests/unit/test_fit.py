"""The launcher's fit check: parameter counts read from config.json alone (real Qwen2.5 shapes written here,
no weights) and the refusals, each naming the field to change, before anything is written or submitted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ajet_hpc.config import load_topology
from ajet_hpc.launch.cli import main
from ajet_hpc.launch.fit import fit_issues, model_size, trainer_bytes_per_rank

QWEN_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
QWEN_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)


def write_model(folder: Path, shape: dict) -> Path:
    folder.mkdir(parents=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "torch_dtype": "bfloat16",
        **shape,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def topology(model: Path, **server):
    data = {
        "run": {"name": "fit"},
        "cluster": {"backend": "local"},
        "servers": [{"name": "policy", "model": str(model), **server}],
    }
    return load_topology(data)


def test_parameter_counts_of_real_shapes(tmp_path: Path) -> None:
    small = model_size(write_model(tmp_path / "0.5b", QWEN_0_5B))
    big = model_size(write_model(tmp_path / "7b", QWEN_7B))
    assert small.architecture == "Qwen2ForCausalLM"
    assert 490e6 < small.parameters < 500e6  # Qwen2.5-0.5B: 494M, the tied head counted once
    assert 7.5e9 < big.parameters < 7.7e9  # Qwen2.5-7B: 7.62B


def test_zero_estimates_shrink_with_stage_and_ranks() -> None:
    p = 10**9
    assert trainer_bytes_per_rank(p, 1, 1, False) == trainer_bytes_per_rank(p, 1, 3, False) == 16 * p
    assert trainer_bytes_per_rank(p, 8, 1, False) == 4 * p + 12 * p / 8
    assert trainer_bytes_per_rank(p, 8, 2, False) == 2 * p + 14 * p / 8
    assert trainer_bytes_per_rank(p, 8, 3, False) == 2 * p
    assert trainer_bytes_per_rank(p, 8, 3, True) == 2 * p + 2 * p / 8


def test_a_small_model_fits_and_a_big_one_is_refused_with_the_fix(tmp_path: Path) -> None:
    small = write_model(tmp_path / "0.5b", QWEN_0_5B)
    assert fit_issues(topology(small, gpus_per_node=2)) == []
    big = write_model(tmp_path / "7b", QWEN_7B)
    # 15.2 GiB of bf16 weights on one 16 GiB GPU at 0.85: the engine does not fit
    issues = fit_issues(topology(big, gpus_per_node=2, gpu_memory_gib=16.0))
    paths = [issue.path for issue in issues]
    assert paths == ["servers[0].engine_gpus", "servers[0].trainer.zero_stage"]
    assert "raise engine_gpus" in issues[0].message and "7.62B parameters" in issues[0].message
    assert "use zero_stage 3" in issues[1].message
    # 8 x 80 GiB, engine over 2 GPUs, ZeRO-3 over the other 6: fits
    assert fit_issues(topology(big, gpus_per_node=8, engine_gpus=2, trainer={"zero_stage": 3})) == []
    # colocated, the trainer's states must fit beside the engine's share
    tight = {"placement": "colocate", "gpus_per_node": 1, "vllm": {"gpu_memory_utilization": 0.9}}
    (issue,) = fit_issues(topology(big, **tight, trainer={"zero_stage": 3}))
    assert (
        "beside the engine's 0.9 share" in issue.message
        and "lower vllm.gpu_memory_utilization" in issue.message
    )
    assert fit_issues(topology(big, gpus_per_node=0)) == []  # CPU servers: nothing to check


def test_the_launcher_refuses_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = write_model(tmp_path / "7b", QWEN_7B)
    config = tmp_path / "topology.json"
    server = {"name": "policy", "model": str(big), "gpu_memory_gib": 16.0}
    config.write_text(json.dumps({"run": {"name": "fit", "dir": str(tmp_path / "run")}, "servers": [server]}))
    assert main([str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "servers[0].engine_gpus" in err and "GiB" in err
    assert not (tmp_path / "run").exists()
