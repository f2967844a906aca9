"""Tree packing: samples that share a prefix and then fork become one packed sequence.

The sequence is laid out depth-first over a token trie, with ``parents`` per token; the trainer builds an
attention mask in which each token sees only its ancestors and gives each token the position id of its
depth (``samples.collate``). Every token keeps the context it had in its own sample, so logits, logprobs,
loss and gradients equal those of training the samples separately (up to float rounding). Linear merging,
which runs first, is :mod:`ajet_hpc.algo.merge`; see ``docs/merging.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ajet_hpc.algo.merge import common_prefix, token_weights
from ajet_hpc.algo.sample_tensors import Sample, as_list, mask_runs


def pack_tree(samples: Sequence[Sample]) -> Sample:
    """Pack plain samples into one tree sample: shared prefixes once, each branch seeing only its ancestors.

    Tokens are laid out depth-first over a token trie; ``parents[i]`` is the position of token i's
    predecessor in its own sequence (-1 for a first token). A trie node is shared by every sequence that
    reaches it with the same token, except that a node is trainable for at most one sequence: a second
    sequence that trains the same token there gets a branch of its own (so the loss terms stay those of
    the separate samples). ``episode_id`` / ``task_id`` are the first sample's when all agree, else the
    distinct ones joined with ``+``. When everything forms one chain the result is a plain sample
    (``parents`` None).
    """
    if not samples:
        raise ValueError("pack_tree needs at least one sample")
    for sample in samples:
        if sample.parents is not None:
            raise ValueError("pack_tree takes plain samples, not tree-packed ones")
    trie = _Trie()
    for sample in samples:
        trie.insert(sample)
    layout = trie.layout()
    size = len(layout)
    position = np.empty(size, dtype=np.int64)
    position[layout] = np.arange(size)
    parent = np.asarray(trie.parent, dtype=np.int64)[layout]
    parents_arr = np.where(parent < 0, -1, position[np.maximum(parent, 0)])
    trained = np.asarray(trie.trained, dtype=bool)[layout]
    weights_arr = np.where(trained, np.asarray(trie.weight, dtype=np.float64)[layout], 0.0)
    kept = weights_arr[trained]
    uniform = kept.size == 0 or bool((kept == kept[0]).all())
    calls = sorted({c for s in samples for c in s.calls})
    episodes = list(dict.fromkeys(s.episode_id for s in samples))
    tasks = list(dict.fromkeys(s.task_id for s in samples))
    chain = bool((parents_arr == np.arange(-1, size - 1)).all())  # one chain: a plain sample (faster)
    return Sample(
        token_ids=np.asarray(trie.token, dtype=np.int64)[layout].tolist(),
        loss_mask=trained.astype(np.int64).tolist(),
        old_logprobs=np.where(trained, np.asarray(trie.logprob, dtype=np.float64)[layout], 0.0).tolist(),
        advantages=np.where(trained, np.asarray(trie.advantage, dtype=np.float64)[layout], 0.0).tolist(),
        policy_version=min(s.policy_version for s in samples),
        episode_id="+".join(episodes),
        task_id="+".join(tasks),
        weight=float(kept[0]) if kept.size and uniform else 1.0,
        weights=None if uniform else weights_arr.tolist(),
        parents=None if chain else parents_arr.tolist(),
        calls=calls,
    )


class _Trie:
    """The token trie of `pack_tree`, stored as chains: the nodes a sample creates past the shared prefix
    are consecutive ids (a block), each the first child of the one before. A walk follows a block with one
    slice comparison instead of a step per token, and steps token by token only where sequences part or a
    trained node is taken; the layout emits whole blocks. Per node: ``token``, ``parent``, ``trained``,
    and the trained values (meaningful only where trained)."""

    def __init__(self) -> None:
        self.token: list[int] = []
        self.parent: list[int] = []
        self.trained: list[int] = []
        self.logprob: list[float] = []
        self.advantage: list[float] = []
        self.weight: list[float] = []
        self.block_start: list[int] = []
        self.block_end: list[int] = []
        self.branches: dict[tuple[int, int], list[int]] = {}  # children that start a block, by token
        self.extra: dict[int, list[int]] = {}  # node -> its block-starting children, in insertion order
        self.forks: dict[int, set[int]] = {}  # block start -> its nodes that have block-starting children

    def insert(self, sample: Sample) -> None:
        ids = list(as_list(sample.token_ids))
        mask = list(as_list(sample.loss_mask))
        runs = mask_runs(mask)
        weights = token_weights(sample)
        n, node, p = len(ids), -1, 0
        while p < n:
            if node >= 0:  # follow node's block as far as the tokens agree and no trained node is taken
                length = min(n - p, self.block_end[node] - node - 1)
                if length > 0:
                    m = common_prefix(ids[p : p + length], self.token[node + 1 : node + 1 + length])
                    m = self._free(runs, p, m, node + 1 - p)
                    if m > 0:
                        self._train(sample, weights, runs, p, p + m, node + 1 - p)
                        node, p = node + m, p + m
                        continue
            tok, trains = ids[p], mask[p]
            chosen = None
            succ = node + 1
            chain = node >= 0 and succ < self.block_end[node] and self.token[succ] == tok
            if chain and not (trains and self.trained[succ]):  # the first child of node: created with it
                chosen = succ
            if chosen is None:
                for candidate in self.branches.get((node, tok), ()):
                    if not (trains and self.trained[candidate]):
                        chosen = candidate
                        break
            if chosen is None:
                self._block(sample, ids, mask, weights, p, node)
                return
            if trains:
                self._train(sample, weights, [(p, p + 1)], p, p + 1, chosen - p)
            node, p = chosen, p + 1

    def _free(self, runs: list[tuple[int, int]], p: int, m: int, offset: int) -> int:
        """How many of the m positions from p can be walked: up to the first trained position whose node
        (position + offset) is trained already."""
        for a, b in runs:
            a, b = max(a, p), min(b, p + m)
            if a < b:
                nodes = self.trained[a + offset : b + offset]
                if any(nodes):
                    return a + [bool(t) for t in nodes].index(True) - p
        return m

    def _train(self, sample: Sample, weights: list[float], runs, start: int, end: int, offset: int) -> None:
        for a, b in runs:
            a, b = max(a, start), min(b, end)
            if a < b:
                self.trained[a + offset : b + offset] = [1] * (b - a)
                self.logprob[a + offset : b + offset] = as_list(sample.old_logprobs[a:b])
                self.advantage[a + offset : b + offset] = as_list(sample.advantages[a:b])
                self.weight[a + offset : b + offset] = weights[a:b]

    def _block(self, sample: Sample, ids: list[int], mask: list[int], weights, p: int, node: int) -> None:
        """New nodes for ids[p:], the first a child of ``node``."""
        base, count = len(self.token), len(ids) - p
        self.branches.setdefault((node, ids[p]), []).append(base)
        self.extra.setdefault(node, []).append(base)
        if node >= 0:
            self.forks.setdefault(self.block_start[node], set()).add(node)
        self.token.extend(ids[p:])
        self.parent.append(node)
        self.parent.extend(range(base, base + count - 1))
        self.trained.extend(mask[p:])
        self.logprob.extend(as_list(sample.old_logprobs[p:]))
        self.advantage.extend(as_list(sample.advantages[p:]))
        self.weight.extend(weights[p:])
        self.block_start.extend([base] * count)
        self.block_end.extend([base + count] * count)

    def layout(self) -> np.ndarray:
        """Node ids depth first, children in insertion order: a block's chain, then the subtrees hanging
        off its nodes, the deepest node's first (they come after its first child's whole subtree)."""
        pieces: list[np.ndarray] = []
        stack = list(reversed(self.extra.get(-1, [])))
        while stack:
            start = stack.pop()
            pieces.append(np.arange(start, self.block_end[start]))
            later: list[int] = []
            for v in sorted(self.forks.get(start, ()), reverse=True):
                later.extend(self.extra[v])
            stack.extend(reversed(later))
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
