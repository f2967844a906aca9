"""The output layer only where the loss needs it: log-probabilities (and entropies) of the trained tokens.

A causal LM turns every position's hidden state into ``V`` logits; at a real vocabulary (Qwen2.5: 151,643
tokens) that ``[B, T, V]`` float32 tensor and its ``log_softmax`` dwarf the rest of a small model's step,
and most of it is wasted: only the model's own tokens (loss mask 1) enter the loss, the KL and the entropy
metric. Here the model runs to its last hidden states, the positions that predict a trained token are
gathered (``t - 1``, or the token's tree parent in packed samples), and the output layer runs on those
rows only, in chunks of ``chunk_tokens`` rows. Each chunk is checkpointed: its logits are freed after the
forward and recomputed in the backward, so the peak is one chunk's ``[chunk, V]`` tensors, not all of them.

The values are today's (:func:`ajet_hpc.algo.grpo.token_logprobs` on the full logits, float32 log-softmax)
to float32 rounding: each row's softmax is independent of the other rows. ``docs/grpo.md`` has the figures.

The output layer is called as a module (``get_output_embeddings()``), never through its weight, so
DeepSpeed ZeRO-3 gathers it in its hooks, and a head tied to the input embedding works unchanged. A model
whose forward does more than ``head(last hidden state)`` (logit soft-capping or scaling, no
``logits_to_keep``) is detected and served from its full logits instead (:func:`model_logprobs`).

Fused kernels: Liger Kernel's fused linear + cross-entropy computes the gradient inside the forward for a
fixed loss (cross-entropy, or its own GRPO loss), which is not ours (clip-higher, the step-wide normaliser,
per-token weights), so it is not used; the chunked path is what runs on CPUs and GPUs alike.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

_HEAD_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def predicted_positions(loss_mask: Tensor, parents: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Trained tokens and the positions whose outputs predict them: ``(rows, cols, sources)``, ``[N]`` each.

    Token ``(rows[k], cols[k])`` has loss mask 1 and is predicted by the output at ``(rows[k], sources[k])``:
    ``cols - 1`` in a plain sample, ``parents[b, t]`` in a tree-packed one. A trained token without a
    predecessor (position 0, parent -1) is left out: its log-probability is 0, as in ``token_logprobs``.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must have shape [B, T], got {tuple(loss_mask.shape)}")
    if parents is None:
        sources = torch.arange(-1, loss_mask.shape[1] - 1, device=loss_mask.device).expand_as(loss_mask)
    elif parents.shape != loss_mask.shape:
        raise ValueError(f"parents {tuple(parents.shape)} != loss_mask {tuple(loss_mask.shape)}")
    else:
        sources = parents
    rows, cols = ((loss_mask != 0) & (sources >= 0)).nonzero(as_tuple=True)
    return rows, cols, sources[rows, cols]


@dataclass
class _Chunk:
    """What one chunk's first forward leaves behind; the checkpoint's recompute sees ``done`` set."""

    want_entropy: bool
    entropy: Tensor | None = None
    done: bool = False


class _TargetLogProb(torch.autograd.Function):
    """``log_softmax(logits)[target]`` per row in float32, and the row's entropy on the first pass.

    The backward keeps two ``[rows, V]`` tensors alive (the logits and their gradient, ``g * (onehot -
    softmax)``), where autograd's log_softmax + gather keeps about five. The entropy reuses the forward's
    log-softmax, and the checkpoint's recompute (which only needs the saved logits) computes neither."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, chunk: _Chunk) -> Tensor:
        ctx.save_for_backward(logits, targets)
        if chunk.done:
            return logits.new_zeros(targets.shape, dtype=torch.float32)
        chunk.done = True
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if chunk.want_entropy:
            chunk.entropy = -logp.exp().mul_(logp).sum(-1)  # today's formula, to the last bit
        return picked

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, targets = ctx.saved_tensors
        out = torch.softmax(logits.float(), dim=-1).mul_(-grad.unsqueeze(-1))
        out.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1))
        return out.to(logits.dtype), None, None


def _chunk_logprobs(head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, chunk: _Chunk):
    return _TargetLogProb.apply(head(hidden), targets, chunk)


