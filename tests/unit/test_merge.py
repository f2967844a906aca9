"""Timeline merging on hand-built calls: which calls merge, what stays apart, what is reported."""

from __future__ import annotations

import pytest
import torch

from ajet_hpc.algo import merge, tree_packing
from ajet_hpc.algo.sample_tensors import Ints, Sample, collate
from ajet_hpc.engine.tiny import build_tokenizer


def as_list(values: Ints | None) -> list[int]:
    """A per-token field of a sample built (and merged) here from lists: the list itself."""
    assert isinstance(values, list)
    return values


def call(prefix: list[int], answer: list[int], index: int, logprob: float, advantage: float) -> Sample:
    """One model call: ``prefix`` (its prompt) then ``answer`` (trained, with the given values)."""
    n, m = len(prefix), len(answer)
    return Sample(
        token_ids=prefix + answer,
        loss_mask=[0] * n + [1] * m,
        old_logprobs=[0.0] * n + [logprob] * m,
        advantages=[0.0] * n + [advantage] * m,
        policy_version=3,
        episode_id="ep",
        task_id="task",
        calls=[index],
    )


def conversation(turns: int) -> tuple[list[Sample], list[tuple[int, int]]]:
    """A linear tool conversation: system+user prompt, then per turn an answer and a tool result.
    Returns the calls and the (start, end) span of each answer in the last call."""
    prompt = list(range(100, 120))
    calls, spans = [], []
    for k in range(turns):
        answer = [200 + 10 * k + j for j in range(3 + k)]
        calls.append(call(list(prompt), answer, k, logprob=-0.1 * (k + 1), advantage=0.5 + k))
        spans.append((len(prompt), len(prompt) + len(answer)))
        prompt += answer + [300 + k] * 4  # the tool's output
    return calls, spans


def test_linear_merge_of_five_turns_gives_one_sample_trained_on_exactly_the_five_answers() -> None:
    calls, spans = conversation(5)
    merged, snaps = merge.merge_linear(calls)
    assert snaps == [] and len(merged) == 1
    sample = merged[0]
    assert sample.token_ids == calls[-1].token_ids and sample.calls == [0, 1, 2, 3, 4]
    trained = [p for p, m in enumerate(sample.loss_mask) if m]
    assert trained == [p for start, end in spans for p in range(start, end)]
    for k, (start, end) in enumerate(spans):
        assert sample.old_logprobs[start:end] == pytest.approx([-0.1 * (k + 1)] * (end - start))
        assert sample.advantages[start:end] == [0.5 + k] * (end - start)
    assert sum(sample.loss_mask) == sum(sum(c.loss_mask) for c in calls)
    assert sample.weights is None and sample.weight == 1.0


def test_a_retried_turn_forks_into_a_second_sample() -> None:
    calls, _ = conversation(3)
    retry = call(
        as_list(calls[1].token_ids)[: as_list(calls[1].loss_mask).index(1)], [999, 998], 3, -2.0, -1.0
    )
    merged, snaps = merge.merge_linear([*calls, retry])
    assert snaps == [] and len(merged) == 2
    main, fork = merged
    assert main.calls == [0, 1, 2] and fork.calls == [3] and fork.token_ids == retry.token_ids


def test_the_same_answer_twice_stays_two_samples_and_is_reported() -> None:
    calls, _ = conversation(2)
    twin = call(as_list(calls[0].token_ids)[:20], as_list(calls[0].token_ids)[20:], 2, -0.5, -1.0)
    merged, snaps = merge.merge_linear([calls[0], twin, calls[1]])
    assert len(merged) == 2 and [s.reason for s in snaps] == [merge.DUPLICATE]
    assert sorted(sum(m.loss_mask) for m in merged) == [3, 3 + 4]  # the twin alone; turns 1 and 2


