"""Experiment trackers: every ``metrics.jsonl`` row of a server, also in TensorBoard, W&B or MLflow.

``run.trackers`` names them (``jsonl``, the run's own ``RUN/metrics.jsonl``, is always written). Each server's
coordinator logs its rows with the model name as prefix (``policy/reward_mean``), so the servers of a run
share one tracker run, plus per-step histograms (episode rewards, response lengths, advantages):

- **tensorboard**: event files in ``RUN/tensorboard`` (one per server process; TensorBoard shows the folder
  as one run): ``tensorboard --logdir RUN/tensorboard``.
- **wandb**: offline by default (compute nodes have no internet): ``RUN/wandb/offline-run-*``, one per server
  process, all with the run's W&B id; ``wandb sync RUN/wandb/offline-run-*`` uploads them afterwards.
  ``WANDB_MODE=online`` in the job's environment logs live instead.
- **mlflow**: a file store in ``RUN/mlruns`` (experiment = the run's name, one MLflow run shared by the
  servers): ``mlflow ui --backend-store-uri RUN/mlruns``.

The libraries are optional extras (``pip install 'ajet_hpc[tensorboard]'``, ``[wandb]``, ``[mlflow]``): a
tracker named in the topology but not installed stops the launch (`missing`). A tracker that fails while the
run goes on is logged once and left out; training never stops for a dashboard.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

log = logging.getLogger(__name__)

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The module each optional tracker needs, and the package extra that installs it (same name)."""


def missing(names: Sequence[str]) -> list[str]:
    """One message per tracker in ``names`` whose library is not installed (empty when all are)."""
    return [
        f"{name!r} needs the {MODULES[name]} package, which is not installed: pip install 'ajet_hpc[{name}]'"
        for name in names
        if name in MODULES and importlib.util.find_spec(MODULES[name]) is None
    ]


