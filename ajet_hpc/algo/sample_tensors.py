"""Training samples and how they become tensors: one :class:`Sample` per sequence, micro-batches, padding.

A sample is one training sequence: one model call, several calls merged into their longest one, or a
prefix tree of calls packed depth-first (``parents`` set; see ``ajet_hpc.algo.tree_packing``). Every per-token
field has one entry per token id; advantages and old log-probabilities are 0.0 where the loss mask is 0,
so padding and prompt tokens never enter the loss.

Per-token fields are lists or numpy arrays: the trainer's build hands out arrays (`as_arrays`), which the
batch file and the step record take without converting a Python number per token; samples compare equal
when their values are (a list and an array alike).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ajet_hpc.algo.sequences import batch_sequence_ids

_PER_TOKEN_FIELDS = ("loss_mask", "old_logprobs", "advantages")
_OPTIONAL_PER_TOKEN_FIELDS = ("weights", "parents")
ARRAY_TYPES = {
    "token_ids": np.int64,
    "loss_mask": np.int8,
    "old_logprobs": np.float64,
    "advantages": np.float64,
    "weights": np.float64,
    "parents": np.int64,
}
"""The dtype of each per-token field held as an array (exact: the ids and floats as Python holds them)."""

Ints = list[int] | np.ndarray
Floats = list[float] | np.ndarray


@dataclass(eq=False)
class Sample:
    """One training sequence: its token ids, which of them are trained, and with what advantage."""

    token_ids: Ints
    loss_mask: Ints  # 1 on trainable tokens (the model's own sampled tokens), else 0
    old_logprobs: Floats  # per token: the engine's logprob on trainable tokens, 0.0 elsewhere
    advantages: Floats  # per token: 0.0 where loss_mask is 0
    policy_version: int  # the policy version that sampled the trainable tokens
    episode_id: str
    task_id: str
    weight: float = 1.0  # loss weight of every token of the sample, unless `weights` is set
    weights: Floats | None = None  # per-token loss weights (merged calls of unequal weights)
    parents: Ints | None = None  # tree samples: position of each token's predecessor, -1 for none
    calls: list[int] = field(default_factory=list)  # the episode's call indices whose tokens train here

    def __post_init__(self) -> None:
        if len(self.token_ids) == 0:
            raise ValueError("Sample.token_ids is empty: a sample needs at least one token")
        n = len(self.token_ids)
        for name in _PER_TOKEN_FIELDS + _OPTIONAL_PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"Sample.{name} has {len(value)} entries but token_ids has {n}: give one entry per token"
                )
        if not is_binary(self.loss_mask):
            raise ValueError("Sample.loss_mask must hold only 0 and 1")
        if self.parents is not None:
            if any(not -1 <= parent < i for i, parent in enumerate(self.parents)):
                raise ValueError("Sample.parents must point to an earlier position (or be -1)")
            if any(m and parent < 0 for m, parent in zip(self.loss_mask, self.parents, strict=True)):
                raise ValueError("Sample.loss_mask is 1 on a first token (parent -1), which has no context")

    def __len__(self) -> int:
        return len(self.token_ids)

    def __eq__(self, other: object) -> bool:
        """The same values in every field (a per-token field as a list or an array alike)."""
        if not isinstance(other, Sample):
            return NotImplemented
        return all(_values(getattr(self, f.name)) == _values(getattr(other, f.name)) for f in fields(self))


def _values(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value


def as_list(values: Sequence | np.ndarray) -> list:
    """A per-token field as a list (the very list when it is one)."""
    if isinstance(values, list):
        return values
    return values.tolist() if isinstance(values, np.ndarray) else list(values)


def as_arrays(sample: Sample) -> Sample:
    """``sample`` with every per-token field a numpy array of its `ARRAY_TYPES` dtype (in place; an array of
    that dtype is kept as it is, or copied when it is a view of a larger array, which it would keep alive).
    The trainer's build ends with it: the batch file and the step record then cast arrays instead of
    converting a Python number per token, once each."""
    for name, kind in ARRAY_TYPES.items():
        value = getattr(sample, name)
        if value is None:
            continue
        if not (isinstance(value, np.ndarray) and value.dtype == kind):
            setattr(sample, name, _array(value, kind))
        elif isinstance(value.base, np.ndarray):  # a call sample's view of its task group's zeros
            setattr(sample, name, value.copy())
    return sample


def _array(values: Any, kind: Any) -> np.ndarray:
    """``np.asarray(values, kind)``; a list of ints written by ``struct.pack_into`` (a third of numpy's time,
    half of ``array.array``'s: a step converts a few million merged token ids), where it reads them as numpy
    does (it refuses floats and values out of range: numpy's call then)."""
    if kind is np.int64 and type(values) is list:
        out = np.empty(len(values), np.int64)
        with contextlib.suppress(struct.error, TypeError, OverflowError):
            struct.pack_into(f"={len(values)}q", out.data, 0, *values)
            return out
    return np.asarray(values, kind)


def trained_count(mask: Sequence[int] | np.ndarray) -> int:
    """How many positions a 0/1 loss mask trains."""
    return int(np.count_nonzero(mask)) if isinstance(mask, np.ndarray) else sum(mask)


def is_binary(mask: Sequence | np.ndarray) -> bool:
    """Whether every entry of ``mask`` equals 0 or 1, i.e. ``mask.count(0) + mask.count(1) == len(mask)``,
    without that count's cost: ``list.count(1)`` compares each 0 by value (18 ns a token here, where a call's
    prompt is thousands of 0s), so a mask of 0s then 1s is recognised by one count and one slice
    comparison, and any other by its bytes (``bytearray`` takes ints 0-255 only; else the counts). An
    array is compared whole."""
    if isinstance(mask, np.ndarray):
        if mask.size == 0:
            return True
        if mask.dtype.itemsize == 1 and mask.dtype.kind in "biu":  # bytes: -1..-128 read as 255..128
            return bool(mask.view(np.uint8).max() <= 1)
        if mask.dtype.kind in "biu":  # integers: their least and greatest
            return bool(mask.min() >= 0 and mask.max() <= 1)
        return bool(((mask == 0) | (mask == 1)).all())
    mask = mask if isinstance(mask, (list, tuple)) else list(mask)
    n = len(mask)
    zeros = mask.count(0)  # fast over 0s: one shared object, compared by identity
    if mask[zeros:] == [1] * (n - zeros):  # the other entries all equal 1 (the 0s are the first `zeros`)
        return True
    try:
        small = bytearray(mask)
    except (TypeError, ValueError):  # floats, or ints outside 0-255: compare by value
        return mask.count(0) + mask.count(1) == n
    return small.count(0) + small.count(1) == n


def binary_runs(mask: Sequence[int] | np.ndarray) -> list[tuple[int, int]] | None:
    """The runs of 1s of a 0/1 mask (`mask_runs`), None when it holds anything else (`is_binary`): a call's
    mask (0s, then its answer's 1s) by one count and one comparison."""
    if isinstance(mask, list):
        n, zeros = len(mask), mask.count(0)
        if mask[zeros:] == [1] * (n - zeros):
            return [(zeros, n)] if zeros < n else []
    return mask_runs(mask) if is_binary(mask) else None


def mask_runs(mask: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, end)`` runs of a 0/1 loss mask's 1s, found in C (a Python step per run, not per token):
    a call's mask (0s, then its answer's 1s) by one count and one comparison, any other by searching its
    bytes (``list.index`` would compare every entry by value); an array by where it steps."""
    if isinstance(mask, np.ndarray) and mask.dtype.itemsize == 1 and mask.dtype.kind in "biu":
        mask = mask.view(np.uint8).tobytes()  # searched as bytes (below), as a list's are
    if isinstance(mask, np.ndarray):
        ones = (mask == 1).nonzero()[0]
        if ones.size == 0:
            return []
        if ones[-1] - ones[0] + 1 == ones.size:  # one run (a call's answer)
            return [(int(ones[0]), int(ones[-1]) + 1)]
        breaks = np.flatnonzero(np.diff(ones) > 1)  # a run ends after each
        starts = [int(ones[0]), *(ones[breaks + 1]).tolist()]
        ends = [*(ones[breaks] + 1).tolist(), int(ones[-1]) + 1]
        return list(zip(starts, ends, strict=True))
    search: Sequence
    if isinstance(mask, bytes):
        return _byte_runs(mask)
    mask = mask if isinstance(mask, (list, tuple)) else list(mask)
    n = len(mask)
    zeros = mask.count(0)  # fast over 0s (one shared object): a call's prompt
    if mask[zeros:] == [1] * (n - zeros):  # all 1s after as many positions as there are 0s: one run
        return [(zeros, n)] if zeros < n else []
    try:
        return _byte_runs(bytearray(mask))  # exact for 0/1 ints (and bools)
    except (TypeError, ValueError):
        search = mask  # floats 0.0 / 1.0: by value
    runs: list[tuple[int, int]] = []
    end = 0
    while end < n:
        try:
            start = search.index(1, end)
        except ValueError:
            break
        try:
            end = search.index(0, start)
        except ValueError:
            end = n
        runs.append((start, end))
    return runs


def _byte_runs(mask: bytes | bytearray) -> list[tuple[int, int]]:
    """`mask_runs` of a mask held as bytes (``find`` runs in C and, unlike ``index``, raises nothing)."""
    runs: list[tuple[int, int]] = []
    end, n = 0, len(mask)
    while end < n:
        start = mask.find(1, end)
        if start < 0:
            break
        end = mask.find(0, start)
        end = n if end < 0 else end
        runs.append((start, end))
    return runs


def pack_micro_batches(samples: list[Sample], token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size fits ``token_budget``.

    The padded size of a micro-batch is ``longest sample * number of samples`` (what :func:`collate`
    allocates). Each micro-batch fits the budget, except that a single sample longer than the budget gets a
    micro-batch of its own.

    Order: samples are taken longest first (a stable sort, so equal lengths keep their input order) and
    filled greedily, which keeps padding small and puts the largest activations in the first micro-batch,
    where an out-of-memory error shows at once. Within a micro-batch indices are ascending. The order does not
    change the step's gradient: the loss of each micro-batch is divided by the step's global token count
    (see :func:`ajet_hpc.algo.grpo.policy_loss`). The result is deterministic for a given input.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = len(samples[i])
        if current and max(longest, n) * (len(current) + 1) > token_budget:
            batches.append(sorted(current))
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(sorted(current))
    return batches


def collate(samples: list[Sample], pad_id: int, *, dense_tree_mask: bool = True) -> dict[str, Tensor]:
    """Right-pad ``samples`` to the longest one and stack them; tensors are ``[B, T]`` unless noted.

    Keys: ``input_ids`` (long, ``pad_id`` on padding), ``attention_mask`` (long, 1 on real tokens),
    ``loss_mask`` (long), ``old_logprobs``, ``advantages`` and ``weights`` (float32, each token's loss
    weight), ``sequence_ids`` (long: each trained token's sequence, numbered across the rows, -1 elsewhere;
    ``ajet_hpc.algo.sequences``). Every padding position is 0 except ``input_ids`` and ``sequence_ids``.

    When a sample is a tree (``parents`` set), keys change or appear: ``attention_mask`` becomes a
    boolean ``[B, 1, T, T]`` mask (query i sees key j iff j is i or an ancestor of i; a padding position
    sees itself only), ``position_ids`` holds each token's depth in its own sequence, ``parents`` (long)
    the position whose logits predict each token (-1: none), and ``tree_ends`` (long) the same mask in
    linear form: query i sees key j iff ``j <= i < tree_ends[b, j]`` (the depth-first layout puts every
    subtree in one run of positions). Plain samples in the same batch get the causal equivalents, so one
    forward serves both. With ``dense_tree_mask=False`` the quadratic mask is not built: ``attention_mask``
    stays ``[B, T]`` and ``tree_ends`` carries the tree (for :func:`tree_block_mask`).
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    b, t = len(samples), max(len(s) for s in samples)
    out = {
        "input_ids": torch.full((b, t), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, t), dtype=torch.long),
        "loss_mask": torch.zeros((b, t), dtype=torch.long),
        "old_logprobs": torch.zeros((b, t), dtype=torch.float32),
        "advantages": torch.zeros((b, t), dtype=torch.float32),
        "weights": torch.zeros((b, t), dtype=torch.float32),
    }
    for row, s in enumerate(samples):
        n = len(s)
        out["input_ids"][row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        out["attention_mask"][row, :n] = 1
        out["loss_mask"][row, :n] = torch.tensor(s.loss_mask, dtype=torch.long)
        out["old_logprobs"][row, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        out["advantages"][row, :n] = torch.tensor(s.advantages, dtype=torch.float32)
        out["weights"][row, :n] = torch.tensor(s.weights) if s.weights is not None else s.weight
    out["sequence_ids"] = batch_sequence_ids([s.loss_mask for s in samples], [s.parents for s in samples], t)
    if any(s.parents is not None for s in samples):
        out.update(_tree_inputs(samples, t))
        if dense_tree_mask:
            out["attention_mask"] = dense_tree_mask_of(out["tree_ends"])
    return out


def dense_tree_mask_of(tree_ends: Tensor) -> Tensor:
    """The boolean ``[B, 1, T, T]`` mask of ``tree_ends``: query i sees key j iff ``j <= i < ends[j]``."""
    arange = torch.arange(tree_ends.shape[1], device=tree_ends.device)
    keys, queries = arange[None, None, :], arange[None, :, None]
    return ((keys <= queries) & (queries < tree_ends[:, None, :])).unsqueeze(1)


def _tree_inputs(samples: list[Sample], t: int) -> dict[str, Tensor]:
    """Parents, depths and subtree ends of each row, in one pass over the tokens (a padding position is
    its own subtree; padding depths continue after the row's deepest token)."""
    b = len(samples)
    parents = torch.full((b, t), -1, dtype=torch.long)
    depth = torch.zeros((b, t), dtype=torch.long)
    ends = torch.arange(1, t + 1).repeat(b, 1)  # padding: itself only
    for row, s in enumerate(samples):
        n = len(s)
        own = list(range(-1, n - 1)) if s.parents is None else s.parents
        parents[row, :n] = torch.tensor(own, dtype=torch.long)
        # depth first layout: j is an ancestor of i iff j <= i < end[j], end[j] = j + size of j's subtree
        size = [1] * n
        level = [0] * n
        for i in range(n - 1, -1, -1):
            if own[i] >= 0:
                size[own[i]] += size[i]
        for i in range(n):
            level[i] = level[own[i]] + 1 if own[i] >= 0 else 0
        ends[row, :n] = torch.arange(n) + torch.tensor(size)
        depth[row, :n] = torch.tensor(level)
        if n < t:
            depth[row, n:] = torch.arange(t - n) + (max(level) + 1)
    return {"position_ids": depth, "parents": parents, "tree_ends": ends}


def tree_attention(on_gpu: bool, wanted: str = "flex") -> str | None:
    """The attention kernel to load a model with for tree-packed batches: ``"flex_attention"`` when asked
    (``merge.tree_attention: flex``), on GPUs, when the installed transformers supports it (its block mask
    does not grow quadratically, see :func:`tree_block_mask`), else ``None``, the model's default (SDPA) with
    the dense ``[B, 1, T, T]`` mask. On the CPU the dense mask is the fallback: FlexAttention has no backward
    there."""
    if not on_gpu or wanted != "flex":
        return None
    from transformers.utils import is_torch_flex_attn_available

    return "flex_attention" if is_torch_flex_attn_available() else None


def tree_block_mask(tree_ends: Tensor, block_size: int = 128):
    """The tree mask of ``tree_ends`` as a FlexAttention ``BlockMask``, built without a ``[T, T]`` tensor.

    ``torch.nn.attention.flex_attention`` skips the ``block_size`` x ``block_size`` tiles where no query sees
    a key and evaluates the mask only in the partial ones; storage is ``O(T + (T / block_size)^2)`` per row
    where the dense mask is ``O(T^2)``. A tile (query block q, key block k) is non-empty iff ``k <= q`` and
    some key of k has its subtree reaching q's first query (``max ends > q0``); full iff ``k < q`` and every
    key's subtree covers q's last query (``min ends > q1``): the tables come from per-block min/max of
    ``tree_ends``, never from the mask itself.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, t = tree_ends.shape
    device = tree_ends.device
    blocks = -(-t // block_size)
    padded = blocks * block_size
    ends = torch.arange(1, padded + 1, device=device).repeat(b, 1)  # past T: itself only
    ends[:, :t] = tree_ends
    per_block = ends.view(b, blocks, block_size)
    high, low = per_block.amax(-1), per_block.amin(-1)  # [B, kv blocks]
    index = torch.arange(blocks, device=device)
    first_q = index * block_size
    last_q = torch.clamp(first_q + block_size, max=t) - 1
    q_blocks, kv_blocks = index[:, None], index[None, :]
    any_ = (kv_blocks <= q_blocks) & (high[:, None, :] > first_q[None, :, None])
    full = (kv_blocks < q_blocks) & (low[:, None, :] > last_q[None, :, None])
    partial = any_ & ~full

    def table(selected: Tensor) -> tuple[Tensor, Tensor]:
        counts = selected.sum(-1, dtype=torch.int32)
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[:, None], order[:, None]

    def mask_mod(batch, head, q, kv):
        return (kv <= q) & (q < ends[batch, kv])

    kv_num, kv_index = table(partial)
    full_num, full_index = table(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_index,
        full_num,
        full_index,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(t, t),
    )