def test_text_and_token_level_differ_only_where_the_tokenization_differs() -> None:
    """The tiny tokenizer writes <|im_end|> as one special token or as ten characters: same text, other
    ids. Token level keeps the two calls apart; text level merges them and reports that one place."""
    tokenizer = build_tokenizer()
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    prompt = enc("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    first = call(prompt, enc("4+4=8<|im_end|>"), 0, -0.3, 1.0)
    spelled = [tokenizer.convert_tokens_to_ids(ch) for ch in "<|im_end|>"]
    assert decode(spelled) == "<|im_end|>" and len(spelled) == 10
    second_prompt = prompt + enc("4+4=8") + spelled + enc("\n<|im_start|>user\nok<|im_end|>\n")
    second = call(second_prompt, enc("bye<|im_end|>"), 1, -0.2, 1.0)

    by_token, token_snaps = merge.merge_linear([first, second])
    by_text, text_snaps = merge.merge_linear([first, second], level="text", decode=decode)
    assert len(by_token) == 2 and token_snaps == []
    assert len(by_text) == 1 and [s.reason for s in text_snaps] == [merge.TEXT_TRUSTED]
    snap = text_snaps[0]
    assert (snap.call, snap.into, snap.position) == (0, 1, len(first))
    sample = by_text[0]
    assert decode(sample.token_ids) == decode(second.token_ids)
    assert sample.token_ids[: len(first)] == first.token_ids  # the first call's own ids, trained as sampled
    assert sample.token_ids[len(first) :] == second.token_ids[len(prompt) + 5 + 10 :]
    assert sum(sample.loss_mask) == sum(first.loss_mask) + sum(second.loss_mask)


def test_text_level_needs_decode_and_a_known_level() -> None:
    calls, _ = conversation(2)
    with pytest.raises(ValueError, match="needs decode"):
        merge.merge_linear(calls, level="text")
    with pytest.raises(ValueError, match="merge level"):
        merge.merge_linear(calls, level="bytes")


def test_pack_tree_shares_prefixes_once_and_keeps_every_trained_token() -> None:
    calls, _ = conversation(3)
    retry = call(
        as_list(calls[1].token_ids)[: as_list(calls[1].loss_mask).index(1)], [999, 998], 3, -2.0, -1.0
    )
    linear, _ = merge.merge_linear([*calls, retry])
    tree = tree_packing.pack_tree(linear)
    shared = as_list(calls[1].loss_mask).index(1)
    assert len(tree) == len(linear[0]) + 2  # the fork adds only its own answer
    assert len(tree) == len(linear[0]) + len(linear[1]) - shared
    assert sum(tree.loss_mask) == sum(as_list(s.loss_mask).count(1) for s in linear)
    assert tree.calls == [0, 1, 2, 3] and tree.episode_id == "ep"
    # each branch, read along its parents, is exactly its original sequence
    for original in linear:
        leaf = next(
            i
            for i in range(len(tree))
            if _path(tree, i) == original.token_ids and tree.loss_mask[i] == original.loss_mask[-1]
        )
        assert _path(tree, leaf) == original.token_ids


def test_pack_tree_gives_a_token_trained_by_two_sequences_two_branches() -> None:
    a = call([1, 2, 3], [7, 8], 0, -0.1, 1.0)
    b = call([1, 2, 3], [7, 9], 1, -0.2, -1.0)  # sampled 7 as well, then parted
    tree = tree_packing.pack_tree([a, b])
    assert tree.token_ids == [1, 2, 3, 7, 8, 7, 9] and tree.parents == [-1, 0, 1, 2, 3, 2, 5]
    assert tree.advantages == [0, 0, 0, 1.0, 1.0, -1.0, -1.0]


def test_collate_builds_the_ancestor_mask_and_depth_positions() -> None:
    a = call([1, 2, 3], [7, 8], 0, -0.1, 1.0)
    b = call([1, 2, 3], [7, 9], 1, -0.2, -1.0)
    tree, plain = tree_packing.pack_tree([a, b]), call([5, 6], [4], 2, -0.3, 1.0)
    batch = collate([tree, plain], pad_id=0)
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.bool
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 3, 4]
    assert batch["parents"][0].tolist() == tree.parents
    assert mask[0, 0, 6].nonzero().flatten().tolist() == [0, 1, 2, 5, 6]  # not the other branch
    assert mask[0, 0, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert mask[1, 0, 2].nonzero().flatten().tolist() == [0, 1, 2]  # a plain sample stays causal
    assert mask[1, 0, 5].nonzero().flatten().tolist() == [5]  # padding sees itself only
    assert batch["parents"][1].tolist()[:3] == [-1, 0, 1]


def test_samples_reject_inconsistent_tree_fields() -> None:
    with pytest.raises(ValueError, match="earlier position"):
        Sample([1, 2], [0, 0], [0.0, 0.0], [0.0, 0.0], 0, "e", "t", parents=[-1, 1])
    with pytest.raises(ValueError, match="first token"):
        Sample([1, 2], [1, 0], [0.0, 0.0], [0.0, 0.0], 0, "e", "t", parents=[-1, 0])
    with pytest.raises(ValueError, match="weights has 1 entries"):
        Sample([1, 2], [0, 1], [0.0, 0.0], [0.0, 0.0], 0, "e", "t", weights=[1.0])


def _path(tree: Sample, i: int) -> list[int]:
    ids = []
    while i >= 0:
        ids.append(tree.token_ids[i])
        i = as_list(tree.parents)[i]
    return ids[::-1]
