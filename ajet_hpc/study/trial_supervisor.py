"""The supervisor: one pass looks at every running trial and decides; the loop repeats it until the study
is over. Every decision is a row of ``STUDY/events.jsonl``.

What a pass decides, per running trial (a trial is one run directory, ``STUDY/trials/NNNN``):

- not launched yet (a supervisor stopped between Optuna's ``ask`` and the launch): launch it;
- new steps in its ``metrics.jsonl``: report the windowed metric to Optuna at each step, and if the pruner
  says so, cancel the run's jobs (``launch/control.cancel_job``) and mark the trial pruned; a trial that
  successive halving keeps past a rung gets a ``promoted`` event;
- a trained server ``failed`` (its rendezvous): cancel what is left, mark the trial failed with its reason;
- every trained server ``finished``: the trial is complete, its value the metric at the last step; its
  client jobs still active are cancelled (the server jobs end themselves after their last checkpoint);
- a server job (or every job) gone without the run finishing: relaunch (resume) the run, up to
  ``max_relaunches`` times, then mark it failed;
- no new step for ``stall_after`` seconds: cancel it (stalled); the next pass relaunches it.

Then it starts new trials while fewer than ``max_concurrent`` run and the budget is not spent.

Nothing is started twice: the trial number fixes the run directory, and launching an existing run directory
resumes it (jobs still active are left alone). A lease on the study directory (the stores' lease,
storage/lease.py) keeps a second supervisor from running beside a live one; a dead one's lease is taken over.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ajet_hpc.config import load_topology
from ajet_hpc.launch import registry
from ajet_hpc.launch.backends import BackendError
from ajet_hpc.launch.control import cancel_job, task_states
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.lease import HeldLease, LeaseTiming, acquire_lease
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.study import search
from ajet_hpc.study.layout import StudyDir
from ajet_hpc.study.progress import server_end, step_rows, windowed
from ajet_hpc.study.schema import SEED_PARAM, StudySpec

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)
LEASE_TIMING = LeaseTiming(heartbeat_s=10.0, timeout_s=60.0)
LAUNCH_TIMEOUT_S = 900.0
RUNG_ATTR = "completed_rung_"  # Optuna's SuccessiveHalvingPruner: the trial's value at rung k


class SupervisorRunning(RuntimeError):
    """Another supervisor holds the study's lease."""


