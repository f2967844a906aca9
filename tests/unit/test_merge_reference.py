"""The fast merging of ``ajet_hpc.algo.merge`` (and the snap explanations of ``trainer.samples``) against
the code it replaced (kept below as the slow reference), on seeded random episodes written with the
built-in models' real tokenizers: shared prefixes, forks, duplicate answers, summarised contexts, answers
re-tokenized in the next prompt (text-level merges), answers without a stop token glued to the next text
(no clean cut), loss masks with holes, per-token weights. Every merge (token and text level, special
tokens decoded or skipped) and every packed tree must equal the reference's: the same samples, the same
snaps, in the same order.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from ajet_hpc.algo import merge, tree_packing
from ajet_hpc.algo.sample_tensors import Ints, Sample
from ajet_hpc.engine import tiny, tiny_qwen
from ajet_hpc.tracking.timeline import Timeline
from ajet_hpc.trainer.coordinator import episodes_to_samples as trainer_samples


def _text(decoded: str | list[str]) -> str:
    """``tokenizer.decode`` of one sequence (typed ``str | list[str]``: a list only for a batch)."""
    assert isinstance(decoded, str)
    return decoded


def _token_id(found: int | list[int]) -> int:
    """``tokenizer.convert_tokens_to_ids`` of one token (a list only for a list of tokens)."""
    assert isinstance(found, int)
    return found


def _ids(token_ids: Ints) -> list[int]:
    """The token ids of a sample built here from a list (merging keeps lists lists)."""
    assert isinstance(token_ids, list)
    return token_ids


# ---------------------------------------------------------------------------------------------------------
# The reference: merge_linear and pack_tree as they were before they were made linear (per-token loops,
# one decode per prefix of the target). Kept verbatim but for the names.
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _RefMerged:
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
    def of(cls, sample: Sample) -> _RefMerged:
        return cls(
            token_ids=list(sample.token_ids),
            loss_mask=list(sample.loss_mask),
            old_logprobs=list(sample.old_logprobs),
            advantages=list(sample.advantages),
            weights=ref_token_weights(sample),
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


def ref_token_weights(sample: Sample) -> list[float]:
    """The loss weight of each token of ``sample`` (its per-token weights, else its weight everywhere)."""
    return list(sample.weights) if sample.weights is not None else [sample.weight] * len(sample)


def ref_merge_linear(
    samples: Sequence[Sample], *, level: str = merge.TOKEN, decode: Callable[[list[int]], str] | None = None
) -> tuple[list[Sample], list[merge.Snap]]:
    """Absorb every sample that is a prefix of a longer one (same episode) into the longest such sample.

    ``samples`` are the calls of one episode as plain (not tree) samples. Returns the merged samples,
    longest first, and the snaps met (``text_trusted`` merges; ``duplicate`` positions). With
    ``level="text"``, ``decode`` turns token ids into text (e.g. ``tokenizer.decode`` without cleanup).
    """
    if level not in (merge.TOKEN, merge.TEXT):
        raise ValueError(f"merge level must be {merge.TOKEN!r} or {merge.TEXT!r}, got {level!r}")
    if level == merge.TEXT and decode is None:
        raise ValueError("text-level merging needs decode (token ids -> text)")
    for sample in samples:
        if sample.parents is not None:
            raise ValueError("ref_merge_linear takes plain samples, not tree-packed ones")
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]), -i))
    merged: list[_RefMerged] = []
    snaps: list[merge.Snap] = []
    for i in order:
        sample = samples[i]
        for target in merged:
            cut = ref_prefix_end(sample, target, level, decode)
            if cut is None:
                continue
            snap = ref_absorb(target, sample, cut)
            if snap is not None:
                snaps.append(snap)
                if snap.reason == merge.DUPLICATE:
                    continue  # try another sample, else it stays apart
            break
        else:
            merged.append(_RefMerged.of(sample))
    return [m.sample() for m in merged], snaps


def ref_prefix_end(
    sample: Sample, target: _RefMerged, level: str, decode: Callable[[list[int]], str] | None
) -> int | None:
    """Where ``sample`` ends inside ``target`` if it is a prefix of it (by tokens, or by text), else None."""
    n = len(sample.token_ids)
    if n <= len(target.token_ids) and target.token_ids[:n] == sample.token_ids:
        return n
    if level != merge.TEXT or decode is None:
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


def ref_absorb(target: _RefMerged, sample: Sample, cut: int) -> merge.Snap | None:
    """Make ``sample``'s trainable tokens trainable in ``target``, whose first ``cut`` tokens hold the same
    text. None when merged exactly; a Snap when text was trusted, or (not merged) on a duplicate."""
    n = len(sample.token_ids)
    exact = cut == n and target.token_ids[:n] == sample.token_ids
    if exact:
        if any(sample.loss_mask[p] and target.loss_mask[p] for p in range(n)):
            return merge.Snap(
                sample.episode_id, ref_own_call(sample.calls), ref_first(target.calls), merge.DUPLICATE, n
            )
        for p in range(n):
            if sample.loss_mask[p]:
                target.loss_mask[p] = 1
                target.old_logprobs[p] = sample.old_logprobs[p]
                target.advantages[p] = sample.advantages[p]
                target.weights[p] = ref_token_weights(sample)[p]
        target.calls.extend(sample.calls)
        target.policy_version = min(target.policy_version, sample.policy_version)
        return None
    if any(target.loss_mask[:cut]):  # the replaced tokens would carry loss of another call
        return merge.Snap(
            sample.episode_id, ref_own_call(sample.calls), ref_first(target.calls), merge.DUPLICATE, n
        )
    weights, into = ref_token_weights(sample), ref_first(target.calls)
    target.token_ids = list(sample.token_ids) + target.token_ids[cut:]
    target.loss_mask = list(sample.loss_mask) + target.loss_mask[cut:]
    target.old_logprobs = list(sample.old_logprobs) + target.old_logprobs[cut:]
    target.advantages = list(sample.advantages) + target.advantages[cut:]
    target.weights = weights + target.weights[cut:]
    target.calls.extend(sample.calls)
    target.policy_version = min(target.policy_version, sample.policy_version)
    target.text_ends = None  # the text is the same; its token boundaries changed
    return merge.Snap(sample.episode_id, ref_own_call(sample.calls), into, merge.TEXT_TRUSTED, n)


def ref_first(calls: Sequence[int]) -> int | None:
    return min(calls) if calls else None


def ref_own_call(calls: Sequence[int]) -> int:
    """The call a sample stands for: every sample here names its call (`Snap.call` is an int)."""
    call = ref_first(calls)
    assert call is not None
    return call


def ref_pack_tree(samples: Sequence[Sample]) -> Sample:
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
        raise ValueError("ref_pack_tree needs at least one sample")
    for sample in samples:
        if sample.parents is not None:
            raise ValueError("ref_pack_tree takes plain samples, not tree-packed ones")
    token: list[int] = []
    parent: list[int] = []  # node index of the parent node, -1 at the top
    trained: list[bool] = []
    values: list[tuple[float, float, float]] = []  # old logprob, advantage, weight of a trained node
    children: dict[tuple[int, int], list[int]] = {}
    order: list[list[int]] = []  # the children of each node, in insertion order
    top: list[int] = []  # the first tokens' nodes
    for sample in samples:
        weights = ref_token_weights(sample)
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
    parents: list[int] | None = [-1 if parent[n] < 0 else position[parent[n]] for n in layout]
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


# ---------------------------------------------------------------------------------------------------------
# Random episodes
# ---------------------------------------------------------------------------------------------------------

WORDS = "the a tool call read file list open value error retry done search result page item key".split()  # noqa: SIM905


class Writer:
    """Token sequences in one tokenizer's chat format, and other spellings of the same text."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tok, self.rng = tokenizer, rng
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def words(self, low: int, high: int) -> list[int]:
        return self.encode(" ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(low, high))))

    def message(self, role: str, low: int, high: int) -> list[int]:
        return [
            self.im_start,
            *self.encode(f"{role}\n"),
            *self.words(low, high),
            self.im_end,
            *self.encode("\n"),
        ]

    def respell(self, ids: list[int]) -> list[int]:
        """The same text in other tokens: cut at one to three places and each piece encoded alone (a
        special token's text may come back as plain characters)."""
        text = self.tok.decode(ids, skip_special_tokens=False)
        cuts = sorted(self.rng.sample(range(1, len(text)), min(len(text) - 1, self.rng.randint(1, 3))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        return [t for piece in pieces for t in self.encode(piece)]

    def episode(self, name: str) -> list[Sample]:
        """The calls of one episode, in a shuffled order."""
        rng = self.rng
        system = self.message("system", 3, 12)
        context = system + self.message("user", 2, 6)
        header = [self.im_start, *self.encode("assistant\n")]
        calls: list[Sample] = []
        weight = rng.choice((1.0, 1.0, 0.5, 2.0))
        for _ in range(rng.randint(1, 7)):
            if calls and rng.random() < 0.1:  # summarised: the context starts over
                context = system + self.message("user", 2, 6)
            prompt = context + header
            stop = rng.random() < 0.85
            answer = self.words(1, 10) + ([self.im_end] if stop else [])
            sampled = answer if rng.random() < 0.7 else self.respell(answer)
            kind = rng.random()
            if kind < 0.15:  # a failed attempt first: a fork
                calls.append(self.call(prompt, self.words(1, 6), name, len(calls), weight))
            elif kind < 0.25:  # the same answer sampled twice
                calls.append(self.call(prompt, sampled, name, len(calls), weight))
            calls.append(self.call(prompt, sampled, name, len(calls), weight))
            if stop:
                held = rng.choice((sampled, sampled, answer, self.respell(answer)))
                context = prompt + held + self.encode("\n") + self.message("user", 1, 8)
            else:  # the next text glued on: the answer's text may end inside a token of the next prompt
                text = self.tok.decode(sampled, skip_special_tokens=False) + rng.choice(
                    ("s", "ing", "", " x")
                )
                context = prompt + self.encode(text) + [self.im_end]
            if rng.random() < 0.1:  # a second agent in the same episode: nothing shared
                calls.append(
                    self.call(
                        self.message("system", 2, 5) + header, self.words(1, 5), name, len(calls), weight
                    )
                )
        rng.shuffle(calls)
        return calls

    def call(self, prompt: list[int], answer: list[int], name: str, index: int, weight: float) -> Sample:
        rng = self.rng
        n, m = len(prompt), len(answer)
        mask = [0] * n + [1] * m
        if m > 3 and rng.random() < 0.2:  # a hole: tokens inside the answer that are not trained
            start = rng.randrange(n + 1, n + m - 1)
            mask[start : start + rng.randint(1, 2)] = [0] * len(mask[start : start + 2])
        per_token = [rng.choice((0.5, 1.0, 2.0)) for _ in range(n + m)] if rng.random() < 0.15 else None
        return Sample(
            token_ids=prompt + answer,
            loss_mask=mask[: n + m],
            old_logprobs=[-rng.uniform(0.1, 3.0) if t else 0.0 for t in mask[: n + m]],
            advantages=[rng.choice((-1.0, 0.5, 1.0)) if t else 0.0 for t in mask[: n + m]],
            policy_version=rng.randint(0, 2),
            episode_id=name,
            task_id="task",
            weight=weight,
            weights=per_token,
            calls=[index],
        )


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen"])
def tokenizer(request):
    return tiny.build_tokenizer() if request.param == "tiny" else tiny_qwen.build_tokenizer()


@pytest.mark.parametrize("skip_special", [False, True])
def test_merging_and_packing_equal_the_reference_on_random_episodes(tokenizer, skip_special: bool) -> None:
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    seen: dict[str, int] = {}
    for seed in range(60):
        writer = Writer(tokenizer, random.Random(seed))
        calls = writer.episode(f"ep{seed}")
        for level in (merge.TOKEN, merge.TEXT):
            got = merge.merge_linear(calls, level=level, decode=decode)
            want = ref_merge_linear(calls, level=level, decode=decode)
            assert got == want, f"seed {seed}, {level} level"
            for snap in got[1]:
                seen[f"{level}:{snap.reason}"] = seen.get(f"{level}:{snap.reason}", 0) + 1
            assert tree_packing.pack_tree(got[0]) == ref_pack_tree(want[0]), f"seed {seed}, {level} level"
        assert tree_packing.pack_tree(calls) == ref_pack_tree(calls), f"seed {seed}"
    # the episodes reach what they are meant to: duplicates, and text-level merges over other tokens
    assert seen.get("token:duplicate", 0) > 0 and seen.get("text:text_trusted", 0) > 0, seen


def byte_characters() -> dict[int, str]:
    """GPT-2's byte-level alphabet (Qwen's too): the character that stands for each byte in the vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def test_a_text_cut_never_ends_inside_a_character_split_over_byte_tokens() -> None:
    """Byte-level tokens can spell one character in pieces: each partial prefix decodes with a replacement
    character, as long as the text. The reference cut by length alone, inside the character (training the
    call's ids followed by the rest of the character's bytes); the cut now comes after the last piece."""
    tokenizer = tiny_qwen.build_tokenizer()
    byte_token = byte_characters()

    def decode(ids: Ints) -> str:
        return _text(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt = enc("<|im_start|>user\nsmile<|im_end|>\n<|im_start|>assistant\n")
    pieces = [_token_id(tokenizer.convert_tokens_to_ids(byte_token[b])) for b in "🙂".encode()]
    first = Sample(
        prompt + enc("ok 🙂"),
        [0] * len(prompt) + [1] * len(enc("ok 🙂")),
        [0.0] * len(prompt) + [-0.5] * len(enc("ok 🙂")),
        [0.0] * len(prompt) + [1.0] * len(enc("ok 🙂")),
        0,
        "ep",
        "task",
        calls=[0],
    )
    later = prompt + enc("ok ") + pieces + enc(" fine<|im_end|>")
    second = Sample(
        later,
        [0] * (len(later) - 2) + [1, 1],
        [0.0] * (len(later) - 2) + [-0.1, -0.1],
        [0.0] * (len(later) - 2) + [1.0, 1.0],
        0,
        "ep",
        "task",
        calls=[1],
    )
    assert len(pieces) == 4 and decode(later).startswith(decode(first.token_ids))

    (merged,), snaps = merge.merge_linear([first, second], level=merge.TEXT, decode=decode)
    assert [s.reason for s in snaps] == [merge.TEXT_TRUSTED]
    assert merged.token_ids == first.token_ids + enc(" fine<|im_end|>")  # after the character's 4 pieces
    assert decode(merged.token_ids) == decode(later)
    (old,), _ = ref_merge_linear([first, second], level=merge.TEXT, decode=decode)
    assert decode(old.token_ids) != decode(later)  # the reference cut after the first piece


def ref_explain_snaps(episode_id, timelines, merged, decode=None) -> list[merge.Snap]:
    """``trainer.samples.explain_snaps`` before: message keys rebuilt per pair of calls, a per-token loop."""
    absorbed_into = {}
    for sample in merged:
        for call in sample.calls:
            absorbed_into[call] = sample
    snaps = []
    for k, earlier in enumerate(timelines):
        mine = [trainer_samples._message_key(m) for m in earlier.messages]
        later = None
        for index, timeline in enumerate(timelines[k + 1 :]):
            request = timeline.messages[:-1]
            if (
                len(request) > len(mine)
                and [trainer_samples._message_key(m) for m in request[: len(mine)]] == mine
            ):
                later = index
                break
        if later is None:
            continue
        j = k + 1 + later
        if absorbed_into.get(k) is absorbed_into.get(j):
            continue
        if trainer_samples._tools_key(earlier.tools) != trainer_samples._tools_key(timelines[j].tools):
            reason = merge.TOOLS_CHANGED
        elif any(event.kind == merge.TEMPLATE_DROPPED_CONTENT for event in timelines[j].drift):
            reason = merge.TEMPLATE_DROPPED_CONTENT
        elif trainer_samples._text_prefix(earlier, timelines[j], decode):
            reason = merge.TOKENS_DIFFERED
        else:
            reason = merge.TEXT_DIFFERED
        ids, other = earlier.token_ids, timelines[j].token_ids
        parted = next((p for p, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b), len(ids))
        snaps.append(merge.Snap(episode_id, k, j, reason, parted))
    return snaps


def test_snap_explanations_equal_the_reference_on_random_conversations() -> None:
    rng = random.Random(0)
    total = 0
    for _ in range(300):
        messages, ids, timelines = [{"role": "system", "content": "s"}], [1, 2], []
        for _ in range(rng.randint(1, 8)):
            messages = [*messages, {"role": rng.choice(["user", "tool"]), "content": rng.choice("abc")}]
            reply = {"role": "assistant", "content": rng.choice("xyz") + " "}
            ids = ids + [rng.randint(0, 5) for _ in range(rng.randint(1, 4))]
            r = rng.randint(1, 3)
            timelines.append(
                Timeline(
                    ids[:-r],
                    ids[-r:],
                    [0.0] * r,
                    [0] * len(ids),
                    [0] * (len(ids) - r) + [1] * r,
                    [*messages, reply],
                    rng.choice([None, [{"name": "f"}]]),
                    0,
                    "stop",
                )
            )
            if rng.random() < 0.7:  # the conversation goes on from the reply
                messages = [*messages, reply]
            if rng.random() < 0.3:  # the prompt's tokens part from the earlier ones
                ids = [*ids[: rng.randint(1, len(ids))], 9]
        merged = [
            Sample(
                t.token_ids,
                [0] * len(t.token_ids),
                [0.0] * len(t.token_ids),
                [0.0] * len(t.token_ids),
                0,
                "e",
                "t",
                calls=[i],
            )
            for i, t in enumerate(timelines)
            if rng.random() < 0.6
        ]

        def decode(ids: list[int]) -> str:
            return "".join(chr(97 + i) for i in ids)

        got = trainer_samples.explain_snaps("e", timelines, merged, decode)
        assert got == ref_explain_snaps("e", timelines, merged, decode)
        total += len(got)
    assert total > 100  # the conversations do leave calls unmerged


# ---------------------------------------------------------------------------------------------------------
# Text level through `TokenText` (the trainer's decode: the backend, and only the tokens past where two calls
# part) against the reference with the tokenizer's own decode
# ---------------------------------------------------------------------------------------------------------

UNICODE_WORDS = "café naïve 🙂 日本語 ключ ∑x 👍🏽 é".split()  # noqa: SIM905


class ByteWriter(Writer):
    """`Writer` with words outside ASCII, respelled now and then as raw byte tokens (byte-level
    vocabularies): a character split over several tokens, a call that ends inside a character."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        super().__init__(tokenizer, rng)
        byte_token = byte_characters()
        vocab = tokenizer.get_vocab()
        self.byte_ids = {b: vocab.get(byte_token[b]) for b in range(256)}

    def words(self, low: int, high: int) -> list[int]:
        pool = WORDS + UNICODE_WORDS
        return self.encode(" ".join(self.rng.choice(pool) for _ in range(self.rng.randint(low, high))))

    def respell(self, ids: list[int]) -> list[int]:
        if self.rng.random() < 0.5 or None in self.byte_ids.values():
            return super().respell(ids)
        text = self.tok.decode(ids, skip_special_tokens=False)
        data = text.encode()
        cut = self.rng.randrange(len(data))
        if self.rng.random() < 0.5:
            return [*self.encode(data[:cut].decode(errors="ignore")), *(self.byte_ids[b] for b in data[cut:])]
        return [self.byte_ids[b] for b in data[:cut]] + self.encode(data[cut:].decode(errors="ignore"))


def test_text_merging_through_token_text_equals_the_reference(tokenizer) -> None:
    from ajet_hpc.algo.detokenize import TokenText

    token_text = TokenText(tokenizer)
    assert token_text.joins is not None  # both built-in tokenizers: the local comparison is what runs

    def decode(ids: Ints) -> str:
        return _text(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    seen: dict[str, int] = {}
    prefixes = 0
    for seed in range(80):
        writer = (ByteWriter if seed % 2 else Writer)(tokenizer, random.Random(seed))
        calls = writer.episode(f"ep{seed}")
        got = merge.merge_linear(calls, level=merge.TEXT, decode=token_text)
        assert got == ref_merge_linear(calls, level=merge.TEXT, decode=decode), f"seed {seed}"
        assert got == merge.merge_linear(calls, level=merge.TEXT, decode=decode), f"seed {seed}"
        texts = [decode(c.token_ids) for c in calls]
        for a, text in zip(calls, texts, strict=True):  # explain_snaps' test: a call's text starts another's
            for b, other in zip(calls, texts, strict=True):
                want = other.startswith(text)
                assert merge.text_is_prefix(_ids(a.token_ids), _ids(b.token_ids), token_text) == want, (
                    f"seed {seed}"
                )
                prefixes += want
        for snap in got[1]:
            seen[snap.reason] = seen.get(snap.reason, 0) + 1
    assert seen.get("text_trusted", 0) > 0 and prefixes > 1000, (seen, prefixes)


def test_text_merging_through_token_text_where_spellings_part_inside_characters() -> None:
    """Two spellings of the same text that part inside a character (one keeps a byte token where the other
    has a token of several bytes), and calls that end inside a character: the places where a byte-level
    decode does not split, so `TokenText` must step back to where it does."""
    from ajet_hpc.algo.detokenize import TokenText

    tokenizer = tiny_qwen.build_tokenizer()
    token_text = TokenText(tokenizer)
    byte_token = byte_characters()
    byte_ids = [_token_id(tokenizer.convert_tokens_to_ids(byte_token[b])) for b in range(256)]

    def decode(ids: Ints) -> str:
        return _text(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def enc(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def spell(data: bytes, rng: random.Random) -> list[int]:
        """``data`` cut at random bytes; each piece encoded as text where it is valid UTF-8, else as bytes."""
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 4))))
        out: list[int] = []
        for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
            try:
                out += enc(data[a:b].decode())
            except UnicodeDecodeError:
                out += [byte_ids[x] for x in data[a:b]]
        return out

    prompt = enc("<|im_start|>user\nsay it<|im_end|>\n<|im_start|>assistant\n")
    seen: dict[str, int] = {}
    for seed in range(300):
        rng = random.Random(seed)
        text = " ".join(rng.choice(UNICODE_WORDS + WORDS[:4]) for _ in range(rng.randint(2, 6)))
        data = text.encode()
        ends = sorted(rng.sample(range(1, len(data) + 1), min(len(data), rng.randint(2, 4))))
        calls = []
        for k, end in enumerate(ends):  # each call's text a byte prefix of the next one's
            ids = spell(data[:end], rng)
            n, m = len(prompt) + len(ids) - min(2, len(ids)), len(prompt) + len(ids)  # trains its last tokens
            calls.append(
                Sample(
                    prompt + ids,
                    [0] * n + [1] * (m - n),
                    [0.0] * n + [-0.5] * (m - n),
                    [0.0] * n + [1.0] * (m - n),
                    0,
                    "ep",
                    "task",
                    calls=[k],
                )
            )
        rng.shuffle(calls)
        got = merge.merge_linear(calls, level=merge.TEXT, decode=token_text)
        # today's merge with the tokenizer's decode (the reference cut inside characters: see above)
        assert got == merge.merge_linear(calls, level=merge.TEXT, decode=decode), f"seed {seed}"
        for snap in got[1]:
            seen[snap.reason] = seen.get(snap.reason, 0) + 1
    assert seen.get("text_trusted", 0) > 20, seen
