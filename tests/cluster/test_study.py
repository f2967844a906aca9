"""The study acceptance on the Slurm dev cluster: a 4-trial study (agent × 2 seeds), 2 at a time,
successive halving, its supervisor a CPU Slurm job (--slurm). One trial's server is scancelled past its rung
(relaunched, completes); the good trials' clients are held (suspended) at the rung until the supervisor has
promoted one, so that trials that train fast cannot run past that moment. The supervisor job is scancelled
once and the study command resumes it without starting any trial twice; a trial of the bad agent is pruned
and its jobs are gone. Then the report."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml
from study_support import (
    BAD,
    GOOD,
    good_first_seed,
    good_trials_to_hold,
    promoted_held_trial,
    run_steps,
    study_events,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]
REPO = Path(__file__).resolve().parents[2]
STEPS = 7  # below the second rung (8): the victim completes, never pruned at its last step
# Not fewer (component/test_study_local.py runs 5): a good trial is held anywhere from step 2 to STEPS - 3,
# and a trial here has g1 to itself and trains about a step a second (step 1 to 2 in 0.8 s, 2026-12-07), so
# 5 steps would leave the test about a second to hold it; the steps are a few seconds of this test's time.
SEEDS = [1, 2]


def _study_file(tmp_path: Path) -> Path:
    data = {
        "name": "cluster",
        "base": str(REPO / "configs" / "quickstart.yaml"),
        "dir": str(tmp_path / "study"),
        "overrides": [
            "cluster.backend=slurm",
            "servers.policy.engine=transformers",
            "servers.policy.trainer.ranks=1",
            f"servers.policy.trainer.total_steps={STEPS}",
            "servers.policy.trainer.tasks_per_batch=4",
            "servers.policy.trainer.repeats=4",
            "servers.policy.trainer.save_every=1",
            "clients.math.array=1",
            "clients.math.eval=null",
        ],
        "space": {"clients.math.agent": [GOOD, BAD]},
        "seeds": SEEDS,
        "seed_path": "servers.policy.trainer.seed",
        "sampler_seed": good_first_seed(SEEDS),
        "max_concurrent": 2,
        "metric": {"window": 2},
        "pruner": {"kind": "successive_halving", "min_resource": 2, "reduction_factor": 4},
        "max_relaunches": 2,
        "stall_after": 600,
        "poll_s": 3,
        "supervisor": {"partition": "cpu", "time": "0:30:00", "cpus": 1, "mem": "1G"},
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _study_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _study_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ajet_hpc.study", *args],
        cwd=REPO,
        env=_study_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _study_popen(*args: str) -> subprocess.Popen[str]:
    """The study command in the background (the test goes on holding trials while it runs)."""
    return subprocess.Popen(
        [sys.executable, "-m", "ajet_hpc.study", *args],
        cwd=REPO,
        env=_study_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_study_on_dev_cluster(tmp_path: Path) -> None:
    from support import wait_until

    from ajet_hpc.launch import registry
    from ajet_hpc.launch.control import task_states
    from ajet_hpc.slurm import slurmcli
    from ajet_hpc.storage.files import read_json
    from ajet_hpc.storage.rundir import RunDir
    from ajet_hpc.study.cli import open_study_dir
    from ajet_hpc.study.search import load_study

    study_dir = tmp_path / "study"
    held: dict[int, str] = {}  # good trial -> its client job, suspended at the rung

    def supervisor_job() -> str:
        record = read_json(study_dir / "supervisor.json")
        assert record is not None, "the study wrote no supervisor.json"
        return record["job_id"]

    def hold_good_trials() -> None:
        for number in good_trials_to_hold(study_dir, held, STEPS):
            run = RunDir(study_dir / "trials" / f"{number:04d}")
            held[number] = registry.latest(run)["clients-math"].job_id
            subprocess.run(["scontrol", "suspend", held[number]], check=True, capture_output=True)

    done = _study_cmd(str(_study_file(tmp_path)), "--slurm")
    assert done.returncode == 0 and "Slurm job" in done.stdout, done.stdout + done.stderr
    try:
        # the supervisor job is scancelled once both first trials are launched; the command resumes it
        wait_until(
            lambda: sum(e["event"] == "launched" for e in study_events(study_dir)) >= 2, 300, "2 launches"
        )
        first_job = supervisor_job()
        slurmcli.cancel([first_job])

        def first_supervisor_gone() -> bool:
            hold_good_trials()
            return not any(s.state in slurmcli.ACTIVE_STATES for s in slurmcli.job_states([first_job]))

        wait_until(first_supervisor_gone, 120, "the supervisor job to end")
        again = _study_popen(str(study_dir), "--slurm")

        def command_ended() -> bool:
            hold_good_trials()
            return again.poll() is not None

        wait_until(command_ended, 300, "the study command")
        out, err = again.communicate()
        assert again.returncode == 0, out + err
        assert supervisor_job() != first_job

        # a good trial that successive halving kept past its rung: its server job is scancelled while its
        # clients are held; the supervisor relaunches it
        def promoted_good_trial() -> int | None:
            hold_good_trials()
            return promoted_held_trial(study_dir, held)

        victim = wait_until(promoted_good_trial, 900, "a good trial held at its rung and promoted")
        run = RunDir(study_dir / "trials" / f"{victim:04d}")
        assert run_steps(run.root) < STEPS
        slurmcli.cancel([registry.latest(run)["server-policy"].job_id])
        for clients in held.values():  # a pruned one's are cancelled already
            subprocess.run(["scontrol", "resume", clients], check=False, capture_output=True)

        wait_until(
            lambda: any(e["event"] == "study_finished" for e in study_events(study_dir)),
            2400,
            "the study to end",
        )
    finally:
        for clients in held.values():
            subprocess.run(["scontrol", "resume", clients], check=False, capture_output=True)
        ids = [(read_json(study_dir / "supervisor.json") or {}).get("job_id")]
        for run_dir in (study_dir / "trials").glob("[0-9][0-9][0-9][0-9]"):
            ids += [job.job_id for job in registry.load(RunDir(run_dir))]
        subprocess.run(["scancel", *[i for i in ids if i]], check=False, capture_output=True)

    events = study_events(study_dir)
    started = Counter(e["trial"] for e in events if e["event"] == "started")
    # every trial started, none twice
    assert sorted(started) == list(range(2 * len(SEEDS))) and set(started.values()) == {1}, events
    fresh = Counter(e["trial"] for e in events if e["event"] == "launched" and not e["resume"])
    assert set(fresh.values()) == {1}, events
    assert sum(e["event"] == "supervisor_started" for e in events) >= 2
    relaunched = [e for e in events if e["event"] == "relaunched"]
    assert victim in [e["trial"] for e in relaunched], events

    spec, sdir = open_study_dir(study_dir)
    trials = {t.number: t for t in load_study(spec, sdir).get_trials()}  # the Optuna journal
    assert len(trials) == 2 * len(SEEDS)
    assert trials[victim].state.name == "COMPLETE" and run_steps(run.root) == STEPS
    pruned = [n for n, t in trials.items() if t.state.name == "PRUNED"]
    assert pruned, events
    assert any(trials[n].params["clients.math.agent"] == BAD for n in pruned), events
    for n in pruned:
        pruned_run = RunDir(study_dir / "trials" / f"{n:04d}")

        def jobs_gone(r: RunDir = pruned_run) -> bool:
            return not any(s.active for j in registry.latest(r).values() for s in task_states(j))

        wait_until(jobs_gone, 120, f"the jobs of pruned trial {n} to be gone")
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials.values()), events

    report = _study_cmd(str(study_dir), "report")
    assert report.returncode == 0, report.stderr
    text = (study_dir / "report" / "report.md").read_text()
    assert "## Best configuration" in text and "## Events" in text and "relaunched" in text
    from PIL import Image

    pngs = sorted((study_dir / "report").glob("*.png"))
    assert len(pngs) == 3
    for png in pngs:
        with Image.open(png) as image:
            assert image.size[0] > 100 and image.getextrema() != ((255, 255), (255, 255), (255, 255))
