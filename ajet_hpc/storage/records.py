"""The records a server store holds, and their encoding onto its layout (:mod:`ajet_hpc.storage.h5_layout`).

An :class:`EpisodeRecord` (a closed episode: its timelines, reward, metadata) or a :class:`StepRecord` (a
training step: its metrics row and samples) becomes an :class:`Append` before the store's file is touched:
the new rows of each table, the lengths behind each offsets dataset, and the values of each column, as the
writer (:mod:`ajet_hpc.storage.episode_store_writer`) lays them out. What each row, offset and column holds:
docs/storage.md, "Server store".
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ajet_hpc.algo.sample_tensors import binary_runs
from ajet_hpc.storage.h5_layout import ROWS
from ajet_hpc.tracking.episode import EpisodeState

if TYPE_CHECKING:
    from ajet_hpc.algo.sample_tensors import Sample
    from ajet_hpc.tracking.episode import EpisodeData
    from ajet_hpc.tracking.timeline import Timeline

CLOSED_STATES = EpisodeState.closed()
"""The states of an episode that can be stored (finished, aborted, dropped)."""


@dataclass
class EpisodeRecord:
    """What the server hands over when an episode closes (and what the reader gives back)."""

    episode_id: str
    model: str
    task_id: str | None
    group: str | None
    state: str  # finished / aborted / dropped
    reward: float | None
    turn_rewards: list[float] | None
    reason: str | None
    metadata: dict[str, Any]
    started_at: float
    ended_at: float
    timelines: list[Timeline]

    @classmethod
    def from_episode(cls, episode: EpisodeData) -> EpisodeRecord:
        """From a closed :class:`~ajet_hpc.server.episodes.Episode`; cheap (timelines shared, not copied)."""
        return cls(
            episode_id=episode.episode_id,
            model=episode.model,
            task_id=episode.task_id,
            group=episode.group,
            state=episode.state,
            reward=episode.reward,
            turn_rewards=list(episode.turn_rewards) if episode.turn_rewards is not None else None,
            reason=episode.reason,
            metadata=dict(episode.metadata),
            started_at=episode.started_at,
            ended_at=episode.ended_at if episode.ended_at is not None else time.time(),
            timelines=list(episode.timelines),
        )


@dataclass
class StepRecord:
    """One training step: its metrics row and the samples of its batch."""

    step: int
    metrics: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)


@dataclass
class Append:
    """One append, encoded before the file is touched: elements per space, rows, offsets, column values."""

    counts: dict[str, int]
    rows: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]  # offsets dataset -> length of each new row in its target space
    columns: dict[str, np.ndarray]


def join_appends(appends: list[Append], *, columns: bool = True) -> Append:
    """Several appends as one (a commit group): counts summed, rows, offsets' lengths and (unless
    ``columns`` is False: the writer stages them record by record) column values concatenated in order.
    Episodes and steps may be mixed (their spaces are disjoint)."""
    if len(appends) == 1 and columns:
        return appends[0]
    counts: dict[str, int] = {}
    rows: dict[str, list[np.ndarray]] = {}
    lengths: dict[str, list[np.ndarray]] = {}
    values: dict[str, list[np.ndarray]] = {}
    for append in appends:
        for space, n in append.counts.items():
            counts[space] = counts.get(space, 0) + n
        parts = [(rows, append.rows), (lengths, append.lengths)] + [(values, append.columns)] * columns
        for out, part in parts:
            for name, array in part.items():
                out.setdefault(name, []).append(array)
    return Append(
        counts=counts,
        rows={name: _concat_rows(parts) for name, parts in rows.items()},
        lengths={name: np.concatenate(parts) for name, parts in lengths.items()},
        columns={name: np.concatenate(parts) for name, parts in values.items()},
    )


def _concat_rows(parts: list[np.ndarray]) -> np.ndarray:
    """``np.concatenate(parts)`` for tables of one structured dtype (every record's rows have the table's
    dtype), through their bytes: numpy promotes structured dtypes pair by pair, which made joining a group
    of 64 episodes' rows cost more than writing them."""
    dtype = parts[0].dtype
    if all(p.dtype == dtype for p in parts):
        return np.frombuffer(b"".join(np.ascontiguousarray(p).tobytes() for p in parts), dtype)
    return np.concatenate(parts)


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=lambda v: _plain(v))
_FAST_ENCODER = msgspec.json.Encoder()
_FAST_DECODER = msgspec.json.Decoder()


