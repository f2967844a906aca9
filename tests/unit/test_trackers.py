"""Experiment trackers (``ajet_hpc.trainer.coordinator.experiment_trackers``): two server processes of one run
log their rows to TensorBoard, W&B (offline) and MLflow (file store), and each tracker's own files are read
back with the tracker's own reader (TensorBoard's event accumulator, W&B's record protobufs, MLflow's
client): every step of both models, under the model's prefix, in one tracker run; histograms where the
tracker has them."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO, topology_dict, write_topology

from ajet_hpc.launch.cli import main as launch_main
from ajet_hpc.trainer.coordinator import experiment_trackers

pytestmark = pytest.mark.slow
STEPS = 3
SERVER = f"""
import sys
from ajet_hpc.trainer.coordinator.experiment_trackers import Trackers
run_root, model = sys.argv[1], sys.argv[2]
t = Trackers(run_root, "study-a", model, ["jsonl", "tensorboard", "wandb", "mlflow"])
assert t.active == ["mlflow", "tensorboard", "wandb"], t.active
for step in range(1, {STEPS} + 1):
    row = {{"step": step, "model": model, "reward_mean": step / 10, "loss": -step, "flag": True,
           "client_groups": {{"math": 2}}, "weight_sync": "memory", "kl": float("nan"), "time": 1.0}}
    t.log(row, {{"rewards": [0.0, step / 10, 1.0], "advantages": []}})
t.close()
"""


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_root = tmp_path_factory.mktemp("run")
    for model in ("policy", "critic"):  # one after the other, as two servers' processes
        done = subprocess.run(
            [sys.executable, "-c", SERVER, str(run_root), model],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-4000:]
    return run_root


def test_tensorboard_event_files_hold_both_models(logged: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    for model in ("policy", "critic"):
        means = [(e.step, round(e.value, 6)) for e in events.Scalars(f"{model}/reward_mean")]
        assert means == [(s, s / 10) for s in range(1, STEPS + 1)]
        assert f"{model}/client_groups/math" in tags["scalars"]  # nested dicts flattened
        assert [h.step for h in events.Histograms(f"{model}/rewards")] == list(range(1, STEPS + 1))
        assert f"{model}/kl" not in tags["scalars"] and f"{model}/flag" not in tags["scalars"]
        assert f"{model}/advantages" not in tags["histograms"]  # empty: nothing to show


def wandb_history(path: Path) -> list[dict[str, str]]:
    """The history rows of a W&B run file (LevelDB-log framing: 7-byte file header, 32 KiB blocks of records
    with a 7-byte header each; the payloads are W&B's Record protobufs)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    rows, payload, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        payload += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL, LAST
            # protobuf builds the module's message classes when it is imported: mypy sees none of them
            record = wandb_internal_pb2.Record.FromString(payload)  # type: ignore[attr-defined]
            payload = b""
            if record.HasField("history"):
                rows.append(
                    {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                )
    return rows


def test_wandb_offline_runs_share_one_id_and_hold_every_step(logged: Path) -> None:
    files = sorted((logged / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1  # one W&B run, one file per server
    seen: dict[str, list[str]] = {}  # W&B's value_json texts
    for path in files:
        for row in wandb_history(path):
            for key, value in row.items():
                seen.setdefault(key, []).append(value)
    for model in ("policy", "critic"):
        assert [float(v) for v in seen[f"{model}/reward_mean"]] == [s / 10 for s in range(1, STEPS + 1)]
        assert [int(v) for v in seen[f"{model}/step"]] == list(range(1, STEPS + 1))
        assert seen[f"{model}/rewards/_type"] == ['"histogram"'] * STEPS  # (nested keys: type, bins, values)


def test_mlflow_file_store_has_one_run_with_both_models(
    logged: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(logged / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("study-a")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    for model in ("policy", "critic"):
        history = client.get_metric_history(run_id, f"{model}/reward_mean")
        assert sorted((m.step, round(m.value, 6)) for m in history) == [
            (s, s / 10) for s in range(1, STEPS + 1)
        ]
        assert len(client.get_metric_history(run_id, f"{model}/rewards_mean")) == STEPS


def test_jsonl_is_always_kept_and_a_tracker_not_installed_stops_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = topology_dict(tmp_path / "run")
    data["run"]["trackers"] = ["mlflow", "mlflow"]
    from ajet_hpc.config import load_topology

    assert load_topology(data).run.trackers == ["jsonl", "mlflow"]
    # not installed: the real library is installed here, so its import is blocked for this test only
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert experiment_trackers.missing(["jsonl", "mlflow", "tensorboard"]) == [
        "'mlflow' needs the mlflow package, which is not installed: pip install 'ajet_hpc[mlflow]'"
    ]
    assert launch_main([str(write_topology(tmp_path, data)), "--no-submit"]) == 2
    err = capsys.readouterr().err
    assert "run.trackers" in err and "pip install 'ajet_hpc[mlflow]'" in err
    assert not (tmp_path / "run").exists()  # nothing written
