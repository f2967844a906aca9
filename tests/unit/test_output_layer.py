"""The output layer only at trained positions, in chunks: the same log-probabilities, entropies and gradients
as today's full computation (``token_logprobs`` / ``entropy_from_logits`` over every position's logits),
on the built-in tiny models (untied Llama, tied Qwen2 with the real 151,936-row vocabulary), plain and
tree-packed, and the output layer never sees more rows than the trained tokens, a chunk at a time."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from ajet_hpc.algo.grpo import entropy_from_logits, token_logprobs
from ajet_hpc.algo.output_layer import head_logprobs, model_logprobs, predicted_positions
from ajet_hpc.algo.sample_tensors import Sample, collate
from ajet_hpc.engine import tiny, tiny_qwen
from ajet_hpc.trainer.ranks.step import model_inputs

TOL = 1e-5


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    return tiny.build_model(110, seed=1).float()


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen.build_model(seed=2).float()


def full_reference(model, inputs: dict, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's computation: every position's logits, float32 log-softmax over the whole vocabulary."""
    logits = model(**inputs).logits
    parents = batch.get("parents")
    return token_logprobs(logits, batch["input_ids"], parents), entropy_from_logits(logits.detach(), parents)


def random_tree(n: int, rng: random.Random) -> list[int]:
    """Parents of a random prefix tree laid out depth first (each token's parent is on the current path)."""
    parents, path = [-1], [0]
    for i in range(1, n):
        if rng.random() < 0.15 and len(path) > 1:
            del path[rng.randrange(1, len(path)) :]
        parents.append(path[-1])
        path.append(i)
    return parents


def random_samples(vocab: int, seed: int, trees: bool) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for i in range(4):
        n = rng.randrange(5, 60)
        parents = random_tree(n, rng) if trees and i % 2 == 0 else None
        first_trainable = 1 if parents is not None else 0  # a plain sample's token 0 may be masked in (lp 0)
        mask = [int(j >= first_trainable and rng.random() < 0.4) for j in range(n)]
        samples.append(
            Sample(
                token_ids=[rng.randrange(vocab) for _ in range(n)],
                loss_mask=mask,
                old_logprobs=[0.0] * n,
                advantages=[0.0] * n,
                policy_version=0,
                episode_id=f"e{i}",
                task_id="t",
                parents=parents,
            )
        )
    return samples


def check_against_full(model, samples: list[Sample], chunk_tokens: int) -> None:
    batch = collate(samples, pad_id=0)
    inputs = model_inputs(batch, model.config._attn_implementation)
    mask = batch["loss_mask"] != 0
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    params = [p for p in model.parameters() if p.requires_grad]

    old_lp, old_ent = full_reference(model, inputs, batch)
    old_grads = torch.autograd.grad(torch.where(mask, old_lp * weights, 0.0).sum(), params)
    new_lp, new_ent = model_logprobs(
        model, inputs, batch["loss_mask"], batch.get("parents"), chunk_tokens=chunk_tokens, entropy=True
    )
    new_grads = torch.autograd.grad(torch.where(mask, new_lp * weights, 0.0).sum(), params)

    assert new_ent is not None  # asked for
    assert mask.any()
    assert (new_lp[mask] - old_lp[mask]).abs().max() < TOL
    assert (new_ent[mask] - old_ent[mask]).abs().max() < TOL
    assert not new_lp[~mask].any() and not new_ent[~mask].any()  # nothing computed off the loss mask
    assert not new_ent.requires_grad
    for old, new in zip(old_grads, new_grads, strict=True):  # sums in another order: relative to the largest
        assert (old - new).abs().max() < TOL * max(1.0, old.abs().max().item())


@pytest.mark.parametrize("trees", [False, True], ids=["plain", "tree"])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
def test_llama_matches_the_full_output_layer(llama, trees: bool, chunk_tokens: int) -> None:
    for seed in range(3):
        check_against_full(llama, random_samples(llama.config.vocab_size, seed, trees), chunk_tokens)


@pytest.mark.parametrize("trees", [False, True], ids=["plain", "tree"])
def test_tied_qwen_at_the_real_vocabulary_matches_the_full_output_layer(qwen, trees: bool) -> None:
    assert qwen.get_output_embeddings().weight is qwen.get_input_embeddings().weight
    check_against_full(qwen, random_samples(qwen.config.vocab_size, 10, trees), chunk_tokens=16)


