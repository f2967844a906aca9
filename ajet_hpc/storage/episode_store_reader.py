"""The server store's reader: the episodes, summaries and training steps in RUN/data/<model>.h5, read back.

Any number of readers (:class:`EpisodeReader`, one per thread), also while the server's writer
(:mod:`ajet_hpc.storage.episode_store_writer`) appends: the file is in HDF5 SWMR mode. A reader sees only
what the ``commit`` counter (:mod:`ajet_hpc.storage.episode_store_commit`) covers, and ``refresh()`` picks
up what was committed since; a range read from a tail slot that was reused meanwhile is read again from its
column. Read-only: it never writes to the file, and reads a store whose writer failed or was killed through
a repaired read-only view. The records it gives back: :mod:`ajet_hpc.storage.records`; the layout:
:mod:`ajet_hpc.storage.h5_layout`, docs/storage.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.storage.episode_store_commit import SPACE_INDEX, read_commit
from ajet_hpc.storage.h5_layout import (
    OFFSETS,
    ROWS,
    SEALED,
    SPACES,
    TAIL,
    StoreError,
    open_for_read,
    open_uncached,
)
from ajet_hpc.storage.h5_sealed_columns import SealedReader
from ajet_hpc.storage.records import EpisodeRecord, id_hash
from ajet_hpc.tracking.timeline import DriftEvent, Timeline

__all__ = ["EpisodeReader"]

_BATCH = 8192  # episodes / steps parsed per read when building summaries


class EpisodeReader:
    """Reads a store, also while its writer appends: ``refresh()`` picks up what was committed since.

    Sees only committed episodes and steps. Random access by id is a hash lookup (the id map is extended
    on use after each refresh). Not thread-safe: one reader per thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file = open_for_read(self.path)
        try:
            f = self._file
            chunk_tokens = int(f.attrs["chunk_tokens"])
            self._commit = open_uncached(f, "commit")
            self._sealed_ds = open_uncached(f, "sealed")
            self._data = {name: f[name] for name in (*ROWS, *OFFSETS)}
            self._columns = {
                name: SealedReader(f[name], open_uncached(f, f"{TAIL}/{name}"), space, chunk_tokens)
                for name, (_, space) in SEALED.items()
            }
        except BaseException:
            self._file.close()
            raise
        self._counts = np.zeros(len(SPACES), np.int64)
        self._seals = np.zeros(len(SPACES), np.int64)
        self._ids: dict[int, int] = {}  # 64-bit hash of the id -> index of its latest record
        self._indexed = 0
        self._summaries: list[dict[str, Any]] = []
        self._steps: list[dict[str, Any]] = []
        self.refresh()

    def refresh(self) -> None:
        """See everything committed up to now."""
        counts = read_commit(self._commit, self.path)
        if (counts < self._counts).any():
            raise StoreError(f"{self.path}: the commit counter went backwards; the file was replaced")
        self._seals = self._read_seals()
        for ds in self._data.values():
            ds.refresh()
        self._counts = counts

    def _read_seals(self) -> np.ndarray:
        self._sealed_ds.refresh()
        return self._sealed_ds[:]

    def _n(self, space: str) -> int:
        return int(self._counts[SPACE_INDEX[space]])

    def __len__(self) -> int:
        return self._n("episodes")

    def _read(self, requests: list[tuple[str, int, int]]) -> list[np.ndarray]:
        """Ranges of sealed columns. A range read from a tail slot is read again from the column when the
        ``sealed`` counter shows its chunk sealed meanwhile (the slot may have been reused)."""
        out: list[np.ndarray] = [np.zeros(0)] * len(requests)
        todo = list(range(len(requests)))
        while todo:
            from_tail: dict[int, int] = {}
            for i in todo:
                name, start, stop = requests[i]
                column = self._columns[name]
                out[i], chunk = column.read(
                    int(start), int(stop), int(self._seals[SPACE_INDEX[column.space]])
                )
                if chunk is not None:
                    from_tail[i] = chunk
            if not from_tail:
                break
            self._seals = self._read_seals()
            todo = [
                i
                for i, k in from_tail.items()
                if self._seals[SPACE_INDEX[self._columns[requests[i][0]].space]] > k
            ]
        return out

    # --------------------------------------------------------------------------------------- episodes
    def episode(self, episode_id: str) -> EpisodeRecord:
        """The full record of ``episode_id`` (the latest one if it was stored twice)."""
        n = len(self)
        if self._indexed < n:
            hashes = self._data["episodes"].fields("id_hash")[self._indexed : n]
            self._ids.update(zip(hashes.tolist(), range(self._indexed, n), strict=True))
            self._indexed = n
        index = self._ids.get(id_hash(episode_id))
        if index is not None:
            record = self._episode_at(index)
            if record.episode_id == episode_id:
                return record
            # Two ids with the same 64-bit hash: look the id up among all of them.
            matches = [s["index"] for s in self.summaries() if s["episode_id"] == episode_id]
            if matches:
                return self._episode_at(matches[-1])
        raise KeyError(f"{self.path}: no episode {episode_id!r} among its {n} committed episodes")

    def _episode_at(self, index: int) -> EpisodeRecord:
        d = self._data
        (t0, t1), (j0, j1) = (
            d["episode_timeline_offsets"][index : index + 2],
            d["episode_json_offsets"][index : index + 2],
        )
        row, rows = d["episodes"][index], d["timelines"][t0:t1]
        tok_off, json_off = d["timeline_offsets"][t0 : t1 + 1], d["timeline_json_offsets"][t0 : t1 + 1]
        tokens, logprobs, mask, authors, tjson, ejson = self._read(
            [
                *((name, tok_off[0], tok_off[-1]) for name in ("tokens", "logprobs", "loss_mask", "authors")),
                ("timeline_json", json_off[0], json_off[-1]),
                ("episode_json", j0, j1),
            ]
        )
        tok_off, json_off, ttext = tok_off - tok_off[0], json_off - json_off[0], tjson.tobytes()
        timelines = []
        for i, trow in enumerate(rows):
            a, p, b = int(tok_off[i]), int(tok_off[i]) + int(trow["prompt_len"]), int(tok_off[i + 1])
            extra = json.loads(ttext[json_off[i] : json_off[i + 1]])
            timelines.append(
                Timeline(
                    prompt_ids=tokens[a:p].tolist(),
                    response_ids=tokens[p:b].tolist(),
                    response_logprobs=logprobs[p:b].tolist(),
                    token_authors=authors[a:b].tolist(),
                    loss_mask=mask[a:b].tolist(),
                    messages=extra["messages"],
                    tools=extra["tools"],
                    policy_version=int(trow["policy_version"]),
                    finish_reason=extra["finish_reason"],
                    drift=[DriftEvent(**event) for event in extra["drift"]],
                    reused_spans=[(int(s), int(e)) for s, e in extra["reused_spans"]],
                    started_at=float(trow["started_at"]),
                    finished_at=float(trow["finished_at"]),
                    version_spans=[(int(v), int(s), int(e)) for v, s, e in extra.get("version_spans", ())],
                )
            )
        meta = json.loads(ejson.tobytes())
        return EpisodeRecord(
            episode_id=meta["episode_id"],
            model=meta["model"],
            task_id=meta["task_id"],
            group=meta["group"],
            state=meta["state"],
            reward=None if math.isnan(row["reward"]) else float(row["reward"]),
            turn_rewards=meta["turn_rewards"],
            reason=meta["reason"],
            metadata=meta["metadata"],
            started_at=float(row["started_at"]),
            ended_at=float(row["ended_at"]),
            timelines=timelines,
        )

    def summaries(self) -> list[dict[str, Any]]:
        """One dict per committed episode, in store order, without token data."""
        while len(self._summaries) < len(self):
            self._summaries += self._summarize(
                len(self._summaries), min(len(self), len(self._summaries) + _BATCH)
            )
        return [dict(s) for s in self._summaries]

    def _summarize(self, m: int, n: int) -> list[dict[str, Any]]:
        d = self._data
        rows, eto, ejo = (
            d["episodes"][m:n],
            d["episode_timeline_offsets"][m : n + 1],
            d["episode_json_offsets"][m : n + 1],
        )
        t0 = int(eto[0])
        trows, toff = d["timelines"][t0 : eto[-1]], d["timeline_offsets"][t0 : eto[-1] + 1]
        drift = np.concatenate([[0], np.cumsum(trows["n_drift"])])
        versions = trows["policy_version"].tolist()
        (ejson,) = self._read([("episode_json", ejo[0], ejo[-1])])
        etext, ejo = ejson.tobytes(), ejo - ejo[0]
        out = []
        for i in range(n - m):
            meta = json.loads(etext[ejo[i] : ejo[i + 1]])
            a, b = int(eto[i]) - t0, int(eto[i + 1]) - t0
            reward = float(rows["reward"][i])
            out.append(
                {
                    "index": m + i,
                    "episode_id": meta["episode_id"],
                    "task_id": meta["task_id"],
                    "group": meta["group"],
                    "state": meta["state"],
                    "reward": None if math.isnan(reward) else reward,
                    "turn_rewards": meta["turn_rewards"],
                    "calls": b - a,
                    "tokens": int(toff[b] - toff[a]),
                    "drift": int(drift[b] - drift[a]),
                    "policy_versions": sorted(set(versions[a:b])),
                    "started_at": float(rows["started_at"][i]),
                    "ended_at": float(rows["ended_at"][i]),
                    "reason": meta["reason"],
                    "metadata": meta["metadata"],
                }
            )
        return out

    # ------------------------------------------------------------------------------------------ steps
    def steps(self) -> list[dict[str, Any]]:
        """Per recorded step, in order: step, metrics, n_samples, episode_ids (distinct, in batch order)."""
        d, n = self._data, self._n("steps")
        if len(self._steps) < n:
            m = len(self._steps)
            rows, sso, sjo = (
                d["steps"][m:n],
                d["step_sample_offsets"][m : n + 1],
                d["step_json_offsets"][m : n + 1],
            )
            sample_off = d["sample_json_offsets"][sso[0] : sso[-1] + 1]
            sjson, ajson = self._read(
                [("step_json", sjo[0], sjo[-1]), ("sample_json", sample_off[0], sample_off[-1])]
            )
            stext, atext, sjo, sample_off = (
                sjson.tobytes(),
                ajson.tobytes(),
                sjo - sjo[0],
                sample_off - sample_off[0],
            )
            for i in range(n - m):
                a, b = int(sso[i] - sso[0]), int(sso[i + 1] - sso[0])
                ids = [
                    json.loads(atext[sample_off[k] : sample_off[k + 1]])["episode_id"] for k in range(a, b)
                ]
                self._steps.append(
                    {
                        "index": m + i,
                        "step": int(rows["step"][i]),
                        "metrics": json.loads(stext[sjo[i] : sjo[i + 1]])["metrics"],
                        "n_samples": b - a,
                        "episode_ids": list(dict.fromkeys(ids)),
                    }
                )
        return [dict(s) for s in self._steps]

    def step_samples(self, step: int) -> list[Sample]:
        """The samples of training step ``step`` (its latest record, if a resumed run recorded it twice)."""
        found = [s["index"] for s in self.steps() if s["step"] == step]
        if not found:
            raise KeyError(f"{self.path}: no step {step} among its {self._n('steps')} recorded steps")
        d, index = self._data, found[-1]
        s0, s1 = (int(x) for x in d["step_sample_offsets"][index : index + 2])
        rows, tok_off, json_off = (
            d["samples"][s0:s1],
            d["sample_token_offsets"][s0 : s1 + 1],
            d["sample_json_offsets"][s0 : s1 + 1],
        )
        names = ("sample_tokens", "sample_loss_mask", "sample_advantages", "sample_old_logprobs")
        tokens, mask, advantages, old, ajson = self._read(
            [*((name, tok_off[0], tok_off[-1]) for name in names), ("sample_json", json_off[0], json_off[-1])]
        )
        tok_off, json_off, atext = tok_off - tok_off[0], json_off - json_off[0], ajson.tobytes()
        samples = []
        for i, row in enumerate(rows):
            a, b = int(tok_off[i]), int(tok_off[i + 1])
            extra = json.loads(atext[json_off[i] : json_off[i + 1]])
            samples.append(
                Sample(
                    token_ids=tokens[a:b].tolist(),
                    loss_mask=mask[a:b].tolist(),
                    old_logprobs=old[a:b].tolist(),
                    advantages=advantages[a:b].tolist(),
                    policy_version=int(row["policy_version"]),
                    episode_id=extra["episode_id"],
                    task_id=extra["task_id"],
                    weight=float(row["weight"]),
                    weights=extra.get("weights"),
                    parents=extra.get("parents"),
                    calls=extra.get("calls", []),
                )
            )
        return samples

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> EpisodeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