def _json(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON. Plain JSON data (strings, ints, finite floats, bools, None, lists,
    dicts with string keys) goes through msgspec's encoder, 5-7x faster than ``json`` on an episode's
    messages (the largest part of its encoding), and is kept only if it reads back equal to ``value``;
    anything else (NaN or infinite floats, which msgspec writes as null; tuples; numpy values; other
    objects) is encoded by ``json``, as before: ``NaN`` and ``Infinity`` literals, numpy values as lists
    and numbers, a TypeError for what JSON cannot hold. Either way ``json.loads`` gives back the same
    values; only the spelling of some floats differs (``0.00001`` for ``1e-05``)."""
    try:
        text = _FAST_ENCODER.encode(value)
    except Exception:  # whatever msgspec refuses, json decides (and raises its own error)
        text = None
    if text is not None and _FAST_DECODER.decode(text) == value:
        return text
    return _ENCODER.encode(value).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _cat(parts: list[Any], dtype: Any) -> np.ndarray:
    """``parts`` (lists or arrays) as one array of ``dtype``. Lists of token ids, masks and authors take a
    C path (``struct.pack`` / ``bytes``, 2-3x faster than numpy's conversion of Python ints, the largest
    part of an episode's encoding); anything that path would read differently (floats, negative or large
    values) falls back to numpy, so the result is numpy's either way."""
    if parts and all(type(p) is list for p in parts):
        with contextlib.suppress(struct.error, TypeError, ValueError, OverflowError):
            if np.dtype(dtype) == np.int32:
                n = sum(map(len, parts))  # raises on floats (numpy would truncate them) and on overflow:
                return np.frombuffer(struct.pack(f"<{n}i", *itertools.chain.from_iterable(parts)), np.int32)
            if np.dtype(dtype) == np.int8:
                joined = b"".join(map(bytes, parts))  # raises outside 0..255, on floats
                if joined.isascii():  # 128..255 would read back negative: numpy's call
                    return np.frombuffer(joined, np.int8)
    return np.concatenate([np.asarray(p, dtype) for p in parts]) if parts else np.zeros(0, dtype)


def _loss_mask(timelines: list[Any], lengths: list[int]) -> np.ndarray:
    """The timelines' loss masks as one int8 array. A mask of 0s and 1s is written from its runs of 1s
    (``binary_runs``: a call's mask, 0s then its answer's 1s, is found by one C count and one comparison)
    instead of converting every entry (about a tenth of an episode's encoding); any other mask is converted
    entry by entry, as before. The values are numpy's either way (an entry equal to 1, such as ``True``
    or ``1.0``, is 1 in numpy's int8 too)."""
    out = np.zeros(sum(lengths), np.int8)
    for start, t in zip(itertools.accumulate(lengths, initial=0), timelines, strict=False):
        runs = binary_runs(t.loss_mask) if type(t.loss_mask) is list else None
        if runs is None:
            return _cat([t.loss_mask for t in timelines], np.int8)
        for a, b in runs:
            out[start + a : start + b] = 1
    return out


def _timeline_json(timelines: list[Any]) -> list[bytes]:
    """The JSON record of each timeline: its messages, tools, finish reason, drift and reused spans, and its
    version spans where it has them (a key files written before it lack)."""
    return [_json(_timeline_record(t)) for t in timelines]


def _timeline_record(t: Any) -> dict[str, Any]:
    record = {
        "messages": t.messages,
        "tools": t.tools,
        "finish_reason": t.finish_reason,
        "drift": [{"message_index": d.message_index, "kind": d.kind, "detail": d.detail} for d in t.drift],
        "reused_spans": [[int(a), int(b)] for a, b in t.reused_spans],
    }
    if t.version_spans:
        record["version_spans"] = [[int(x) for x in span] for span in t.version_spans]
    return record


def id_hash(episode_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(episode_id.encode(), digest_size=8).digest(), "little")


def encode_episode(record: EpisodeRecord) -> Append:
    """An episode as rows, offsets and column values (raises ValueError / TypeError if it cannot be)."""
    if record.state not in CLOSED_STATES:
        raise ValueError(
            f"state {record.state!r}: only closed episodes ({', '.join(CLOSED_STATES)}) are stored"
        )
    timelines = record.timelines
    prompt = [len(t.prompt_ids) for t in timelines]
    lengths = [p + len(t.response_ids) for p, t in zip(prompt, timelines, strict=True)]
    for i, (t, n) in enumerate(zip(timelines, lengths, strict=True)):
        if (
            len(t.token_authors) != n
            or len(t.loss_mask) != n
            or len(t.response_logprobs) != len(t.response_ids)
        ):
            raise ValueError(f"timeline {i} has authors, loss mask or logprobs of the wrong length")
    logprobs = np.zeros(sum(lengths), np.float32)
    for start, p, n, t in zip(
        itertools.accumulate(lengths, initial=0), prompt, lengths, timelines, strict=False
    ):
        logprobs[start + p : start + n] = t.response_logprobs
    timeline_json = _timeline_json(timelines)
    episode_json = _json(
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
            "tokens": _cat([x for t in timelines for x in (t.prompt_ids, t.response_ids)], np.int32),
            "logprobs": logprobs,
            "loss_mask": _loss_mask(timelines, lengths),
            "authors": _cat([t.token_authors for t in timelines], np.int8),
            "episode_json": np.frombuffer(episode_json, np.uint8),
            "timeline_json": np.frombuffer(joined, np.uint8),
        },
    )


