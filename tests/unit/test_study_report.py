"""The report of a synthetic study directory (Optuna journal, run directories with metrics, events): the
Markdown answers "what worked", and every PNG is a real, non-empty picture."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import yaml
from PIL import Image
from support import REPO

from ajet_hpc.study import search
from ajet_hpc.study.cli import main, open_study_dir
from ajet_hpc.study.schema import SEED_PARAM

LR = "servers.policy.trainer.lr"
MODE = "servers.policy.trainer.merge.mode"


def synthetic_study(tmp_path: Path):
    data = {
        "name": "synthetic",
        "base": str(REPO / "configs" / "quickstart.yaml"),
        "dir": str(tmp_path / "study"),
        "space": {LR: [0.001, 0.003], MODE: ["linear", "tree"]},
        "seeds": [1, 2],
        "metric": {"window": 2},
        "pruner": {"kind": "successive_halving", "min_resource": 2},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    spec, study_dir = open_study_dir(tmp_path / "s.yaml")
    study = search.open_study(spec, study_dir)
    rng = random.Random(3)
    for _ in range(spec.trial_budget()):
        trial = study.ask()
        params = search.suggest(spec, study, trial)
        study_dir.write_book(trial.number, {"params": params, "relaunches": trial.number % 3 == 1})
        run = study_dir.run_dir(trial.number)
        run.mkdir(parents=True)
        good = params[LR] == 0.003 and params[MODE] == "tree"  # the configuration that works
        steps = 3 if trial.number == 2 else 6
        rows = [
            {
                "step": s,
                "reward_mean": (0.2 + 0.1 * s if good else 0.1 + 0.02 * s) + rng.random() * 0.01,
                "step_time_s": 1.0 + rng.random(),
                "tokens": 1000 + s,
            }
            for s in range(1, steps + 1)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        study_dir.event("started", trial.number, params=params)
        last = (rows[-1]["reward_mean"] + rows[-2]["reward_mean"]) / 2
        if trial.number == 2:
            study.tell(trial, state=search_state("PRUNED"))
            study_dir.event("pruned", trial.number, step=3, value=last)
        elif trial.number == 5:
            book = study_dir.book(5)
            study_dir.write_book(5, {**book, "reason": "server policy: out of memory"})
            study.tell(trial, state=search_state("FAIL"))
            study_dir.event("failed", 5, reason="server policy: out of memory")
        else:
            study.tell(trial, last)
            study_dir.event("completed", trial.number, value=last)
    study_dir.event("relaunched", 1, reason="job server-policy (12) ended (CANCELLED)")
    return spec, study_dir


def search_state(name: str):
    import optuna

    return optuna.trial.TrialState[name]


def test_report_writes_markdown_and_real_pngs(tmp_path: Path, capsys) -> None:
    _spec, study_dir = synthetic_study(tmp_path)
    assert main([str(study_dir.root), "report", "--colour-by", MODE]) == 0
    report = study_dir.report_dir / "report.md"
    text = report.read_text()
    best = text.split("## Best configuration", 1)[1].split("##", 1)[0]
    assert f"`{LR}` = `0.003`" in best and f"`{MODE}` = `tree`" in best
    assert "±" in best and "over 2 seed(s)" in best
    table = text.split("## Configurations", 1)[1].split("## Trials", 1)[0]
    first_row = next(line for line in table.splitlines() if line.startswith("| 1 |"))
    assert "lr=0.003" in first_row and "mode=tree" in first_row
    assert "pruned" in text and "out of memory" in text and "relaunched" in text
    pngs = sorted(study_dir.report_dir.glob("*.png"))
    assert [p.name for p in pngs] == ["metric_vs_params.png", "reward_curves.png", "speed.png"]
    for png in pngs:
        assert f"]({png.name})" in text
        with Image.open(png) as image:
            pixels = np.asarray(image.convert("RGB"))
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 10, f"{png.name} is blank"


def test_status_is_one_screen(tmp_path: Path, capsys) -> None:
    _spec, study_dir = synthetic_study(tmp_path)
    capsys.readouterr()
    assert main([str(study_dir.root), "status"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= 24
    assert sum(1 for line in lines if "complete" in line and "lr=" in line) == 6
    assert any("pruned" in line and "lr=" in line for line in lines)
    assert any("failed" in line and "out of memory" in line for line in lines)
    assert all(f"{SEED_PARAM}=" in line for line in lines if "lr=" in line and "started" not in line)


def test_a_configuration_whose_trials_all_stopped_shows_how_far_they_got() -> None:
    from ajet_hpc.study.report import _config_value, config_table
    from ajet_hpc.study.state import TrialView

    def view(number: int, lr: float, seed: int, state: str, step: int, metric: float) -> TrialView:
        return TrialView(number, {LR: lr, SEED_PARAM: seed}, state, step, metric, 0, "", [])

    views = [
        view(0, 0.001, 1, "complete", 8, 0.30),
        view(1, 0.001, 2, "complete", 8, 0.20),
        view(2, 0.01, 1, "pruned", 3, 0.05),
        view(3, 0.01, 2, "pruned", 5, 0.12),
        view(4, 0.1, 1, "failed", 2, 0.01),
    ]
    rows = config_table(views, "maximize")
    assert [dict(r["params"])[LR] for r in rows] == [0.001, 0.01, 0.1]  # completed first, then how far
    assert _config_value(rows[0]) == "0.2500 ± 0.0707"
    assert _config_value(rows[1]) == "- (reached 0.1200 at step 5, none completed)"
    assert rows[1]["states"] == "2 pruned"
    assert _config_value(rows[2]) == "- (reached 0.0100 at step 2, none completed)"