def test_the_output_layer_runs_on_trained_positions_only_one_chunk_at_a_time(llama) -> None:
    samples = random_samples(llama.config.vocab_size, 5, trees=True)
    batch = collate(samples, pad_id=0)
    rows_seen: list[int] = []
    hook = llama.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows_seen.append(args[0].shape[:-1].numel())
    )
    try:
        model_logprobs(llama, model_inputs(batch), batch["loss_mask"], batch["parents"], chunk_tokens=5)
        trained = len(predicted_positions(batch["loss_mask"], batch["parents"])[0])
        chunks = -(-trained // 5)
        size = -(-trained // chunks)  # equal chunks of at most 5 rows
        # the model's own forward keeps one position per row; then the trained tokens, chunk by chunk
        assert rows_seen[-chunks - 1] == batch["input_ids"].shape[0]
        assert rows_seen[-chunks:] == [size] * (chunks - 1) + [trained - size * (chunks - 1)]
        assert max(rows_seen[-chunks:]) <= 5 and trained > 10
    finally:
        hook.remove()


def test_predicted_positions_follow_the_previous_token_or_the_tree_parent() -> None:
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 1, 1]])
    rows, cols, sources = predicted_positions(mask)
    assert (
        rows.tolist() == [0, 0, 1, 1] and cols.tolist() == [1, 3, 2, 3] and sources.tolist() == [0, 2, 1, 2]
    )
    parents = torch.tensor([[-1, 0, 1, 0], [-1, 0, 0, 2]])
    rows, cols, sources = predicted_positions(mask, parents)
    assert cols.tolist() == [1, 3, 2, 3] and sources.tolist() == [0, 0, 0, 2]


class ScaledLlama(LlamaForCausalLM):
    """A model whose logits are not ``lm_head(hidden)`` (like Gemma's soft-capping, Cohere's logit scale)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 30 * torch.tanh(out.logits / 3)
        return out


def test_a_model_with_its_own_logit_transform_is_served_from_its_full_logits(llama) -> None:
    model = ScaledLlama(llama.config)
    model.load_state_dict(llama.state_dict())
    for trees in (False, True):
        check_against_full(model, random_samples(llama.config.vocab_size, 7, trees), chunk_tokens=3)


def test_a_batch_without_trained_tokens_still_has_a_graph(llama) -> None:
    samples = random_samples(llama.config.vocab_size, 1, trees=False)
    batch = collate(samples, pad_id=0)
    none = torch.zeros_like(batch["loss_mask"])
    logprobs, entropy = model_logprobs(llama, model_inputs(batch), none, chunk_tokens=8, entropy=True)
    assert entropy is not None  # asked for
    assert not logprobs.any() and not entropy.any() and logprobs.requires_grad
    logprobs.sum().backward()  # what engine.backward needs: a loss connected to the forward
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_logprobs(
            torch.nn.Identity(), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_tokens=0
        )


def test_padding_chunks_call_the_head_without_changing_values_or_gradients(llama) -> None:
    """Under ZeRO-3 every rank makes as many head calls as the busiest: padding chunks add exactly 0."""
    head = llama.get_output_embeddings()
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, llama.config.hidden_size, generator=generator, requires_grad=True)
    targets = torch.randint(0, llama.config.vocab_size, (9,), generator=generator)
    calls: list[int] = []
    hook = head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        results = []
        for min_chunks in (0, 6):
            calls.clear()
            logp, entropy = head_logprobs(
                head, hidden, targets, chunk_tokens=4, entropy=True, min_chunks=min_chunks
            )
            forward_calls = list(calls)
            grads = torch.autograd.grad((logp * torch.arange(9.0)).sum(), [hidden, head.weight])
            results.append((logp.detach(), entropy, grads, forward_calls, list(calls)))
        (lp0, ent0, g0, fwd0, all0), (lp6, ent6, g6, fwd6, all6) = results
        assert ent0 is not None and ent6 is not None and entropy is not None  # asked for
        assert fwd0 == [3, 3, 3] and fwd6 == [3, 3, 3, 1, 1, 1]
        # the backward recomputes every chunk but the last, latest first
        assert all0[len(fwd0) :] == [3, 3] and all6[len(fwd6) :] == [1, 1, 3, 3, 3]
        assert torch.equal(lp0, lp6) and torch.equal(ent0, ent6) and entropy.shape == (9,)
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(g0, g6, strict=True))
        # a rank without a trained token still calls the head as often as the others
        calls.clear()
        empty, _ = head_logprobs(head, hidden[:0], targets[:0], chunk_tokens=4, min_chunks=2)
        empty.sum().backward()
        assert empty.shape == (0,) and calls == [1, 1, 1]
    finally:
        hook.remove()
