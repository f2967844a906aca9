"""``tools/gpu_check.py``'s tree mask check, run here on the CPU (forward only: FlexAttention has no backward
on the CPU; the GPU run adds the backward). It must pass with the trainer's block mask and fail with a
wrong one, so that a pass on a GPU means something."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ajet_hpc.algo import sample_tensors as samples
from ajet_hpc.trainer.ranks import step

GPU_CHECK = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # unfused on the CPU
def test_flex_tree_check_passes_with_the_block_mask_and_fails_with_a_causal_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check = _gpu_check()
    assert check.flex_tree_check("cpu") <= 1e-5

    def causal(tree_ends, block_size: int = 128):  # every key seen by every later query: no tree
        return samples.tree_block_mask(tree_ends.clone().fill_(tree_ends.shape[-1]), block_size)

    monkeypatch.setattr(step, "tree_block_mask", causal)  # a wrong mask, to show the check sees one
    assert check.flex_tree_check("cpu") > 1e-3


def test_algorithm_bf16_check_runs_every_algorithm_within_its_bound_on_the_cpu() -> None:
    """The GPU check's bf16 pass over every algorithm and correction, here on the CPU's bf16 kernels."""
    check = _gpu_check()
    token, sequence = check.algorithm_bf16_check("cpu")
    assert 0 < token <= check.ALGORITHM_BF16_BOUND
    assert token < sequence < 1  # the product over an answer's tokens multiplies the bf16 error
