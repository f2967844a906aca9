"""The keeper of a server's client arrays: array tasks that died whole are submitted again.

At thousands of tasks, nodes fail every day. A task's supervisor restarts a runner that dies in its
allocation (``client/task_supervisor.py``), but when the whole task goes (a node failure, the cgroup's OOM
killer, ``kill -9`` of every process of the task, supervisor included) Slurm ends it and its shard of
tasks would never run again. The keeper notices such tasks and submits exactly those array indices again,
up to ``clients[].max_resubmits`` times each; the new task opens the same client store and resumes from it
(exactly once: docs/reliability.md).

Who keeps what: every server job starts one keeper (``python -m ajet_hpc.launch.keeper RUN SERVER``; Slurm
only) for the client groups whose first model it serves, so each group has one keeper, and it lives and dies
with that server job (a requeued server starts it again). The launch layer's server job entries
(``jobs.ServerJob``, ``python -m ajet_hpc.launch.server_job``) hand ``keeper_start.start`` down to the server
(``server.process.serve(..., beside=start)``), which calls it in the serving process once assembled, right
before it serves, and terminates the keeper first when serving ends. So the keeper is the serving process's
child, and it also ends at its next pass once that parent is gone or the server's rendezvous says its
training is over.

What died whole: Slurm says ``NODE_FAIL``, ``OUT_OF_MEMORY`` or ``BOOT_FAIL``, or ``FAILED`` by a signal
(``ExitCode`` ``0:9``). A task that ended ``FAILED`` with an exit code ended itself (its servers failed, its
store could not commit, its runner kept dying: ``ClientJob`` raised) and is left alone, as are
``CANCELLED`` (someone's scancel) and ``COMPLETED``.

Cost to the cluster: one ``scontrol show job`` per array job every ``POLL_S`` (60 s): the same bound as the
server's own queries (docs/scaling.md). Nothing else reads shared storage but ``jobs.json`` and the
topology, once per pass.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from ajet_hpc import fault_injection
from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.launch import registry
from ajet_hpc.launch.backends.base import BackendError
from ajet_hpc.launch.backends.slurm import SlurmBackend
from ajet_hpc.launch.keeper_start import kept_groups
from ajet_hpc.launch.plan import client_job
from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger("ajet_hpc.launch.keeper")  # also when run as __main__

POLL_S = 60.0
"""Seconds between two passes (a test shortens it with the hook `fault_injection.KEEPER_POLL_S`)."""
DIED_WHOLE = frozenset({"NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"})


def died_whole(state: slurmcli.JobState) -> bool:
    """Whether Slurm ended this array task because it died (not because it ended itself)."""
    if state.state in DIED_WHOLE:
        return True
    if state.state != "FAILED":
        return False
    _, _, signal = state.exit_code.partition(":")
    return signal not in ("", "0")


def keep_once(
    run: RunDir,
    topology: Topology,
    groups: list[ClientGroupConfig],
    backend: SlurmBackend,
    given_up: set[str],
) -> int:
    """One pass: resubmit the dead tasks of ``groups``; the number of tasks submitted again. A task left
    dead (its resubmits spent) is logged once and added to ``given_up``."""
    jobs = registry.latest(run)
    resubmitted = 0
    for group in groups:
        name = f"clients-{group.name}"
        job = jobs.get(name)
        if job is None or job.backend != "slurm":
            continue
        states = {s.job_id: s for s in slurmcli.job_states(job.job_ids)}
        done = registry.resubmissions(run, name)
        again: list[tuple[int, str, slurmcli.JobState]] = []
        spent: list[tuple[int, str, slurmcli.JobState]] = []
        for index, task in enumerate(job.tasks):
            state = states.get(task)
            if state is None or not died_whole(state):
                continue
            (again if done.get(index, 0) < group.max_resubmits else spent).append((index, task, state))
        for index, task, state in spent:
            if task in given_up:
                continue
            given_up.add(task)
            log.error(
                "client task %s[%d] (job %s) died (%s, exit %s) and was resubmitted %d time(s) already "
                "(clients[].max_resubmits): left dead",
                group.name, index, task, state.state, state.exit_code, done.get(index, 0),
            )  # fmt: skip
        if not again:
            continue
        spec = client_job(group, job.python)
        entry = backend.resubmit(spec, run, topology.cluster, [index for index, _, _ in again])
        registry.record(run, [entry])
        for (index, task, state), new in zip(again, entry.tasks, strict=True):
            log.warning(
                "client task %s[%d] (job %s) died whole (%s, exit %s): submitted again as job %s "
                "(resubmit %d of %d); it resumes from its store",
                group.name, index, task, state.state, state.exit_code, new, done.get(index, 0) + 1,
                group.max_resubmits,
            )  # fmt: skip
        resubmitted += len(again)
    return resubmitted


def server_over(run: RunDir, server: str) -> bool:
    """The server's training ended for good (its rendezvous says finished or failed)."""
    try:
        record = rendezvous.read(run.rendezvous_file(server))
    except ValueError:
        return False
    return record is not None and record.state in ("finished", "failed")


def keep(run: RunDir, server: str, parent: int, stop: threading.Event, poll_s: float) -> None:
    """Pass after pass until the server process ``parent`` (this process's parent) is gone, its training
    is over, or ``stop``."""
    topology = run.load_topology()
    groups = kept_groups(topology, server)
    if not groups:
        log.info("keeper of %s: no client group to keep", server)
        return
    log.info(
        "keeper of %s: resubmits dead tasks of %s every %.0f s",
        server, ", ".join(g.name for g in groups), poll_s,
    )  # fmt: skip
    backend = SlurmBackend(python=sys.executable)
    given_up: set[str] = set()
    while not stop.wait(poll_s):
        if os.getppid() != parent or server_over(run, server):  # the server process is gone, or done
            return
        try:
            keep_once(run, topology, groups, backend, given_up)
        except (slurmcli.SlurmError, BackendError, OSError) as exc:  # next pass tries again
            log.warning("keeper of %s: this pass failed (%s)", server, exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ajet_hpc.launch.keeper", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("server", help="the server job whose client groups it keeps")
    args = parser.parse_args(argv)
    setup_logging()
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # Slurm's checkpoint signal is the server's business
    poll_s = float(fault_injection.armed(fault_injection.KEEPER_POLL_S) or POLL_S)  # tests only
    keep(RunDir.at(args.run_dir), args.server, os.getppid(), threading.Event(), poll_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