def head_logprobs(
    head: Callable[[Tensor], Tensor],
    hidden: Tensor,
    targets: Tensor,
    *,
    chunk_tokens: int,
    entropy: bool = False,
    min_chunks: int = 0,
    recompute: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(head(hidden))[targets]`` per row (float32 ``[N]``), and the rows' entropies if asked.

    ``hidden``: ``[N, H]``, the hidden states of the predicting positions; ``targets``: ``[N]`` token ids.
    Rows go through ``head`` in equal chunks of at most ``chunk_tokens``; under autograd every chunk but the
    last is checkpointed, so its ``[chunk, V]`` logits are recomputed in the backward instead of kept. The
    last chunk keeps its logits: its backward runs first, before any recompute, so keeping it does not raise
    the peak (one chunk's logits and their gradient) and saves one recompute per call. Entropies (nats)
    are detached: they are a metric.

    ``min_chunks``: call ``head`` at least that many times, padding with one-row chunks that add 0 (under
    ZeRO-3 every head call gathers the head's weight in a collective, so a rank without trained tokens must
    still make the call the others make). ``recompute=False`` keeps every chunk's logits (no checkpoint).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden must be [N, H] and targets [N], got {tuple(hidden.shape)}, {tuple(targets.shape)}"
        )
    grad = torch.is_grad_enabled() and hidden.requires_grad
    rows = hidden.shape[0]
    real = -(-rows // chunk_tokens)
    count = max(real, min_chunks)
    size = -(-rows // real) if rows else 0  # equal chunks of at most chunk_tokens rows
    picked: list[Tensor] = []
    entropies: list[Tensor] = []
    padding: list[Tensor] = []
    for i in range(count):
        if i < real:
            h, t = hidden[i * size : (i + 1) * size], targets[i * size : (i + 1) * size]
        else:  # a padding chunk: one zero row, through the head and back, contributing 0
            h, t = hidden.new_zeros(1, hidden.shape[1]), targets.new_zeros(1)
        chunk = _Chunk(want_entropy=entropy and i < real)
        if grad and recompute and i < count - 1:
            out = checkpoint(_chunk_logprobs, head, h, t, chunk, use_reentrant=False)
        else:
            out = _chunk_logprobs(head, h, t, chunk)
        (picked if i < real else padding).append(out)
        if i < real and chunk.entropy is not None:  # set by the forward when wanted
            entropies.append(chunk.entropy)
    logp = torch.cat(picked) if picked else hidden.new_zeros(0, dtype=torch.float32)
    if grad and not picked:
        logp = logp + hidden.sum() * 0  # still a graph through the forward (engine.backward needs one)
    if padding:
        logp = logp + torch.cat(padding).sum() * 0
    if not entropy:
        return logp, None
    return logp, torch.cat(entropies) if entropies else logp.new_zeros(0).detach()


def scatter_positions(values: Tensor, rows: Tensor, cols: Tensor, shape: torch.Size) -> Tensor:
    """A float32 ``shape`` tensor of zeros with ``values`` at ``(rows, cols)`` (differentiable)."""
    return torch.zeros(shape, dtype=torch.float32, device=values.device).index_put((rows, cols), values)


def _takes_logits_to_keep(module: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _head_makes_logits(model: Callable[..., Any], module: nn.Module, head: nn.Module, inputs: dict) -> bool:
    """Whether the model's logits are ``head(hidden_states[-1])``: checked once per model, without grad."""
    if module not in _HEAD_CHECKED:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
            hidden, logits = getattr(out, "hidden_states", None), getattr(out, "logits", None)
            again = head(hidden[-1][:, -1:]).float() if hidden and logits is not None else None
        _HEAD_CHECKED[module] = (
            again is not None
            and logits is not None
            and again.shape == logits.shape
            and torch.allclose(again, logits.float(), rtol=1e-4, atol=1e-4)
        )
    return _HEAD_CHECKED[module]


def model_logprobs(
    model: Callable[..., Any],
    inputs: dict[str, Tensor],
    loss_mask: Tensor,
    parents: Tensor | None = None,
    *,
    chunk_tokens: int,
    entropy: bool = False,
    min_chunks: int = 0,
    recompute: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probabilities ``[B, T]`` of the trained tokens (0 elsewhere), and their entropies.

    ``model`` is a Hugging Face causal LM or a DeepSpeed engine around one (called, so that its hooks run);
    ``inputs`` its forward's arguments (``input_ids`` included). The forward keeps one position's logits
    (``logits_to_keep=1``) and returns its hidden states; the output layer then runs on the positions of
    :func:`predicted_positions` only (:func:`head_logprobs`). The first call for a model checks that its
    logits are ``head(last hidden state)``; a model where they are not, or whose forward has no
    ``logits_to_keep``, computes its full logits and the same rows are gathered from them.

    ``min_chunks`` and ``recompute`` as in :func:`head_logprobs`.
    At positions the loss uses, the values equal ``token_logprobs`` / ``entropy_from_logits`` on the full
    logits; elsewhere both are 0.
    """
    module: Any = getattr(model, "module", model)  # a Hugging Face model, inside a DeepSpeed engine or not
    input_ids = inputs["input_ids"]
    rows, cols, sources = predicted_positions(loss_mask, parents)
    targets = input_ids[rows, cols]
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is not None and _takes_logits_to_keep(module) and _head_makes_logits(model, module, head, inputs):
        hidden = model(**inputs, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
        logp, ent = head_logprobs(
            head,
            hidden[rows, sources],
            targets,
            chunk_tokens=chunk_tokens,
            entropy=entropy,
            min_chunks=min_chunks,
            recompute=recompute,
        )
    else:
        logits = model(**inputs).logits[rows, sources]
        logp, ent = head_logprobs(nn.Identity(), logits, targets, chunk_tokens=chunk_tokens, entropy=entropy)
    shape = input_ids.shape
    return scatter_positions(logp, rows, cols, shape), (
        scatter_positions(ent, rows, cols, shape) if ent is not None else None
    )