def scalars(row: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """The row's finite numbers (nested dicts flattened with '/'), keyed ``prefix/name``; not the step."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("step", "model", "time"):
            continue
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, name))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def step_histograms(episodes: Sequence[Any], samples: Sequence[Any]) -> dict[str, list[float]]:
    """A step's distributions: each episode's reward, each episode's response length (the model's own
    tokens trained, over its samples) and advantage (its trained tokens' mean)."""
    lengths: dict[str, float] = {}
    advantage_sums: dict[str, float] = {}
    for sample in samples:
        mask = np.asarray(sample.loss_mask) != 0  # the samples' fields are arrays or lists
        trained = np.asarray(sample.advantages, np.float64)[mask].tolist()
        lengths[sample.episode_id] = lengths.get(sample.episode_id, 0) + len(trained)
        advantage_sums[sample.episode_id] = advantage_sums.get(sample.episode_id, 0.0) + sum(trained)
    return {
        "rewards": [float(e.reward) for e in episodes if e.reward is not None],
        "response_lengths": list(lengths.values()),
        "advantages": [advantage_sums[e] / lengths[e] for e in lengths if lengths[e]],
    }


class Trackers:
    """The trackers of one server process. ``log`` takes a step's row and histograms; ``close`` at the end."""

    def __init__(self, run_root: Path, run_name: str, model: str, names: Sequence[str]) -> None:
        self.run_root, self.run_name, self.model = Path(run_root), run_name, model
        self._open: dict[str, Any] = {}
        for name in dict.fromkeys(names):
            if name == "jsonl":
                continue
            try:
                self._open[name] = getattr(self, f"_open_{name}")()
            except Exception:
                log.exception("tracker %s could not start; the run goes on without it", name)

    @property
    def active(self) -> list[str]:
        return sorted(self._open)

    def log(self, row: Mapping[str, Any], histograms: Mapping[str, Sequence[float]] | None = None) -> None:
        step = int(row["step"])
        values = scalars(row, self.model)
        hists = {f"{self.model}/{k}": [float(x) for x in v] for k, v in (histograms or {}).items() if len(v)}
        for name, handle in list(self._open.items()):
            try:
                getattr(self, f"_log_{name}")(handle, step, values, hists)
            except Exception:
                log.exception("tracker %s failed at step %d; it is left out from now on", name, step)
                self._close_one(name)

    def close(self) -> None:
        for name in list(self._open):
            self._close_one(name)

    def _close_one(self, name: str) -> None:
        handle = self._open.pop(name, None)
        if handle is None:
            return
        try:
            getattr(self, f"_close_{name}")(handle)
        except Exception:
            log.exception("tracker %s did not close cleanly", name)

    # ---------------------------------------------------------------------------------------- TensorBoard
    def _open_tensorboard(self) -> Any:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(self.run_root / "tensorboard"), filename_suffix=f".{self.model}")

    def _log_tensorboard(self, writer: Any, step: int, values: dict, hists: dict) -> None:
        for key, value in values.items():
            writer.add_scalar(key, value, step)
        for key, data in hists.items():
            writer.add_histogram(key, _array(data), step)
        writer.flush()

    def _close_tensorboard(self, writer: Any) -> None:
        writer.close()

    # ----------------------------------------------------------------------------------------------- W&B
    def _open_wandb(self) -> Any:
        import wandb

        folder = self.run_root / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "ajet_hpc"),
            name=self.run_name,
            id=self.run_id(),
            dir=str(self.run_root),
            mode=_wandb_mode(),
            resume="allow",
            reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"),
        )
        run.define_metric(f"{self.model}/step")
        run.define_metric(f"{self.model}/*", step_metric=f"{self.model}/step")  # each model its own x axis
        return run

    def _log_wandb(self, run: Any, step: int, values: dict, hists: dict) -> None:
        import wandb

        data: dict[str, Any] = {f"{self.model}/step": step, **values}
        data.update({key: wandb.Histogram(_array(v)) for key, v in hists.items()})
        run.log(data)

    def _close_wandb(self, run: Any) -> None:
        run.finish()

    # -------------------------------------------------------------------------------------------- MLflow
    def _open_mlflow(self) -> Any:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # files suit shared storage (no database)
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=(self.run_root / "mlruns").absolute().as_uri())
        run_id = self._shared_mlflow_run(client)
        return client, run_id

    def _shared_mlflow_run(self, client: Any) -> str:
        """The run's one MLflow run: created by the first server, found by name by the others."""
        experiment = client.get_experiment_by_name(self.run_name)
        experiment_id = (
            experiment.experiment_id if experiment is not None else _create_experiment(client, self.run_name)
        )
        tag = "ajet_hpc.run_id"
        found = client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{self.run_id()}'")
        if found:
            return found[0].info.run_id
        run = client.create_run(experiment_id, run_name=self.run_name, tags={tag: self.run_id()})
        return run.info.run_id

    def _log_mlflow(self, handle: Any, step: int, values: dict, hists: dict) -> None:
        from mlflow.entities import Metric

        client, run_id = handle
        stamp = int(time.time() * 1000)
        summary = {f"{key}_mean": sum(v) / len(v) for key, v in hists.items()}  # MLflow has no histograms
        metrics = [Metric(_mlflow_key(k), v, stamp, step) for k, v in {**values, **summary}.items()]
        for start in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[start : start + 1000])

    def _close_mlflow(self, handle: Any) -> None:
        pass  # shared by the run's servers: none of them ends it alone

    def run_id(self) -> str:
        """A stable id of this run directory for the trackers (W&B run id, MLflow tag)."""
        digest = hashlib.sha256(str(self.run_root.resolve()).encode()).hexdigest()[:10]
        return f"{_safe(self.run_name)[:40]}-{digest}"


def _create_experiment(client: Any, name: str) -> str:
    try:
        return client.create_experiment(name)
    except Exception:  # another server created it meanwhile
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def _mlflow_key(key: str) -> str:
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text)


def _array(values: Sequence[float]) -> Any:
    import numpy as np

    return np.asarray(values, dtype=np.float64)


def _wandb_mode() -> Literal["online", "offline", "disabled", "shared"]:
    """``WANDB_MODE`` (offline unless set: compute nodes have no internet), one of the modes W&B knows."""
    mode = os.environ.get("WANDB_MODE", "offline")
    match mode:
        case "online" | "offline" | "disabled" | "shared":
            return mode
    raise ValueError(f"WANDB_MODE={mode!r}: W&B's modes are online, offline, disabled and shared")
