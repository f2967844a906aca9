"""A run opened for inspection: its models, each with its server store and its metrics rows.

The models of a run are the servers of its topology plus any ``RUN/data/<name>.h5`` found (a store left by a
server since renamed). Stores are opened on first use with :class:`EpisodeReader`, which reads a file that
is still being written; :meth:`Run.refresh` picks up what was appended since.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet_hpc.config import ConfigError, Topology
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.records import EpisodeRecord
from ajet_hpc.storage.rundir import RunDir, RunDirError
from ajet_hpc.trainer.coordinator.metrics import read_eval_rows, read_rows

log = logging.getLogger(__name__)


class InspectError(Exception):
    """Bad input (no such run, model or episode, nothing recorded yet): one line for the user, exit 2."""


@dataclass
class ModelRun:
    """One model (server) of the run: its store, if written yet, and its rows of ``metrics.jsonl``."""

    name: str
    store_path: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)  # its eval rounds (metrics.jsonl)
    reader: EpisodeReader | None = None

    @property
    def has_store(self) -> bool:
        return self.reader is not None

    def summaries(self) -> list[dict[str, Any]]:
        return self.reader.summaries() if self.reader is not None else []

    def steps(self) -> list[dict[str, Any]]:
        return self.reader.steps() if self.reader is not None else []

    def episode(self, episode_id: str) -> EpisodeRecord:
        if self.reader is None:
            raise InspectError(f"model {self.name!r} has no store yet ({self.store_path} is missing)")
        return self.reader.episode(episode_id)


class Run:
    """The run directory at ``root``; use :meth:`open`."""

    def __init__(self, root: Path, topology: Topology) -> None:
        self.root, self.topology = root, topology
        self.rundir = RunDir(root)
        self._models: dict[str, ModelRun] = {}

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Run:
        try:
            rundir = RunDir.at(path)
            topology = rundir.load_topology()
        except RunDirError as exc:
            raise InspectError(str(exc)) from None
        except ConfigError as exc:
            raise InspectError(f"{path}/topology.yaml cannot be read: {exc}") from None
        return cls(rundir.root, topology)

    @property
    def name(self) -> str:
        return self.topology.run.name

    @property
    def data_dir(self) -> Path:
        return self.rundir.data_dir

    def model_names(self) -> list[str]:
        """Servers of the topology, in order, then stores of other names found under ``RUN/data``."""
        names = [server.name for server in self.topology.models]
        if self.data_dir.is_dir():
            names += sorted(p.stem for p in self.data_dir.glob("*.h5") if p.stem not in names)
        return names

    def models(self, name: str | None = None) -> list[ModelRun]:
        """The model called ``name``, or every model with anything recorded; ``InspectError`` if none."""
        known = self.model_names()
        if name is not None and name not in known:
            raise InspectError(f"unknown model {name!r}; models of this run: {', '.join(known)}")
        wanted = [name] if name is not None else known
        models = [self._model(model) for model in wanted]
        if name is None:
            models = [model for model in models if model.has_store or model.metrics]
        if not any(model.has_store or model.metrics for model in models):
            what = f"model {name!r}" if name is not None else f"run {self.name!r}"
            raise InspectError(
                f"{what} has nothing recorded yet: no store under {self.data_dir} and no rows in "
                f"{self.rundir.metrics_file}"
            )
        return models

    def _model(self, name: str) -> ModelRun:
        model = self._models.get(name)
        if model is None:
            model = ModelRun(name, self.rundir.server_store(name))
            self._models[name] = model
            self._load(model)
        return model

    def _load(self, model: ModelRun) -> None:
        model.metrics = [row for row in read_rows(self.rundir.metrics_file) if row.get("model") == model.name]
        model.eval_rows = read_eval_rows(self.rundir.metrics_file, model.name)
        if model.reader is not None:
            model.reader.refresh()
        elif model.store_path.is_file():
            model.reader = EpisodeReader(model.store_path)

    def refresh(self) -> None:
        """Re-read ``metrics.jsonl`` and let every opened store pick up appended episodes and steps."""
        for model in self._models.values():
            self._load(model)

    def find_episode(self, episode_id: str, model: str | None = None) -> tuple[ModelRun, EpisodeRecord]:
        """The episode whose id is ``episode_id`` or starts with it (unambiguously), in any model's store."""
        matches: list[tuple[ModelRun, str]] = []
        for candidate in self.models(model):
            ids = [summary["episode_id"] for summary in candidate.summaries()]
            if episode_id in ids:
                return candidate, candidate.episode(episode_id)
            matches += [(candidate, full) for full in ids if full.startswith(episode_id)]
        if not matches:
            where = f"model {model!r}" if model is not None else f"run {self.name!r}"
            raise InspectError(
                f"no episode {episode_id!r} in {where}; list them with: episodes"
                + ("" if model is not None else " (or pick a model with --model)")
            )
        if len(matches) > 1:
            shown = ", ".join(full for _, full in matches[:5]) + (", ..." if len(matches) > 5 else "")
            raise InspectError(f"episode id {episode_id!r} is ambiguous: {len(matches)} match ({shown})")
        found, full = matches[0]
        return found, found.episode(full)

    def close(self) -> None:
        for model in self._models.values():
            if model.reader is not None:
                model.reader.close()
                model.reader = None
        self._models.clear()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def load_tokenizer(run: Run, model: str):
    """The tokenizer of ``model`` (a transformers tokenizer), or ``None`` with the reason logged.

    A built-in model's is read from ``RUN/models/<name>`` (where the server built it) or built again (it
    is deterministic); any other model's from its local folder. Nothing is downloaded.
    """
    try:
        spec = run.topology.server(model).engine.model
    except KeyError:
        log.warning("model %r is not in the topology: showing token ids", model)
        return None
    path = Path(spec).expanduser()
    if spec.startswith("builtin:"):
        path = run.rundir.models_dir / spec.removeprefix("builtin:")
    try:
        if path.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        if spec == "builtin:tiny":
            from ajet_hpc.engine.tiny import build_tokenizer

            return build_tokenizer()
        if spec == "builtin:tiny-qwen":
            from ajet_hpc.engine.tiny_qwen import build_tokenizer as build_qwen_tokenizer

            return build_qwen_tokenizer()
    except Exception as exc:  # any failure to load only costs the decoded text
        log.warning("cannot load the tokenizer of %r from %s (%s): showing token ids", model, path, exc)
        return None
    log.warning("no tokenizer for %r (%s is not a folder): showing token ids", model, path)
    return None
