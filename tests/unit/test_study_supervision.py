"""The study directory's bookkeeping: events, the supervisor's lease, the windowed metric."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import yaml
from support import REPO, run_module

from ajet_hpc.study.cli import main, open_study_dir
from ajet_hpc.study.layout import StudyDir
from ajet_hpc.study.progress import step_rows, windowed
from ajet_hpc.study.trial_supervisor import take_lease


def test_events_are_appended_rows_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    study = StudyDir(tmp_path / "study")
    study.event("started", 0, params={"lr": 0.1})
    study.event("relaunched", 0, reason="job server-policy ended")
    with study.events_file.open("a") as handle:
        handle.write('{"time": 1, "event": "pru')  # a supervisor killed mid-write
    rows = study.events()
    assert [(r["event"], r["trial"]) for r in rows] == [("started", 0), ("relaunched", 0)]
    assert rows[0]["params"] == {"lr": 0.1} and rows[1]["reason"].startswith("job server")
    study.event("pruned", 1, step=3)  # after the torn line: still a row of its own
    assert study.events()[-1]["event"] == "pruned"


class _Owner:
    lost = False

    def on_lost(self) -> None:
        self.lost = True


def test_one_supervisor_per_study(tmp_path: Path) -> None:
    data = {
        "name": "s",
        "base": str(REPO / "configs" / "quickstart.yaml"),
        "dir": str(tmp_path / "study"),
        "space": {"servers.policy.trainer.lr": [0.001]},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    _, study = open_study_dir(tmp_path / "s.yaml")
    owner = _Owner()
    held = take_lease(study, owner.on_lost)
    try:
        done = run_module("ajet_hpc.study", str(study.root))  # another process: refused, exit 3
        assert done.returncode == 3, done.stdout + done.stderr
        assert "a supervisor already runs" in done.stderr
        assert not study.trials_dir.exists()  # and started nothing
    finally:
        held.release()
    again = take_lease(study, owner.on_lost)  # released: the next supervisor takes it
    again.release()
    assert not owner.lost


def test_changed_study_file_is_refused_on_an_existing_study(tmp_path: Path, capsys) -> None:
    data = {
        "name": "s",
        "base": str(REPO / "configs" / "quickstart.yaml"),
        "dir": str(tmp_path / "study"),
        "space": {"servers.policy.trainer.lr": [0.001]},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    open_study_dir(tmp_path / "s.yaml")
    open_study_dir(tmp_path / "s.yaml")  # the same file resumes
    data["space"] = {"servers.policy.trainer.lr": [0.002]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    assert main([str(tmp_path / "s.yaml"), "status"]) == 2
    assert "already holds a different study" in capsys.readouterr().err


def _reference_windowed(rows: list[dict], name: str, window: int) -> dict[int, float]:
    """Slow and plain: for each step, the rows up to it, their last ``window`` values."""
    out = {}
    for row in rows:
        upto = [r[name] for r in rows if r["step"] <= row["step"] and r.get(name) is not None]
        out[row["step"]] = statistics.fmean(upto[-window:])
    return out


def test_windowed_metric_against_a_reference(tmp_path: Path) -> None:
    rng = random.Random(7)
    for _ in range(30):
        steps = rng.randint(1, 25)
        written = []
        for step in range(1, steps + 1):
            written.append({"step": step, "reward_mean": rng.random()})
            if rng.random() < 0.2:  # a relaunch trains a step again: its last row counts
                written.append({"step": step, "reward_mean": rng.random()})
        run = tmp_path / f"run{_}"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
        rows = step_rows(run)
        last = {}
        for r in written:
            last[r["step"]] = r
        assert rows == [last[s] for s in sorted(last)]
        window = rng.randint(1, 5)
        got = windowed(rows, "reward_mean", window)
        want = _reference_windowed(rows, "reward_mean", window)
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) < 1e-12 for k in want)
