"""Timeline merging: fewer, longer training samples with exactly the same loss.

An agent's multi-turn episode makes one model call per turn, and call k+1's prompt usually holds call k's
prompt and answer verbatim (the server splices the sampled ids back in: token-in, token-out). Training
each call as its own sample computes that shared prefix again and again. Merging computes it once:

- **Linear** (`merge_linear`): a call whose tokens are a prefix of a longer call of the same episode is
  absorbed into it; its answer becomes trainable positions (loss mask 1, its old logprobs and advantages)
  inside the longer sample. Calls that fork (a retry, an edited history, a second agent) stay apart.
  ``level="token"`` compares token ids (exact); ``level="text"`` compares decoded text and also merges
  where the same text was tokenized otherwise, reporting each such place as a `Snap` (``text_trusted``).
- **Tree** (`pack_tree`): samples that share a prefix and then fork become one packed sequence, laid out
  depth-first, with ``parents`` per token; the trainer builds an attention mask in which each token sees
  only its ancestors and gives each token the position id of its depth (``samples.collate``). Every token
  keeps the context it had in its own sample, so logits, logprobs, loss and gradients equal those of
  training the samples separately (up to float rounding).

Neither changes the loss: per-token loss terms, their weights and the step's token normaliser are those of
the unmerged samples. Only the compute changes. See ``docs/merging.md``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ajet_hpc.algo.samples import Sample

TOKEN, TEXT = "token", "text"

# Snap reasons: why a call that the conversation continues did not merge into the later call.
TOKENS_DIFFERED = "tokens_differed"
"""The later call's prompt holds the earlier call's text, tokenized otherwise (token-level merging)."""
TEXT_TRUSTED = "text_trusted"
"""Merged at text level although the tokens differ: the earlier call's tokens replace the later call's
tokens for the same text (a merge, reported)."""
TEXT_DIFFERED = "text_differed"
"""The later call continues the conversation, but its rendered prompt does not start with the earlier
call's prompt and answer."""
TEMPLATE_DROPPED_CONTENT = "template_dropped_content"
"""The chat template rendered the earlier answer without part of it (typically reasoning): see the
``keep_history`` switch in docs/merging.md."""
TOOLS_CHANGED = "tools_changed"
"""The later call offers another tool list, which the template renders before the conversation."""
DUPLICATE = "duplicate"
"""Two calls trained the same positions of one sequence (the same answer sampled twice for the same
prompt); one stays a sample of its own."""


@dataclass(frozen=True)
class Snap:
    """A place where merging did not happen as the conversation suggests, or trusted text over tokens."""

    episode_id: str
    call: int  # index of the earlier call in its episode
    into: int | None  # the later call it continues, when known
    reason: str
    position: int | None = None  # token position where the two sequences part (or text was trusted)


@dataclass
class _Merged:
    """A sample being built: the longest call of a chain and the calls absorbed into it."""

    token_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    weights: list[float]
    policy_version: int
    episode_id: str
    task_id: str
    calls: list[int]
    text: str | None = None
    text_ends: list[int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, sample: Sample) -> _Merged:
        return cls(
            token_ids=list(sample.token_ids),
            loss_mask=list(sample.loss_mask),
            old_logprobs=list(sample.old_logprobs),
            advantages=list(sample.advantages),
            weights=token_weights(sample),
            policy_version=sample.policy_version,
            episode_id=sample.episode_id,
            task_id=sample.task_id,
            calls=list(sample.calls),
        )

    def sample(self) -> Sample:
        uniform = all(w == self.weights[0] for w in self.weights)
        return Sample(
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            old_logprobs=self.old_logprobs,
            advantages=self.advantages,
            policy_version=self.policy_version,
            episode_id=self.episode_id,
            task_id=self.task_id,
            weight=self.weights[0] if uniform else 1.0,
            weights=None if uniform else self.weights,
            calls=sorted(self.calls),
        )


