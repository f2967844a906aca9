"""The episode encoder (``records.encode_episode``) against the slow reference it replaced (issue 17: the
recorder's CPU time). The reference (the encoder as of 2026-11-30: ``json`` for every JSON record) is kept
here, and random episodes, built to hit what could go wrong (values equal under ``==`` but not in JSON: 1,
1.0, True; 0.0 and -0.0; dict keys in another order; shared and copied objects; NaN and infinities, which
msgspec would write as null; tuples, numpy values, str subclasses; floats msgspec spells otherwise; text
outside ASCII), must encode to the same columns: rows, offsets and token columns byte for byte, each JSON
record to a text that reads back as exactly the reference's (same types, float bits, key order), or fail
with the same exception type."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
from typing import Any

import numpy as np
import pytest

from ajet_hpc.storage.h5_layout import ROWS
from ajet_hpc.storage.records import Append, EpisodeRecord, encode_episode, id_hash
from ajet_hpc.tracking.timeline import DriftEvent, Timeline


# ------------------------------------------------------------------ the reference: the old encoder
def _ref_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=_ref_plain).encode()


def _ref_plain(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _ref_cat(parts: list[Any], dtype: Any) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype) for p in parts]) if parts else np.zeros(0, dtype)


def reference_encode(record: EpisodeRecord) -> Append:
    timelines = record.timelines
    prompt = [len(t.prompt_ids) for t in timelines]
    lengths = [p + len(t.response_ids) for p, t in zip(prompt, timelines, strict=True)]
    logprobs = np.zeros(sum(lengths), np.float32)
    for start, p, n, t in zip(np.cumsum([0, *lengths]).tolist(), prompt, lengths, timelines, strict=False):
        logprobs[start + p : start + n] = t.response_logprobs
    timeline_json = [
        _ref_json(
            {
                "messages": t.messages,
                "tools": t.tools,
                "finish_reason": t.finish_reason,
                "drift": [
                    {"message_index": d.message_index, "kind": d.kind, "detail": d.detail} for d in t.drift
                ],
                "reused_spans": [[int(a), int(b)] for a, b in t.reused_spans],
                **({"version_spans": [list(span) for span in t.version_spans]} if t.version_spans else {}),
            }
        )
        for t in timelines
    ]
    episode_json = _ref_json(
        {
            "episode_id": record.episode_id,
            "model": record.model,
            "task_id": record.task_id,
            "group": record.group,
            "state": record.state,
            "reason": record.reason,
            "metadata": record.metadata,
            "turn_rewards": record.turn_rewards,
        }
    )
    reward = math.nan if record.reward is None else float(record.reward)
    episode_row = np.array(
        [(reward, record.started_at, record.ended_at, id_hash(record.episode_id))], ROWS["episodes"]
    )
    timeline_rows = np.array(
        [
            (p, len(t.drift), t.policy_version, t.started_at, t.finished_at)
            for p, t in zip(prompt, timelines, strict=True)
        ],
        ROWS["timelines"],
    )
    joined = b"".join(timeline_json)
    return Append(
        counts={
            "episodes": 1,
            "timelines": len(timelines),
            "tokens": len(logprobs),
            "episode_json": len(episode_json),
            "timeline_json": len(joined),
        },
        rows={"episodes": episode_row, "timelines": timeline_rows},
        lengths={
            "episode_timeline_offsets": np.array([len(timelines)]),
            "episode_json_offsets": np.array([len(episode_json)]),
            "timeline_offsets": np.array(lengths, np.int64),
            "timeline_json_offsets": np.array([len(j) for j in timeline_json], np.int64),
        },
        columns={
            "tokens": _ref_cat([x for t in timelines for x in (t.prompt_ids, t.response_ids)], np.int32),
            "logprobs": logprobs,
            "loss_mask": _ref_cat([t.loss_mask for t in timelines], np.int8),
            "authors": _ref_cat([t.token_authors for t in timelines], np.int8),
            "episode_json": np.frombuffer(episode_json, np.uint8),
            "timeline_json": np.frombuffer(joined, np.uint8),
        },
    )


# ------------------------------------------------------------------------------- random episodes
_TRICKY = [
    1, 1.0, True, 0, 0.0, -0.0, False, None, math.nan, math.inf, -math.inf, "1", "ünïcødé ✓", [1], (1,),
    {"a": 1}, 2**40, 2**70, 1e-05, 0.1, 1e22, 5e-324, 1.7976931348623157e308, "\u2028\x7f\x1f\"\\/",
]  # fmt: skip


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.random()
    if depth > 2 or kind < 0.5:
        return rng.choice(_TRICKY)
    if kind < 0.75:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys = rng.sample(["a", "b", "c", "d"], rng.randint(0, 4))
    return {k: _value(rng, depth + 1) for k in keys}


def _message(rng: random.Random, i: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": rng.choice(["user", "assistant", "tool"]), "content": f"text {i} ✓"}
    if rng.random() < 0.4:
        message["tool_calls"] = [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}
        ]
    if rng.random() < 0.3:
        message["extra"] = _value(rng)
    return message


def _variant(rng: random.Random, message: dict[str, Any]) -> dict[str, Any]:
    """The message again as the next call may send it: the same object, a copy, or a copy that differs
    in a way only JSON sees (a number's type, a key order) or in content."""
    roll = rng.random()
    if roll < 0.3:
        return message
    out = copy.deepcopy(message)
    if roll < 0.5:
        return out
    if roll < 0.6:
        return dict(reversed(list(out.items())))
    if roll < 0.8:
        out["extra"] = rng.choice(_TRICKY)
        return out
    out["content"] = out["content"] + "!"
    return out


def _tools(x: Any, *, reverse: bool = False) -> list[dict[str, Any]]:
    function: dict[str, Any] = {"name": "f", "parameters": {"x": x, "y": "ünïcødé ✓"}}
    if reverse:
        function["parameters"] = dict(reversed(list(function["parameters"].items())))
    return [{"type": "function", "function": function}]


class _Text(str):
    """A str subclass: encoded as its text, but not a plain value for the tools cache."""


# Tools lists that differ only where JSON sees it (1, 1.0, True; 0.0 and -0.0; key order; numpy and str
# subclass values): the encoder reuses the text of the last tools list encoded when it is the same.
_TOOLS = [
    None,
    [],
    *(_tools(x) for x in _TRICKY),
    _tools(1, reverse=True),
    _tools(np.int64(1)),
    _tools(np.float64(1.0)),
    _tools(np.float32(0.5)),
    _tools(_Text("1")),
    np.array([1, 2]),  # (no truth value: encoded through the encoder's default, as before)
]


def random_record(rng: random.Random, index: int) -> EpisodeRecord:
    tools_pool = _TOOLS
    tools = rng.choice(tools_pool)
    messages: list[dict[str, Any]] = []
    timelines = []
    for turn in range(rng.randint(0, 5)):
        messages = [_variant(rng, m) for m in messages]
        if rng.random() < 0.1 and messages:
            messages = messages[1:]  # a summarised history: positions shift
        messages.append(_message(rng, turn))
        prompt = [rng.randrange(0, 1 << 20) for _ in range(rng.randint(0, 30))]
        response = [rng.randrange(0, 1 << 20) for _ in range(rng.randint(0, 10))]
        n = len(prompt) + len(response)
        tools = rng.choice([tools, copy.deepcopy(tools), rng.choice(tools_pool)])
        timelines.append(
            Timeline(
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=[-rng.random() for _ in response],
                token_authors=[rng.randrange(0, 4) for _ in range(n)],
                loss_mask=[0] * len(prompt) + [1] * len(response)
                if rng.random() < 0.8
                else [rng.choice([0, 1, 1.0, True, False]) for _ in range(n)],  # type: ignore[misc]  # any spelling
                messages=messages if rng.random() < 0.8 else copy.deepcopy(messages),
                tools=tools,  # type: ignore[arg-type]  # an ndarray among them, under test
                policy_version=rng.randrange(5),
                finish_reason=rng.choice(["stop", "tool_calls", "length"]),
                drift=[DriftEvent(0, "template", "d")] if rng.random() < 0.2 else [],
                reused_spans=[(0, len(prompt))] if rng.random() < 0.5 else [],
                started_at=rng.random(),
                finished_at=rng.random(),
                version_spans=[(1, 0, 1), (2, 1, len(response))]
                if len(response) > 1 and rng.random() < 0.2
                else [],
            )
        )
    return EpisodeRecord(
        episode_id=f"ep-{index}",
        model="policy",
        task_id=rng.choice([None, "t"]),
        group=None,
        state="finished",
        reward=rng.choice([None, 1.0, 0.5]),
        turn_rewards=None,
        reason=None,
        metadata={"k": _value(rng)},
        started_at=1.0,
        ended_at=2.0,
        timelines=timelines,
    )


_JSON_COLUMNS = {"episode_json": "episode_json_offsets", "timeline_json": "timeline_json_offsets"}


def _records(append: Append, column: str) -> list[str]:
    """Each JSON record of ``column``, read back with ``json`` and written as its ``repr``: equal only for
    the same types (1, 1.0, True), float bits (0.0, -0.0; nan is nan), key order."""
    data, bounds = append.columns[column].tobytes(), [0, *np.cumsum(append.lengths[_JSON_COLUMNS[column]])]
    return [repr(json.loads(data[a:b])) for a, b in itertools.pairwise(bounds)]


def _same(a: Append, b: Append) -> None:
    assert a.counts.keys() == b.counts.keys()
    for part in ("rows", "lengths", "columns"):
        x, y = getattr(a, part), getattr(b, part)
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].dtype == y[name].dtype, (part, name)
            if name not in _JSON_COLUMNS and name not in _JSON_COLUMNS.values():  # (spelling may differ)
                assert x[name].tobytes() == y[name].tobytes(), (part, name)
    for column in _JSON_COLUMNS:
        assert _records(a, column) == _records(b, column), column
    assert {k: v for k, v in a.counts.items() if k not in _JSON_COLUMNS} == {
        k: v for k, v in b.counts.items() if k not in _JSON_COLUMNS
    }