@dataclass
class Supervisor:
    spec: StudySpec
    study_dir: StudyDir
    python: str = sys.executable
    cwd: Path = field(default_factory=Path.cwd)
    now: Any = time.time  # a clock (tests move it)

    def __post_init__(self) -> None:
        self.study = search.open_study(self.spec, self.study_dir)
        self.lost: str | None = None

    # --- the pass ------------------------------------------------------------------------------------
    def pass_once(self) -> bool:
        """Tend every running trial, then start new ones; False once the study is over."""
        import optuna

        running = 0
        for frozen in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            if self.tend(frozen):
                running += 1
        started = sum(
            1 for t in self.study.get_trials(deepcopy=False) if t.state != optuna.trial.TrialState.WAITING
        )
        budget = self.spec.trial_budget()
        while running < self.spec.max_concurrent and started < budget:
            self.start()
            running, started = running + 1, started + 1
        return running > 0

    def start(self) -> None:
        trial = self.study.ask()
        params = search.suggest(self.spec, self.study, trial)
        book = {"params": params, "overrides": self.spec.trial_overrides(params), "relaunches": 0}
        self.study_dir.write_book(trial.number, book)
        self.study_dir.event("started", trial.number, params=params)
        self.launch(trial.number, book)

    def tend(self, frozen: optuna.trial.FrozenTrial) -> bool:
        """Decide about one running trial; True while it still runs."""
        number = frozen.number
        book = self.study_dir.book(number)
        if not book:  # asked by a supervisor that stopped before writing it down
            params = dict(frozen.params)
            if not all(path in params for path in [*self.spec.space, SEED_PARAM]):
                return self.fail(number, "stopped while its parameters were drawn; never launched")
            book = {"params": params, "overrides": self.spec.trial_overrides(params), "relaunches": 0}
            self.study_dir.write_book(number, book)
        run = RunDir(self.study_dir.run_dir(number))
        if not run.jobs_file.exists():
            return self.launch(number, book)
        rows = step_rows(run.root)
        values = windowed(rows, self.spec.metric.name, self.spec.metric.window)
        fresh = [step for step in sorted(values) if step not in frozen.intermediate_values]
        if fresh:
            trial = search.handle(self.study, frozen)
            for step in fresh:
                trial.report(values[step], step)
            if trial.should_prune():
                lines = self.cancel(run)
                self.study.tell(number, state=optuna_state("PRUNED"))
                self.study_dir.event("pruned", number, step=fresh[-1], value=values[fresh[-1]], cancel=lines)
                return False
            self.note_promotions(frozen, fresh[-1])
        now = self.now()
        last_step = rows[-1]["step"] if rows else 0
        if last_step > book.get("last_step", 0) or "progress_at" not in book:
            book.update(last_step=last_step, progress_at=now)
            self.study_dir.write_book(number, book)
        topology = load_topology(run.topology_file)
        trained = [s.name for s in topology.models if s.trainer is not None] or [
            s.name for s in topology.models
        ]
        end = server_end(run.root, trained)
        if end.failed:
            self.cancel(run)
            return self.fail(number, f"server {end.failed}")
        if end.finished:
            if not values:
                return self.fail(number, f"finished without a {self.spec.metric.name} in metrics.jsonl")
            value = values[max(values)]
            self.study.tell(number, value)
            # its clients stop on their own when they read the server's end; this stops any still waiting
            # (the server jobs end themselves after their last checkpoint)
            clients = self.cancel(run, keep={s.name for s in topology.servers})
            self.study_dir.event("completed", number, step=last_step, value=value, cancel=clients)
            return False
        try:
            gone = self.gone_jobs(run, set(trained))
        except (BackendError, slurmcli.SlurmError) as exc:
            self.study_dir.event("scheduler_unanswered", number, error=str(exc))
            return True  # fail closed: never relaunch what may still run
        if gone:
            if book["relaunches"] >= self.spec.max_relaunches:
                self.cancel(run)
                return self.fail(
                    number, f"{gone}; relaunched {book['relaunches']} time(s) already (max_relaunches)"
                )
            book.update(relaunches=book["relaunches"] + 1, progress_at=now)
            self.study_dir.write_book(number, book)
            self.study_dir.event("relaunched", number, reason=gone, step=last_step, count=book["relaunches"])
            return self.launch(number, book, resume=True)
        if now - book["progress_at"] > self.spec.stall_after:
            self.study_dir.event(
                "stalled",
                number,
                step=last_step,
                idle_s=round(now - book["progress_at"]),
                cancel=self.cancel(run),
            )
            book["progress_at"] = now  # the next pass sees its jobs gone and relaunches
            self.study_dir.write_book(number, book)
        return True

    def note_promotions(self, frozen: optuna.trial.FrozenTrial, step: int) -> None:
        """A ``promoted`` event for each successive-halving rung the trial passed at this report: the pruner
        writes the trial's value at a rung into its ``completed_rung_<k>`` system attribute, then keeps it."""
        if self.spec.pruner.kind != "successive_halving":
            return
        now = self.study._storage.get_trial(frozen._trial_id).system_attrs
        for key in sorted(set(now) - set(frozen.system_attrs)):
            if key.startswith(RUNG_ATTR):
                rung = int(key.removeprefix(RUNG_ATTR))
                self.study_dir.event("promoted", frozen.number, rung=rung, step=step, value=now[key])

    def gone_jobs(self, run: RunDir, servers: set[str]) -> str | None:
        """Why the run needs a relaunch (a server job, or every job, no longer active), or None."""
        jobs = registry.latest(run)
        active: dict[str, bool] = {}
        for name, job in jobs.items():
            try:
                states = task_states(job)
            except slurmcli.SlurmError as exc:
                raise BackendError(str(exc)) from exc
            active[name] = any(s.active for s in states)
            if not active[name] and servers & set(job.targets):
                ended = ", ".join(sorted({s.state for s in states}))
                return f"job {name} ({job.job_id}) ended ({ended}) before the run finished"
        if jobs and not any(active.values()):
            return "every job of the run ended before it finished"
        return None

    # --- actions -------------------------------------------------------------------------------------
    def launch(self, number: int, book: dict[str, Any], resume: bool = False) -> bool:
        """Launch (or resume) the trial's run with our launcher, detached; its output to NNNN.log."""
        run_dir = self.study_dir.run_dir(number)
        if resume or RunDir(run_dir).exists():
            args = [str(run_dir)]
        else:
            name = f"{self.spec.name}-{number:04d}"
            args = [
                str(self.study_dir.base_file),
                *book["overrides"],
                f"run.dir={run_dir}",
                f"run.name={name}",
            ]
        command = [self.python, "-m", "ajet_hpc.launch", *args, "--detach"]
        log_file = self.study_dir.launch_log(number)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("a") as out:
            out.write(f"\n$ {' '.join(command)}\n")
            out.flush()
            try:
                done = subprocess.run(
                    command, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT, timeout=LAUNCH_TIMEOUT_S
                )
                code = done.returncode
            except subprocess.TimeoutExpired:
                code = -1
        if code != 0:
            tail = log_file.read_text(errors="replace").strip().splitlines()[-5:]
            return self.fail(number, f"the launcher exited with {code}: {' | '.join(tail)}")
        self.study_dir.event("launched", number, resume=resume, run=str(run_dir))
        return True

    def cancel(self, run: RunDir, keep: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Stop the run's jobs, but those running any of ``keep`` (server or client group names)."""
        try:
            jobs = registry.latest(run).values()
            return [cancel_job(job) for job in jobs if not keep & set(job.targets)]
        except (slurmcli.SlurmError, OSError) as exc:
            return [f"cancel failed: {exc}"]

    def fail(self, number: int, reason: str) -> bool:
        book = self.study_dir.book(number)
        book["reason"] = reason  # status and report show it
        self.study_dir.write_book(number, book)
        self.study.tell(number, state=optuna_state("FAIL"))
        self.study_dir.event("failed", number, reason=reason)
        return False

    # --- the loop ------------------------------------------------------------------------------------
    def on_lease_lost(self) -> None:
        self.lost = "the supervisor lease was taken over by another process"

    def run(self, max_passes: int | None = None, wait_for_lease_s: float = 0.0) -> int:
        """Hold the lease and pass until the study is over (0), the lease is lost or Ctrl-C (1).

        ``wait_for_lease_s``: how long to wait for a holder's lease to go stale (a supervisor job killed on
        another node leaves its lease until its heartbeat times out) before giving up."""
        deadline = time.monotonic() + wait_for_lease_s
        while True:
            try:
                lease = take_lease(self.study_dir, self.on_lease_lost)
                break
            except SupervisorRunning:
                if time.monotonic() > deadline:
                    raise
                time.sleep(5.0)
        self.study_dir.event(
            "supervisor_started",
            host=socket.gethostname(),
            pid=os.getpid(),
            job=os.environ.get("SLURM_JOB_ID"),
        )
        passes = 0
        try:
            while self.lost is None:
                more = self.pass_once()
                passes += 1
                if not more:
                    self.study_dir.event("study_finished", trials=len(self.study.trials))
                    return 0
                if max_passes is not None and passes >= max_passes:
                    return 0
                deadline = time.monotonic() + self.spec.poll_s
                while self.lost is None and time.monotonic() < deadline:
                    time.sleep(min(1.0, self.spec.poll_s))
            self.study_dir.event("supervisor_stopped", reason=self.lost)
            return 1
        except KeyboardInterrupt:
            self.study_dir.event("supervisor_stopped", reason="interrupted; the trials keep running")
            return 1
        finally:
            lease.release()


def take_lease(study_dir: StudyDir, on_lost: Any) -> HeldLease:
    try:
        return acquire_lease(study_dir.lease_anchor, LEASE_TIMING, on_lost)
    except StoreError as exc:
        raise SupervisorRunning(
            f"a supervisor already runs for {study_dir.root}: {exc}. `python -m ajet_hpc.study "
            f"{study_dir.root} status` shows the study"
        ) from exc


def optuna_state(name: str) -> optuna.trial.TrialState:
    import optuna

    return optuna.trial.TrialState[name]
