"""Timeline merging: fewer, longer training samples with exactly the same loss.

An agent's multi-turn episode makes one model call per turn, and call k+1's prompt usually holds call k's
prompt and answer verbatim (the server splices the sampled ids back in: token-in, token-out). Training
each call as its own sample computes that shared prefix again and again. Merging computes it once:

- **Linear** (`merge_linear`): a call whose tokens are a prefix of a longer call of the same episode is
  absorbed into it; its answer becomes trainable positions (loss mask 1, its old logprobs and advantages)
  inside the longer sample. Calls that fork (a retry, an edited history, a second agent) stay apart.
  ``level="token"`` compares token ids (exact); ``level="text"`` compares decoded text and also merges
  where the same text was tokenized otherwise, reporting each such place as a `Snap` (``text_trusted``).
- **Tree** (`pack_tree`, :mod:`ajet_hpc.algo.tree_packing`): samples that share a prefix and then fork
  become one packed sequence, laid out depth-first, with ``parents`` per token; the trainer builds an
  attention mask in which each token sees only its ancestors and gives each token the position id of its
  depth (``samples.collate``). Every token keeps the context it had in its own sample, so logits,
  logprobs, loss and gradients equal those of training the samples separately (up to float rounding).

Neither changes the loss: per-token loss terms, their weights and the step's token normaliser are those of
the unmerged samples. Only the compute changes. See ``docs/merging.md``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ajet_hpc.algo.detokenize import TokenText
from ajet_hpc.algo.sample_tensors import ARRAY_TYPES, Sample, as_list, mask_runs

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


class _Merged:
    """A sample being built: the longest call of a chain and the calls absorbed into it.

    It reads its first sample's fields until it changes them (`own` copies them then): most forks absorb
    nothing, and one that stays as it came is returned as the very sample it was. Token ids are read as a
    list (prefixes are compared as lists); the other per-token fields stay numpy arrays when the first
    sample's loss mask is one (as the trainer's call samples are: an absorbed answer is then a slice
    assignment, with nothing converted per token), else lists."""

    def __init__(self, sample: Sample) -> None:
        self.source = sample
        self.arrays = isinstance(sample.loss_mask, np.ndarray)
        self.token_ids: list[int] = sample.token_ids if isinstance(sample.token_ids, list) else []
        self.loss_mask: Any = sample.loss_mask
        self.old_logprobs: Any = sample.old_logprobs
        self.advantages: Any = sample.advantages
        self.weights: Any = []  # set by own()
        self.policy_version = sample.policy_version
        self.calls = list(sample.calls)
        self.text: str | None = None
        self.text_ids: list[int] | None = None  # the ids `text` is (or would be) the decode of
        self.owned = False
        if self.arrays:
            fields = (sample.old_logprobs, sample.advantages)
            if not isinstance(sample.token_ids, list) or not all(isinstance(x, np.ndarray) for x in fields):
                self.own()
        elif not all(
            isinstance(x, list)
            for x in (sample.token_ids, sample.loss_mask, sample.old_logprobs, sample.advantages)
        ):
            self.own()  # read as lists, as the copies were

    def own(self) -> None:
        """Copy the first sample's fields before the first change."""
        if not self.owned:
            sample = self.source
            self.token_ids = as_list(sample.token_ids)  # never changed in place (a text merge replaces it)
            if self.arrays:
                self.loss_mask = np.array(sample.loss_mask, ARRAY_TYPES["loss_mask"])
                self.old_logprobs = np.array(sample.old_logprobs, np.float64)
                self.advantages = np.array(sample.advantages, np.float64)
                self.weights = (
                    np.array(sample.weights, np.float64)
                    if sample.weights is not None
                    else np.full(len(sample), sample.weight, np.float64)
                )
            else:
                self.loss_mask = list(sample.loss_mask)
                self.old_logprobs = list(sample.old_logprobs)
                self.advantages = list(sample.advantages)
                self.weights = token_weights(sample)
            self.owned = True

    def sample(self) -> Sample:
        source = self.source
        if (
            not self.owned
            and source.weights is None
            and isinstance(source.calls, list)
            and source.calls == sorted(source.calls)
        ):
            return source  # nothing absorbed: the sample as it came (what copying it would give)
        self.own()
        first = self.weights[0]
        # list.count compares in C (identity, then ==); a NaN weight is never uniform, as with ==
        if self.arrays:
            first = float(first)
            uniform = first == first and bool((self.weights == first).all())
        else:
            uniform = first == first and self.weights.count(first) == len(self.weights)
        return Sample(
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            old_logprobs=self.old_logprobs,
            advantages=self.advantages,
            policy_version=self.policy_version,
            episode_id=source.episode_id,
            task_id=source.task_id,
            weight=first if uniform else 1.0,
            weights=None if uniform else self.weights,
            calls=sorted(self.calls),
        )


