"""LoRA's checks before anything is submitted, through the real launcher CLI and the real fit check: a
target module the model lacks, a rank above ``vllm.max_lora_rank``, an architecture vLLM serves no
adapters of; each exits 2 naming the field. And the fit check's LoRA arithmetic on a real Qwen2.5 shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_fit import QWEN_7B, topology, write_model

from ajet_hpc.config import ConfigError, load_topology
from ajet_hpc.config.lora import LoraConfig
from ajet_hpc.engine.adapter import adapter_parameters
from ajet_hpc.launch.cli import main
from ajet_hpc.launch.fit import fit_issues, trainer_bytes_per_rank


def launch(tmp_path: Path, server: dict) -> int:
    config = tmp_path / "topology.json"
    run = {"name": "lora", "dir": str(tmp_path / "run")}
    config.write_text(json.dumps({"run": run, "cluster": {"backend": "local"}, "servers": [server]}))
    return main([str(config), "--dry-run"])


def test_a_target_module_the_model_lacks_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lora = {"target_modules": ["q_proj", "qkv_proj"]}
    server = {"name": "p", "model": "builtin:tiny", "engine": "transformers", "trainer": {"lora": lora}}
    assert launch(tmp_path, server) == 2
    err = capsys.readouterr().err
    assert "servers[0].trainer.lora.target_modules" in err and "'qkv_proj'" in err and "down_proj" in err
    assert not (tmp_path / "run").exists()


def test_a_rank_above_max_lora_rank_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = {
        "name": "p",
        "model": "builtin:tiny",
        "trainer": {"lora": {"rank": 64}},
        "vllm": {"max_lora_rank": 32},
    }
    assert launch(tmp_path, server) == 2
    assert "servers[0].trainer.lora.rank: rank 64 is above servers[0].vllm.max_lora_rank=32" in (
        capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match=r"servers\[0\]\.vllm\.max_lora_rank.*one of 1, 8, 16"):
        load_topology(
            {
                "run": {"name": "r"},
                "servers": [{"name": "p", "model": "builtin:tiny", "vllm": {"max_lora_rank": 12}}],
            }
        )


def test_an_architecture_vllm_serves_no_adapter_of_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPT-2: peft adapts its Conv1D c_attn, vLLM's GPT2LMHeadModel has no LoRA support."""
    model = tmp_path / "gpt2"
    model.mkdir()
    gpt2 = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": 64,
        "n_head": 2,
        "n_layer": 2,
        "vocab_size": 128,
        "n_positions": 128,
    }
    (model / "config.json").write_text(json.dumps(gpt2))
    trainer = {"lora": {"target_modules": ["c_attn"]}}
    assert launch(tmp_path, {"name": "p", "model": str(model), "engine": "vllm", "trainer": trainer}) == 2
    err = capsys.readouterr().err
    assert "servers[0].engine" in err and "GPT2LMHeadModel has no LoRA support" in err
    # the transformers engine (peft) takes it
    assert (
        launch(tmp_path, {"name": "p", "model": str(model), "engine": "transformers", "trainer": trainer})
        == 0
    )


def test_the_fit_check_counts_the_frozen_base_once_and_the_adapter_states(tmp_path: Path) -> None:
    big = write_model(tmp_path / "7b", QWEN_7B)
    adapter = adapter_parameters(big, LoraConfig(rank=16))
    assert 38e6 < adapter < 42e6  # Qwen2.5-7B, rank 16 on all 7 projections: 40.4M
    p = 10**9
    assert trainer_bytes_per_rank(p, 8, 2, True, adapter=10**6) == 2 * p + 2 * 10**6 + 14 * 10**6 / 8
    assert trainer_bytes_per_rank(p, 8, 3, True, adapter=10**6) == 2 * p / 8 + 16 * 10**6 / 8
    # one 80 GiB GPU beside the engine: full fine-tuning of 7B does not fit, its LoRA does
    one_gpu = {"gpus_per_node": 2, "trainer": {"zero_stage": 2}}
    assert [i.path for i in fit_issues(topology(big, **one_gpu))] == ["servers[0].trainer.zero_stage"]
    lora = {"gpus_per_node": 2, "trainer": {"zero_stage": 2, "kl_coef": 0.1, "lora": {"rank": 16}}}
    assert fit_issues(topology(big, **lora)) == []
