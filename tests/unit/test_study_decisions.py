"""The supervisor's decisions on real run directories and real processes (no engine): a stalled run is
cancelled, a run whose jobs are gone is failed once its relaunches are spent, a failed server's reason
reaches the trial; each decision is an event row, and the study ends when no trial is left."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import yaml
from support import REPO

from ajet_hpc.config import load_topology
from ajet_hpc.launch import registry
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.study import search
from ajet_hpc.study.cli import open_study_dir
from ajet_hpc.study.trial_supervisor import Supervisor


def _study(tmp_path: Path, seeds: list[int], **fields: object) -> Supervisor:
    data = {
        "name": "decisions",
        "base": str(REPO / "configs" / "quickstart.yaml"),
        "dir": str(tmp_path / "study"),
        "space": {"servers.policy.trainer.lr": [0.001]},
        "seeds": seeds,
        "max_concurrent": len(seeds),
        "max_relaunches": 0,
        "stall_after": 5,
        **fields,
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    spec, study_dir = open_study_dir(tmp_path / "s.yaml")
    return Supervisor(spec, study_dir)


def _fake_launched_trial(
    sup: Supervisor, steps: int, reward_per_step: float = 0.1
) -> tuple[int, RunDir, subprocess.Popen]:
    """Ask a trial and give it a run directory whose server job is a real (sleeping) local process."""
    trial = sup.study.ask()
    params = search.suggest(sup.spec, sup.study, trial)
    overrides = sup.spec.trial_overrides(params)
    sup.study_dir.write_book(trial.number, {"params": params, "overrides": overrides, "relaunches": 0})
    run = RunDir(sup.study_dir.run_dir(trial.number))
    run.prepare(load_topology(sup.study_dir.base_file, [*overrides, f"run.dir={run.root}"]))
    process = subprocess.Popen(["sleep", "600"])
    job = SubmittedJob("server-policy", "local", str(process.pid), [str(process.pid)], "logs/x", ["policy"])
    registry.record(run, [job])
    rows = [{"step": s, "model": "policy", "reward_mean": reward_per_step * s} for s in range(1, steps + 1)]
    (run.root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trial.number, run, process


def test_stalled_run_is_cancelled_then_failed_when_relaunches_are_spent(tmp_path: Path) -> None:
    sup = _study(tmp_path, seeds=[1])
    number, _, process = _fake_launched_trial(sup, steps=2)
    clock = [time.time()]
    sup.now = lambda: clock[0]
    try:
        assert sup.pass_once() is True  # steps reported, progress noted
        trial = sup.study.trials[number]
        assert trial.intermediate_values == {1: 0.1, 2: 0.15000000000000002}
        clock[0] += 10  # no new step for longer than stall_after
        assert sup.pass_once() is True
        assert process.wait(10) == -15  # cancel_run sent SIGTERM to the job
        events = sup.study_dir.events()
        assert events[-1]["event"] == "stalled" and events[-1]["step"] == 2
        assert sup.pass_once() is False  # jobs gone, max_relaunches 0: failed; nothing left to start
    finally:
        process.kill()
    assert sup.study.trials[number].state.name == "FAIL"
    failed = [e for e in sup.study_dir.events() if e["event"] == "failed"]
    assert (
        len(failed) == 1
        and "job server-policy" in failed[0]["reason"]
        and "max_relaunches" in failed[0]["reason"]
    )
    assert "max_relaunches" in sup.study_dir.book(number)["reason"]


def test_successive_halving_promotes_the_first_at_its_rung_and_prunes_a_worse_one(tmp_path: Path) -> None:
    pruner = {"kind": "successive_halving", "min_resource": 2, "reduction_factor": 4}
    sup = _study(tmp_path, seeds=[1, 2], pruner=pruner)
    good, _, good_process = _fake_launched_trial(sup, steps=3)
    bad, _, bad_process = _fake_launched_trial(sup, steps=3, reward_per_step=-0.1)
    try:
        assert sup.pass_once() is True  # the good one goes on; the bad one is pruned
        assert bad_process.wait(10) == -15 and good_process.poll() is None
        events = [e for e in sup.study_dir.events() if e["event"] in ("promoted", "pruned")]
        assert [(e["event"], e["trial"]) for e in events] == [("promoted", good), ("pruned", bad)]
        assert events[0]["rung"] == 0 and events[0]["step"] == 3
        assert events[0]["value"] == sup.study.trials[good].intermediate_values[3]
        assert sup.pass_once() is True  # nothing new: no second event
        assert len([e for e in sup.study_dir.events() if e["event"] == "promoted"]) == 1
    finally:
        good_process.kill()
        bad_process.kill()
    assert sup.study.trials[bad].state.name == "PRUNED"


def test_failed_server_fails_the_trial_with_its_reason(tmp_path: Path) -> None:
    sup = _study(tmp_path, seeds=[1])
    number, run, process = _fake_launched_trial(sup, steps=1)
    try:
        record = rendezvous.Rendezvous(
            name="policy", url="http://127.0.0.1:1", host="127.0.0.1", port=1, pid=process.pid, job_id="1",
            node="here", state="failed", reason="trainer rank 0 died: CUDA out of memory",
        )  # fmt: skip
        rendezvous.publish(run.rendezvous_file("policy"), record)
        assert sup.pass_once() is False
        assert process.wait(10) == -15  # what was left of the run was cancelled
    finally:
        process.kill()
    assert sup.study.trials[number].state.name == "FAIL"
    assert "policy: trainer rank 0 died: CUDA out of memory" in sup.study_dir.events()[-1]["reason"]


def test_supervisor_job_script_requeues_before_its_time_limit(tmp_path: Path) -> None:
    """--slurm: the sbatch script of the supervisor job (rendered as submitit would submit it) asks for the
    USR2 signal ahead of its limit, on a CPU partition; its callable pickles."""
    import pickle

    from submitit.slurm.slurm import _make_sbatch_string

    from ajet_hpc.study import slurm_job

    sup = _study(tmp_path, seeds=[1])
    params = slurm_job.parameters(sup.spec, sup.study_dir)
    script = _make_sbatch_string(command="python -u -m submitit.core._submit x", folder=tmp_path, **params)
    assert "#SBATCH --signal=USR2@120" in script
    assert "#SBATCH --partition=cpu" in script and "#SBATCH --time=240" in script
    assert "#SBATCH --job-name=ajet-study-decisions" in script
    job = pickle.loads(pickle.dumps(slurm_job.SupervisorJob(str(sup.study_dir.root), str(tmp_path))))
    assert job.study_root == str(sup.study_dir.root)
    assert hasattr(job, "checkpoint")  # submitit requeues a Checkpointable on USR2
