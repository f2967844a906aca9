"""The tree mask in its three forms: the dense ``[B, 1, T, T]`` mask (today's, SDPA), ``tree_ends`` (linear),
and the FlexAttention ``BlockMask`` built from it without a ``[T, T]`` tensor. FlexAttention runs forward
on the CPU (not backward), so its attention is compared with SDPA's on the dense mask here; the training
path through flex on GPUs is not exercised on this machine."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from ajet_hpc.algo.sample_tensors import (
    Sample,
    collate,
    dense_tree_mask_of,
    tree_attention,
    tree_block_mask,
)
from ajet_hpc.trainer.ranks.step import model_inputs


def random_tree(n: int, rng: random.Random) -> list[int]:
    """Parents of a random prefix tree laid out depth first (each token's parent is on the current path)."""
    parents, path = [-1], [0]
    for i in range(1, n):
        if rng.random() < 0.1 and len(path) > 1:
            del path[rng.randrange(1, len(path)) :]
        parents.append(path[-1])
        path.append(i)
    return parents


def samples(seed: int, lengths: tuple[int, ...]) -> list[Sample]:
    rng = random.Random(seed)
    return [
        Sample(
            token_ids=[rng.randrange(50) for _ in range(n)],
            loss_mask=[0] * n,
            old_logprobs=[0.0] * n,
            advantages=[0.0] * n,
            policy_version=0,
            episode_id=f"e{i}",
            task_id="t",
            parents=random_tree(n, rng) if i % 3 != 1 else None,
        )
        for i, n in enumerate(lengths)
    ]


def reference_mask(batch_samples: list[Sample], t: int) -> torch.Tensor:
    """The ancestor relation walked parent by parent: query i sees key j iff j is i or an ancestor of i."""
    mask = torch.zeros(len(batch_samples), 1, t, t, dtype=torch.bool)
    for row, s in enumerate(batch_samples):
        parents = s.parents if s.parents is not None else list(range(-1, len(s) - 1))
        for i in range(t):
            j = i
            while j >= 0:
                mask[row, 0, i, j] = True
                j = parents[j] if j < len(s) else -1
    return mask


@pytest.mark.parametrize("seed", range(3))
def test_dense_mask_and_tree_ends_are_the_ancestor_relation(seed: int) -> None:
    batch_samples = samples(seed, (37, 80, 5, 64))
    batch = collate(batch_samples, pad_id=0)
    expected = reference_mask(batch_samples, 80)
    assert torch.equal(batch["attention_mask"], expected)
    assert torch.equal(dense_tree_mask_of(batch["tree_ends"]), expected)
    sparse = collate(batch_samples, pad_id=0, dense_tree_mask=False)
    assert sparse["attention_mask"].shape == (4, 80)  # no quadratic tensor
    assert torch.equal(sparse["tree_ends"], batch["tree_ends"])
    # sdpa and eager build the dense mask from tree_ends when the batch has none
    assert torch.equal(model_inputs(sparse)["attention_mask"], expected)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # unfused on the CPU
@pytest.mark.parametrize(("seed", "block"), [(0, 16), (1, 32), (2, 128)])
def test_flex_attention_with_the_block_mask_equals_sdpa_with_the_dense_mask(seed: int, block: int) -> None:
    batch_samples = samples(seed, (300, 170, 257, 40))
    batch = collate(batch_samples, pad_id=0)
    t = batch["input_ids"].shape[1]
    block_mask = tree_block_mask(batch["tree_ends"], block)
    assert block_mask.kv_indices.shape == (4, 1, -(-t // block), -(-t // block))  # tiles, not T x T
    # every tile marked empty is empty, every tile marked full is full: checked against the dense mask
    dense = batch["attention_mask"][:, 0]
    pad = -(-t // block) * block - t
    tiles = (
        torch.nn.functional.pad(dense, (0, pad, 0, pad)).unflatten(1, (-1, block)).unflatten(3, (-1, block))
    )
    any_pair, all_pairs = tiles.any(dim=(2, 4)), tiles.all(dim=(2, 4))
    listed = block_mask.to_dense()[:, 0].bool()  # partial or full tiles
    assert torch.equal(listed, any_pair)
    full = torch.zeros_like(listed)
    for b in range(4):
        for row in range(full.shape[1]):  # query blocks
            count = int(block_mask.full_kv_num_blocks[b, 0, row])
            full[b, row, block_mask.full_kv_indices[b, 0, row, :count].long()] = True
    # (the last query block is partly past T, where the padded tiles hold False: compared for emptiness only)
    assert torch.equal(full[:, :-1], all_pairs[:, :-1])
    assert not (full & ~any_pair).any()

    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(4, 2, t, 16, generator=generator) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=batch["attention_mask"])
    got = flex_attention(q, k, v, block_mask=block_mask)
    assert (got - expected).abs().max() < 1e-5


def test_the_trainer_asks_for_flex_attention_only_on_gpus() -> None:
    assert tree_attention(on_gpu=False) is None
    assert tree_attention(on_gpu=True) == "flex_attention"  # the installed transformers has it
    assert tree_attention(on_gpu=True, wanted="dense") is None  # merge.tree_attention's default
    sparse = collate(samples(0, (20, 9)), pad_id=0, dense_tree_mask=False)
    with pytest.raises(ValueError, match="GPUs only"):
        model_inputs(sparse, "flex_attention")
    with torch.no_grad():
        assert type(model_inputs(sparse, "flex_attention")["attention_mask"]).__name__ == "BlockMask"
