"""Sequences inside samples: which trained tokens form one answer, for the sequence-level parts of the loss.

A *sequence* is one model answer: a chain of trained tokens, each the successor (``parents``, or the
position before in a plain sample) of the one before. A trained token whose predecessor is not trained
starts a sequence. Merging keeps answers whole (a linear merge lays a call's answer out contiguously; a
tree gives a trained token one sequence: ``ajet_hpc.algo.tree_packing.pack_tree``), so the same answers
are the same sequences before and after merging, and every sequence-level term is unchanged by it.
Answers are apart by the chat template's untrained turn markers; two answers with no untrained token
between them (a call that continues the previous answer verbatim) are one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch
from torch import Tensor


def sequence_ids(
    loss_mask: Seq[int] | np.ndarray, parents: Seq[int] | np.ndarray | None = None
) -> np.ndarray:
    """Per token, the number (``0..k-1``, in order of their first token) of its sequence; -1 if untrained."""
    trained = np.asarray(loss_mask) != 0
    n = trained.size
    parent = np.arange(-1, n - 1) if parents is None else np.asarray(parents, np.int64)
    continues = (parent >= 0) & trained[np.maximum(parent, 0)] & trained
    starts = trained & ~continues
    number = np.cumsum(starts) - 1
    if parents is None:  # a chain: a sequence runs from its start to the next untrained token
        return np.where(trained, number, -1)
    root = np.where(starts | ~trained, np.arange(n), np.maximum(parent, 0))
    while True:  # pointer jumping: every trained token to its sequence's first token
        jumped = np.where(starts[root], root, root[root])
        if np.array_equal(jumped, root):
            break
        root = jumped
    return np.where(trained, number[root], -1)


def sequence_count(loss_mask: Seq[int] | np.ndarray, parents: Seq[int] | np.ndarray | None = None) -> int:
    """How many sequences a sample trains (see the module doc)."""
    ids = sequence_ids(loss_mask, parents)
    return int(ids.max()) + 1 if ids.size and ids.max() >= 0 else 0


def batch_sequence_ids(masks: Seq[Seq[int] | np.ndarray], parents: Seq[object], width: int) -> Tensor:
    """The ``[B, width]`` sequence numbers of a micro-batch's rows, numbered across rows (-1: untrained or
    padding), for :func:`ajet_hpc.algo.sample_tensors.collate`."""
    out = torch.full((len(masks), width), -1, dtype=torch.long)
    offset = 0
    for row, (mask, tree) in enumerate(zip(masks, parents, strict=True)):
        ids = sequence_ids(mask, tree)  # type: ignore[arg-type]
        count = int(ids.max()) + 1 if ids.size and ids.max() >= 0 else 0
        out[row, : ids.size] = torch.from_numpy(np.where(ids >= 0, ids + offset, -1))
        offset += count
    return out


def sequence_lengths(ids: Tensor) -> Tensor:
    """Per token, the number of trained tokens of its sequence (0 where ``ids`` is -1)."""
    trained = ids >= 0
    if not bool(trained.any()):
        return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    flat = ids.clamp(min=0).reshape(-1)
    lengths = torch.zeros(int(ids.max()) + 1, dtype=torch.float32, device=ids.device)
    lengths.index_add_(0, flat, trained.reshape(-1).float())
    return torch.where(trained, lengths[flat].reshape(ids.shape), 0.0)