def sample_extras(sample: Sample) -> dict:
    """What a sample's JSON record holds besides its token columns (optional keys only when set)."""
    extras: dict = {"episode_id": sample.episode_id, "task_id": sample.task_id, "calls": list(sample.calls)}
    if sample.weights is not None:
        extras["weights"] = list(sample.weights)
    if sample.parents is not None:
        extras["parents"] = list(sample.parents)
    return extras


def encode_step(record: StepRecord) -> Append:
    """A training step as rows, offsets and column values."""
    samples = record.samples
    lengths = np.array([len(s.token_ids) for s in samples], np.int64)
    for i, (s, n) in enumerate(zip(samples, lengths.tolist(), strict=True)):
        if not len(s.loss_mask) == len(s.advantages) == len(s.old_logprobs) == n:
            raise ValueError(f"sample {i} has loss mask, advantages or old logprobs of the wrong length")
    sample_json = [_json(sample_extras(s)) for s in samples]
    step_json = _json({"metrics": record.metrics})
    joined = b"".join(sample_json)
    return Append(
        counts={
            "steps": 1,
            "samples": len(samples),
            "sample_tokens": int(lengths.sum()),
            "step_json": len(step_json),
            "sample_json": len(joined),
        },
        rows={
            "steps": np.array([(int(record.step),)], ROWS["steps"]),
            "samples": np.array([(s.policy_version, s.weight) for s in samples], ROWS["samples"]),
        },
        lengths={
            "step_sample_offsets": np.array([len(samples)]),
            "step_json_offsets": np.array([len(step_json)]),
            "sample_token_offsets": lengths,
            "sample_json_offsets": np.array([len(j) for j in sample_json], np.int64),
        },
        columns={
            "sample_tokens": _cat([s.token_ids for s in samples], np.int32),
            "sample_loss_mask": _cat([s.loss_mask for s in samples], np.int8),
            "sample_advantages": _cat([s.advantages for s in samples], np.float32),
            "sample_old_logprobs": _cat([s.old_logprobs for s in samples], np.float32),
            "step_json": np.frombuffer(step_json, np.uint8),
            "sample_json": np.frombuffer(joined, np.uint8),
        },
    )