def token_weights(sample: Sample) -> list[float]:
    """The loss weight of each token of ``sample`` (its per-token weights, else its weight everywhere)."""
    return list(as_list(sample.weights)) if sample.weights is not None else [sample.weight] * len(sample)


class _Candidate:
    """A sample being placed, with what is worked out once however many targets it is tried against: the
    runs of its trained positions and (text level) its decoded text."""

    def __init__(self, sample: Sample) -> None:
        self.sample = sample
        self.ids = as_list(sample.token_ids)
        self.runs = mask_runs(sample.loss_mask)
        self.text: str | None = None


def merge_linear(
    samples: Sequence[Sample], *, level: str = TOKEN, decode: Callable[[list[int]], str] | None = None
) -> tuple[list[Sample], list[Snap]]:
    """Absorb every sample that is a prefix of a longer one (same episode) into the longest such sample.

    ``samples`` are the calls of one episode as plain (not tree) samples. Returns the merged samples,
    longest first, and the snaps met (``text_trusted`` merges; ``duplicate`` positions). With
    ``level="text"``, ``decode`` turns token ids into text (``TokenText(tokenizer)``, or any function such
    as ``tokenizer.decode`` without cleanup).

    Cost: token level, linear in the tokens compared (list comparisons and slice copies, which run in C;
    a Python step per trained run, not per token). Text level with a plain ``decode`` adds one decode of
    each sample whose tokens are not a prefix of a target, and for each text cut one decode of the target's
    prefix to confirm it (see ``_text_cut``); with a `TokenText` (``algo/detokenize.py``, what the trainer
    passes) only the tokens from about where the two part, in pieces, until the texts differ.
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
        candidate = _Candidate(samples[i])
        for target in merged:
            cut, exact = _prefix_end(candidate, target, level, decode)
            if cut is None:
                continue
            snap = _absorb(target, candidate, cut, exact)
            if snap is not None:
                snaps.append(snap)
                if snap.reason == DUPLICATE:
                    continue  # try another sample, else it stays apart
            break
        else:
            merged.append(_Merged(candidate.sample))
    return [m.sample() for m in merged], snaps


def _prefix_end(
    candidate: _Candidate, target: _Merged, level: str, decode: Callable[[list[int]], str] | None
) -> tuple[int | None, bool]:
    """Where the candidate ends inside ``target`` if it is a prefix of it (by tokens, or by text), else
    None; and whether it is a token prefix (exact).

    The target's text is that of its ids when text was first compared (``text_ids``): a text-level merge
    replaces the target's first tokens by the candidate's, and the comparisons that follow read the text
    as it was. With a `TokenText` that knows where its decode splits (``joins``), only the tokens from
    (about) where the two calls part are decoded: both texts are the shared prefix's text followed by the
    decode of the rest (`_split`), so the comparison is between the rests (`_starts_with`)."""
    ids = candidate.ids
    n = len(ids)
    # the last token first: a fork that parts before it is turned down without copying the prefix
    fits = n <= len(target.token_ids) and (n == 0 or target.token_ids[n - 1] == ids[-1])
    if fits and target.token_ids[:n] == ids:
        return n, True
    if level != TEXT or decode is None:
        return None, False
    if target.text_ids is None:
        target.text_ids = target.token_ids
    joins = _joins_of(decode)
    if joins is None:
        if candidate.text is None:
            candidate.text = decode(list(ids))
        if target.text is None:
            target.text = decode(target.text_ids)
        if not target.text.startswith(candidate.text):
            return None, False
    elif not text_is_prefix(ids, target.text_ids, decode):
        return None, False
    return _text_cut(candidate, target.token_ids, decode, joins), False


def text_is_prefix(ids: list[int], base: list[int], decode: Callable[[list[int]], str]) -> bool:
    """``decode(base).startswith(decode(ids))``; with a `TokenText` that knows where its decode splits,
    by decoding only from (about) where the two part (`_split`, `_starts_with`)."""
    joins = _joins_of(decode)
    if joins is None:
        return decode(base).startswith(decode(ids))
    split = _split(ids, base, common_prefix(ids, base), joins)
    return _starts_with(base, ids, split, decode, joins)


def _joins_of(decode: Callable[[list[int]], str]) -> Callable[[int], bool] | None:
    """``decode.joins_before`` when ``decode`` is a `TokenText` that knows where it splits, else None."""
    return decode.joins_before if isinstance(decode, TokenText) and decode.joins is not None else None


def _split(a: list[int], b: list[int], d: int, joins: Callable[[int], bool]) -> int:
    """The largest s <= d (``a[:d] == b[:d]``) where both decodes split: ``decode(x) == decode(x[:s]) +
    decode(x[s:])`` for x = a and b (each s < len(x) with ``joins(x[s])``; s = len(x) and s = 0 always).
    Below d the two share the token; a byte-level text rarely steps back more than one or two tokens."""
    s = d
    if (s == len(a) or joins(a[s])) and (s == len(b) or joins(b[s])):
        return s
    s -= 1
    while s > 0 and not joins(a[s]):
        s -= 1
    return max(s, 0)


def _starts_with(
    base: list[int], ids: list[int], start: int, decode: Callable[[list[int]], str], joins
) -> bool:
    """Whether ``decode(base[start:])`` starts with ``decode(ids[start:])``, where both decodes split at
    ``start``. Both are decoded in pieces (32 tokens and on to where the decode splits, twice as many each
    time; each piece's text follows the one before it, since it starts where the decode splits), the
    shorter text extended first, until they differ or the ids' text is passed: two calls that part early
    (a fork, a summarised context) cost a few dozen tokens, not their lengths."""
    texts, ends, widths = ["", ""], [start, start], [32, 32]
    sources = (ids, base)
    checked = 0
    while True:
        ids_done = ends[0] >= len(ids)
        if ids_done and len(texts[1]) >= len(texts[0]):
            return True
        side = 0 if not ids_done and len(texts[0]) <= len(texts[1]) else 1
        source, end = sources[side], ends[side]
        if end >= len(source):
            return False  # the base's whole text is shorter
        stop = min(end + widths[side], len(source))
        while stop < len(source) and not joins(source[stop]):
            stop += 1
        texts[side] += decode(source[end:stop])
        ends[side], widths[side] = stop, widths[side] * 2
        common = min(len(texts[0]), len(texts[1]))
        if texts[0][checked:common] != texts[1][checked:common]:
            return False
        checked = common


def _text_cut(
    candidate: _Candidate, target: list[int], decode: Callable[[list[int]], str], joins
) -> int | None:
    """The first k whose decoded prefix ``decode(target[:k])`` is exactly the candidate's text (a prefix of
    the target's text), else None: the text ends inside a token of the target.

    Linear, not one decode per prefix: the candidate's ids and ``target`` share their first d tokens, and the
    cut lies where the target's tokens after d spell what the ids spell after d. Only those few tokens are
    decoded to find the candidate (widening steps, then bisection), and one decode of ``target[:k]``
    confirms it (with ``joins``: of ``target[s:k]`` against the ids from s, where both decodes split,
    `_split`); the confirmation is what makes the cut exact (a decode need not be the concatenation of its
    parts: byte-level tokens that hold part of a UTF-8 character, a SentencePiece space). Where it fails,
    the cut is searched by bisection over decoded prefix lengths (``log2 len(target)`` decodes) and
    confirmed, stepping over the tokens of a character split into bytes (its partial prefixes decode to as
    many characters, a replacement character last): a cut never ends inside a character.
    """
    ids = candidate.ids
    d = common_prefix(ids, target)
    tail = decode(ids[d:])
    need = len(tail)
    if need > 0 and d < len(target):
        if joins is not None:
            split = _split(ids, target, d, joins)
            rest = decode(ids[split:])

            def confirmed(end: int) -> bool:  # decode(target[:end]) == text, from where both split
                return decode(target[split:end]) == rest

        else:

            def confirmed(end: int) -> bool:
                return decode(target[:end]) == _text_of(candidate, decode)

        def width(k: int) -> int:  # characters spelled by target[d:k]
            return len(decode(target[d:k]))

        step, low = max(1, len(ids) - d), d  # width(low) < need
        high = min(d + step, len(target))
        while high < len(target) and width(high) < need:
            low, step = high, step * 2
            high = min(d + step, len(target))
        k = low + 1 + bisect.bisect_left(_Lengths(width, low + 1, high + 1), need)
        for end in range(k, min(k + 4, len(target) + 1)):  # up to 4 byte-level tokens spell one character
            window = decode(target[d:end])
            if window == tail and confirmed(end):
                return end
            if len(window) != need:
                break
    text = _text_of(candidate, decode)
    k = 1 + bisect.bisect_left(_Lengths(lambda k: len(decode(target[:k])), 1, len(target) + 1), len(text))
    for end in range(k, min(k + 4, len(target) + 1)):  # up to 4 byte-level tokens spell one character
        prefix = decode(target[:end])
        if prefix == text:
            return end
        if len(prefix) != len(text):  # past it, or a character that the text ends inside of
            break
    return None


def _text_of(candidate: _Candidate, decode: Callable[[list[int]], str]) -> str:
    if candidate.text is None:
        candidate.text = decode(candidate.ids)
    return candidate.text


class _Lengths:
    """``length(k)`` for k in [start, stop), computed only where ``bisect`` looks."""

    def __init__(self, length: Callable[[int], int], start: int, stop: int) -> None:
        self.length, self.start, self.stop = length, start, stop

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __getitem__(self, index: int) -> int:
        return self.length(self.start + index)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first items the lists ``a`` and ``b`` share, by bisection over slice comparisons (which
    run in C): about two passes over the shared part."""
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; they part at or before high
    if a[:high] == b[:high]:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low


def _absorb(target: _Merged, candidate: _Candidate, cut: int, exact: bool) -> Snap | None:
    """Make the candidate's trainable tokens trainable in ``target``, whose first ``cut`` tokens hold the
    same text (the same tokens when ``exact``). None when merged exactly; a Snap when text was trusted, or
    (not merged) on a duplicate."""
    sample = candidate.sample
    n = len(sample.token_ids)
    if exact:
        if any(_trains(target.loss_mask, a, b) for a, b in candidate.runs):
            return Snap(sample.episode_id, _own_call(sample.calls), _first(target.calls), DUPLICATE, n)
        target.own()
        if target.arrays:  # slices of arrays, or scalars: nothing converted per token
            for a, b in candidate.runs:
                target.loss_mask[a:b] = 1
                target.old_logprobs[a:b] = sample.old_logprobs[a:b]
                target.advantages[a:b] = sample.advantages[a:b]
                target.weights[a:b] = sample.weights[a:b] if sample.weights is not None else sample.weight
        else:
            for a, b in candidate.runs:
                target.loss_mask[a:b] = [1] * (b - a)
                target.old_logprobs[a:b] = as_list(sample.old_logprobs[a:b])
                target.advantages[a:b] = as_list(sample.advantages[a:b])
                target.weights[a:b] = (
                    as_list(sample.weights[a:b]) if sample.weights is not None else [sample.weight] * (b - a)
                )
        target.calls.extend(sample.calls)
        target.policy_version = min(target.policy_version, sample.policy_version)
        return None
    if _trains(target.loss_mask, 0, cut):  # the replaced tokens would carry loss of another call
        return Snap(sample.episode_id, _own_call(sample.calls), _first(target.calls), DUPLICATE, n)
    target.own()
    weights, into = token_weights(sample), _first(target.calls)
    join = _join_of(target.arrays)
    target.token_ids = candidate.ids + target.token_ids[cut:]
    target.loss_mask = join(sample.loss_mask, target.loss_mask[cut:])
    target.old_logprobs = join(sample.old_logprobs, target.old_logprobs[cut:])
    target.advantages = join(sample.advantages, target.advantages[cut:])
    target.weights = join(weights, target.weights[cut:])
    target.calls.extend(sample.calls)
    target.policy_version = min(target.policy_version, sample.policy_version)
    return Snap(sample.episode_id, _own_call(sample.calls), into, TEXT_TRUSTED, n)


def _trains(mask: Any, start: int, end: int) -> bool:
    """Whether a loss mask (a list or an array) has a 1 in ``[start, end)``."""
    part = mask[start:end]
    return bool(np.count_nonzero(part)) if isinstance(part, np.ndarray) else any(part)


def _join_of(arrays: bool) -> Callable[[Any, Any], Any]:
    """``head + tail`` for a field held as an array (``head`` of any kind) or as a list."""
    if arrays:
        return lambda head, tail: np.concatenate((np.asarray(head, tail.dtype), tail))
    return lambda head, tail: as_list(head) + tail


def _first(calls: Sequence[int]) -> int | None:
    return min(calls) if calls else None


def _own_call(calls: Sequence[int]) -> int:
    """The call a merge candidate stands for (a per-call sample always names its call)."""
    if not calls:
        raise ValueError("a merge candidate names no call: per-call samples carry their call's index")
    return min(calls)


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