def test_encoder_matches_reference_on_random_episodes() -> None:
    rng = random.Random(17)
    for index in range(400):
        record = random_record(rng, index)
        _same(encode_episode(record), reference_encode(record))


@pytest.mark.parametrize(
    "odd",
    [[1.5], [2**31], [-1], [300], ["x"], [object()], [2], [True], [1.0]],
    ids=["float", "int32 overflow", "negative", "over int8", "str", "object", "two", "bool", "one as float"],
)
def test_encoder_fails_or_converts_as_reference(odd: list[Any]) -> None:
    """Token ids, masks and authors the fast conversion cannot take go through numpy, as before: the same
    array or the same exception type."""
    rng = random.Random(5)
    for field in ("prompt_ids", "token_authors", "loss_mask"):
        record = random_record(rng, 0)
        while not record.timelines:
            record = random_record(rng, 0)
        timeline = record.timelines[-1]
        setattr(timeline, field, getattr(timeline, field) + odd)
        if field == "prompt_ids":  # keep the lengths consistent: one more token everywhere
            timeline.token_authors += [0]
            timeline.loss_mask += [0]
        else:
            other = "loss_mask" if field == "token_authors" else "token_authors"
            timeline.prompt_ids += [7]
            setattr(timeline, other, [*getattr(timeline, other), 0])
        try:
            expected = reference_encode(record)
        except Exception as exc:  # the type is what is compared
            with pytest.raises(type(exc)):
                encode_episode(record)
        else:
            _same(encode_episode(record), expected)