def token_weights(sample: Sample) -> list[float]:
    """The loss weight of each token of ``sample`` (its per-token weights, else its weight everywhere)."""
    return list(sample.weights) if sample.weights is not None else [sample.weight] * len(sample)


def merge_linear(
    samples: Sequence[Sample], *, level: str = TOKEN, decode: Callable[[list[int]], str] | None = None
) -> tuple[list[Sample], list[Snap]]:
    """Absorb every sample that is a prefix of a longer one (same episode) into the longest such sample.

    ``samples`` are the calls of one episode as plain (not tree) samples. Returns the merged samples,
    longest first, and the snaps met (``text_trusted`` merges; ``duplicate`` positions). With
    ``level="text"``, ``decode`` turns token ids into text (e.g. ``tokenizer.decode`` without cleanup).
    """
    if level not in (TOKEN, TEXT):
        raise ValueError(f"merge level must be {TOKEN!r} or {TEXT!r}, got {level!r}")
    if level == TEXT and decode is None:
        raise ValueError("text-level merging needs decode (token ids -> text)")
    for sample in samples:
        if sample.parents is not None:
            raise ValueError("merge_linear takes plain samples, not tree-packed ones")
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), -i))
    merged: list[_Merged] = []
    snaps: list[Snap] = []
    for i in order:
        sample = samples[i]
        for target in merged:
            cut = _prefix_end(sample, target, level, decode)
            if cut is None:
                continue
            snap = _absorb(target, sample, cut)
            if snap is not None:
                snaps.append(snap)
                if snap.reason == DUPLICATE:
                    continue  # try another sample, else it stays apart
            break
        else:
            merged.append(_Merged.of(sample))
    return [m.sample() for m in merged], snaps


def _prefix_end(
    sample: Sample, target: _Merged, level: str, decode: Callable[[list[int]], str] | None
) -> int | None:
    """Where ``sample`` ends inside ``target`` if it is a prefix of it (by tokens, or by text), else None."""
    n = len(sample.token_ids)
    if n <= len(target.token_ids) and target.token_ids[:n] == sample.token_ids:
        return n
    if level != TEXT or decode is None:
        return None
    text = decode(list(sample.token_ids))
    if target.text is None:
        target.text = decode(target.token_ids)
    if not target.text.startswith(text):
        return None
    if target.text_ends is None:  # characters decoded from the first k tokens, k = 1..n
        target.text_ends = [len(decode(target.token_ids[: k + 1])) for k in range(len(target.token_ids))]
    k = bisect.bisect_left(target.text_ends, len(text))
    if k < len(target.text_ends) and target.text_ends[k] == len(text):
        return k + 1
    return None  # the text ends inside a token of the target: no clean cut


def _absorb(target: _Merged, sample: Sample, cut: int) -> Snap | None:
    """Make ``sample``'s trainable tokens trainable in ``target``, whose first ``cut`` tokens hold the same
    text. None when merged exactly; a Snap when text was trusted, or (not merged) on a duplicate."""
    n = len(sample.token_ids)
    exact = cut == n and target.token_ids[:n] == sample.token_ids
    if exact:
        if any(sample.loss_mask[p] and target.loss_mask[p] for p in range(n)):
            return Snap(sample.episode_id, _first(sample.calls), _first(target.calls), DUPLICATE, n)
        for p in range(n):
            if sample.loss_mask[p]:
                target.loss_mask[p] = 1
                target.old_logprobs[p] = sample.old_logprobs[p]
                target.advantages[p] = sample.advantages[p]
                target.weights[p] = token_weights(sample)[p]
        target.calls.extend(sample.calls)
        target.policy_version = min(target.policy_version, sample.policy_version)
        return None
    if any(target.loss_mask[:cut]):  # the replaced tokens would carry loss of another call
        return Snap(sample.episode_id, _first(sample.calls), _first(target.calls), DUPLICATE, n)
    weights, into = token_weights(sample), _first(target.calls)
    target.token_ids = list(sample.token_ids) + target.token_ids[cut:]
    target.loss_mask = list(sample.loss_mask) + target.loss_mask[cut:]
    target.old_logprobs = list(sample.old_logprobs) + target.old_logprobs[cut:]
    target.advantages = list(sample.advantages) + target.advantages[cut:]
    target.weights = weights + target.weights[cut:]
    target.calls.extend(sample.calls)
    target.policy_version = min(target.policy_version, sample.policy_version)
    target.text_ends = None  # the text is the same; its token boundaries changed
    return Snap(sample.episode_id, _first(sample.calls), into, TEXT_TRUSTED, n)


