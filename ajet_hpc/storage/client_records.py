"""The result a client store holds, and its encoding: one canonical JSON payload per result, the same bytes
in the journal (:mod:`ajet_hpc.storage.client_store_journal`) and, as a crc32, in the HDF5 view's row
(:mod:`ajet_hpc.storage.client_store_view`). The store itself: :mod:`ajet_hpc.storage.client_store`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Result:
    task_id: str
    repeat: int
    reward: float
    rewards: dict[str, float]
    episode_ids: dict[str, str]
    transcript: str | None
    metadata: dict
    finished_at: float

    @property
    def key(self) -> tuple[str, int]:
        return (self.task_id, self.repeat)


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _record(result: Result) -> dict[str, Any]:
    if not isinstance(result.task_id, str):
        raise TypeError(f"task_id must be a str, not {type(result.task_id).__name__}")
    if isinstance(result.repeat, bool) or not isinstance(result.repeat, int | np.integer):
        raise TypeError(f"repeat must be an int, not {type(result.repeat).__name__}")
    if result.transcript is not None and not isinstance(result.transcript, str):
        raise TypeError(f"transcript must be a str or None, not {type(result.transcript).__name__}")
    if not isinstance(result.metadata, dict):
        raise TypeError(f"metadata must be a dict, not {type(result.metadata).__name__}")
    return {
        "kind": "result",
        "task_id": result.task_id,
        "repeat": int(result.repeat),
        "reward": float(result.reward),
        "rewards": {str(name): float(value) for name, value in result.rewards.items()},
        "episode_ids": {str(name): str(value) for name, value in result.episode_ids.items()},
        "transcript": result.transcript,
        "metadata": result.metadata,
        "finished_at": float(result.finished_at),
    }


def result_from_record(record: dict[str, Any]) -> Result:
    return Result(
        task_id=record["task_id"],
        repeat=int(record["repeat"]),
        reward=float(record["reward"]),
        rewards={str(k): float(v) for k, v in record["rewards"].items()},
        episode_ids={str(k): str(v) for k, v in record["episode_ids"].items()},
        transcript=record["transcript"],
        metadata=dict(record["metadata"]),
        finished_at=float(record["finished_at"]),
    )


def result_payload(result: Result) -> bytes:
    return canonical(_record(result)).encode("utf-8")


def normalized(result: Result) -> tuple[Result, bytes]:
    """The result exactly as it reads back after a reopen, and its journal payload (TypeError/ValueError
    for a result that cannot be stored: nothing is written then)."""
    stored = result_from_record(json.loads(result_payload(result)))
    return stored, result_payload(stored)  # canonical form of what reads back (int dict keys became str...)


def unstorable_reason(result: Result) -> str | None:
    """Why ``result`` cannot be committed (a value that is no JSON, text with a lone surrogate, which UTF-8
    and so the journal cannot hold), naming where; None when it can. Checked before an episode ends, so
    that such a result aborts its episode at once instead of failing its commit afterwards."""
    try:
        normalized(result)
    except (TypeError, ValueError) as exc:
        where = _surrogate_path({"metadata": result.metadata, "transcript": result.transcript})
        if where is not None:
            return f"{where} holds a lone surrogate, which is not valid Unicode and cannot be stored"
        return f"{type(exc).__name__}: {exc}"
    return None


def _surrogate_path(value: Any, path: str = "outcome") -> str | None:
    if isinstance(value, str):
        return path if any("\ud800" <= ch <= "\udfff" for ch in value) else None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, child in items:
        if isinstance(key, str) and _surrogate_path(key) is not None:
            return f"{path} (the key {key!r})"
        found = _surrogate_path(child, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]")
        if found is not None:
            return found
    return None