def _first(calls: Sequence[int]) -> int | None:
    return min(calls) if calls else None


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
    token: list[int] = []
    parent: list[int] = []  # node index of the parent node, -1 at the top
    trained: list[bool] = []
    values: list[tuple[float, float, float]] = []  # old logprob, advantage, weight of a trained node
    children: dict[tuple[int, int], list[int]] = {}
    order: list[list[int]] = []  # the children of each node, in insertion order
    top: list[int] = []  # the first tokens' nodes
    for sample in samples:
        weights = token_weights(sample)
        node = -1
        for p, tok in enumerate(sample.token_ids):
            trains = bool(sample.loss_mask[p])
            chosen = None
            for candidate in children.get((node, tok), ()):
                if not (trains and trained[candidate]):
                    chosen = candidate
                    break
            if chosen is None:
                chosen = len(token)
                token.append(tok)
                parent.append(node)
                trained.append(False)
                values.append((0.0, 0.0, 0.0))
                order.append([])
                children.setdefault((node, tok), []).append(chosen)
                (top if node < 0 else order[node]).append(chosen)
            if trains:
                trained[chosen] = True
                values[chosen] = (sample.old_logprobs[p], sample.advantages[p], weights[p])
            node = chosen
    layout: list[int] = []  # node of each packed position, depth first
    stack = list(reversed(top))
    while stack:
        node = stack.pop()
        layout.append(node)
        stack.extend(reversed(order[node]))
    position = {node: i for i, node in enumerate(layout)}
    calls = sorted({c for s in samples for c in s.calls})
    episodes = list(dict.fromkeys(s.episode_id for s in samples))
    tasks = list(dict.fromkeys(s.task_id for s in samples))
    weights = [values[n][2] if trained[n] else 0.0 for n in layout]
    kept = [w for n, w in zip(layout, weights, strict=True) if trained[n]]
    uniform = not kept or all(w == kept[0] for w in kept)
    parents = [-1 if parent[n] < 0 else position[parent[n]] for n in layout]
    if parents == list(range(-1, len(layout) - 1)):
        parents = None  # one chain: a plain sample, which trains with the plain causal mask (faster)
    return Sample(
        token_ids=[token[n] for n in layout],
        loss_mask=[int(trained[n]) for n in layout],
        old_logprobs=[values[n][0] if trained[n] else 0.0 for n in layout],
        advantages=[values[n][1] if trained[n] else 0.0 for n in layout],
        policy_version=min(s.policy_version for s in samples),
        episode_id="+".join(episodes),
        task_id="+".join(tasks),
        weight=kept[0] if kept and uniform else 1.0,
        weights=None if uniform else weights,
        parents=parents,
        calls=calls,
    )


@dataclass
class MergeStats:
    """What merging did in one batch (the per-step metrics of docs/merging.md)."""

    samples_before: int = 0
    samples_after: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    snaps: dict[str, int] = field(default_factory=dict)
    drift: dict[str, int] = field(default_factory=dict)

    def add_snaps(self, snaps: Sequence[Snap]) -> None:
        for snap in snaps:
            self.snaps[snap.reason] = self.snaps.get(snap.reason, 0) + 1

    def metrics(self) -> dict[str, object]:
        return {
            "samples_before_merge": self.samples_before,
            "tokens_before_merge": self.tokens_before,
            "tokens_after_merge": self.tokens_after,
            "merge_snaps": dict(sorted(self.snaps.items())),
            "drift": dict(sorted(self.drift.items())),
        }
