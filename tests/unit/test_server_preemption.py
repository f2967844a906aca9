"""The server's save when its job goes down: once per process, within its budget, requeued only when it
must (``ajet_hpc.server.preemption``); the time-limit alarm and its arithmetic (``server.deadline``)."""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime

import pytest

from ajet_hpc.server import deadline, preemption
from ajet_hpc.slurm import slurmcli


@pytest.fixture()
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A process state as at start, with scontrol replaced: returns the jobs requeued."""
    requeued: list[str] = []
    monkeypatch.setattr(slurmcli, "requeue", requeued.append)
    preemption.reset()
    preemption.configure(preemption.Budgets.of(120, 30), "42")
    yield requeued
    preemption.reset()


def record(state: str = "RUNNING", start: str = "2026-11-30T10:00:00", preempt: str = "None") -> dict:
    return {"JobId": "42", "JobState": state, "StartTime": start, "PreemptTime": preempt}


def test_budgets_leave_time_to_stop_and_requeue() -> None:
    budgets = preemption.Budgets.of(signal_delay_s=120, kill_wait_s=30)
    assert (budgets.user_signal_s, budgets.term_s) == (100.0, 20.0)
    tight = preemption.Budgets.of(signal_delay_s=10, kill_wait_s=3)
    assert (tight.user_signal_s, tight.term_s) == (10.0, 2.0)


def test_a_preemption_of_this_start_is_told_from_a_cancel_and_an_earlier_start() -> None:
    assert preemption.preempted(record(preempt="2026-11-30T10:05:00"))
    assert not preemption.preempted(record())  # scancel, or the time limit
    assert not preemption.preempted(record(state="CANCELLED", preempt="2026-11-30T10:05:00"))
    assert not preemption.preempted(record(preempt="2026-11-30T09:05:00"))  # kept from the last start
    assert not preemption.preempted({})


def test_the_save_runs_once_whatever_signals_follow(fresh: list[str], monkeypatch) -> None:
    budgets: list[float] = []
    unregister = preemption.on_signal(budgets.append)
    try:
        monkeypatch.setattr(slurmcli, "job_record", lambda job: record(preempt="2026-11-30T10:05:00"))
        preemption.on_user_signal()  # USR2: submitit (or the batch script) requeues
        preemption.on_term()  # then SIGTERM: no second save, no second requeue
        preemption.on_term()
    finally:
        unregister()
    assert budgets == [100.0] and fresh == []


def test_sigterm_saves_within_kill_wait_and_requeues_only_a_preemption(fresh: list[str], monkeypatch) -> None:
    budgets: list[float] = []
    unregister = preemption.on_signal(budgets.append)
    try:
        monkeypatch.setattr(slurmcli, "job_record", lambda job: record())
        preemption.on_term()  # scancel: saved, stays cancelled
        assert budgets == [20.0] and fresh == []
        preemption.reset()
        monkeypatch.setattr(slurmcli, "job_record", lambda job: record(preempt="2026-11-30T10:05:00"))
        preemption.on_term()
        preemption.on_term()  # Slurm's second SIGTERM at the end of GraceTime
        assert budgets == [20.0, 20.0] and fresh == ["42"]
    finally:
        unregister()


def test_a_server_whose_work_is_over_saves_but_is_not_requeued_when_preempted(fresh, monkeypatch) -> None:
    """Preempted while it shuts down after its last step (or after failing): the store is still flushed,
    but the job is not requeued: it would start again only to find nothing to do (or retry a failure)."""
    budgets: list[float] = []
    unregister = preemption.on_signal(budgets.append)
    monkeypatch.setattr(slurmcli, "job_record", lambda job: record(preempt="2026-11-30T10:05:00"))
    try:
        preemption.work_over("training is complete")
        preemption.on_term()
        assert budgets == [20.0] and fresh == []
        preemption.reset()
        preemption.work_over("the server failed")
        monkeypatch.setattr(preemption, "_deadline", "the time limit is near")  # as `signal_deadline` sets it
        preemption.on_term()  # the deadline's path neither
        assert fresh == []
    finally:
        unregister()


def test_a_failing_hook_still_lets_the_others_run_and_the_requeue_happen(fresh, monkeypatch) -> None:
    ran: list[str] = []

    def broken(budget_s: float) -> None:
        raise RuntimeError("disk full")

    unregisters = [preemption.on_signal(broken), preemption.on_signal(lambda b: ran.append("flush"))]
    monkeypatch.setattr(slurmcli, "job_record", lambda job: record(preempt="2026-11-30T10:05:00"))
    try:
        preemption.on_term()
    finally:
        for unregister in unregisters:
            unregister()
    assert ran == ["flush"] and fresh == ["42"]


def test_the_deadline_runs_on_the_main_thread_saves_requeues_and_the_signal_then_only_stops(fresh) -> None:
    """`signal_deadline` from another thread: SIGTERM reaches the main thread, which takes the deadline's
    path (the user signal's budget, a requeue); Slurm's own SIGTERM afterwards saves nothing more."""
    seen: list[tuple[str, float]] = []
    unregister = preemption.on_signal(lambda b: seen.append((threading.current_thread().name, b)))
    previous = signal.signal(signal.SIGTERM, lambda s, f: preemption.on_term())
    try:
        thread = threading.Thread(target=preemption.signal_deadline, args=("time limit in 120 s",))
        thread.start()
        thread.join()
        for _ in range(100):  # the handler runs between two bytecodes of this thread
            if seen:
                break
            time.sleep(0.01)
        preemption.on_term()
    finally:
        signal.signal(signal.SIGTERM, previous)
        unregister()
    assert seen == [("MainThread", 100.0)] and fresh == ["42"]


def test_deadline_arithmetic() -> None:
    assert deadline.save_at(None, 120) is None
    assert deadline.save_at(10_000.0, 120) == 9_880.0
    assert deadline.next_wait(None, 0.0) is None
    assert deadline.next_wait(9_880.0, 9_000.0, poll_s=30) == 30  # look again: the limit may move
    assert deadline.next_wait(9_880.0, 9_870.0, poll_s=30) == 10
    assert deadline.next_wait(9_880.0, 9_900.0) == 0.0  # past: save now


def test_end_time_comes_from_scontrol_else_the_environment() -> None:
    end = "2026-11-30T12:00:00"
    expected = datetime.fromisoformat(end).timestamp()
    environ = {"SLURM_JOB_END_TIME": "1000"}
    assert deadline.end_time_from({"EndTime": end, "TimeLimit": "02:00:00"}, environ) == expected
    assert deadline.end_time_from({"EndTime": "Unknown", "TimeLimit": "UNLIMITED"}, environ) == 1000.0
    assert deadline.end_time_from({}, environ) == 1000.0
    assert deadline.end_time_from({}, {}) is None
    assert deadline.end_time_from({}, {"SLURM_JOB_END_TIME": "0"}) is None


def test_deadline_watch_fires_once_when_serving_and_never_after_training(monkeypatch) -> None:
    fired: list[str] = []
    reads: list[float] = []
    ready = threading.Event()
    end = time.time() + 60.5

    def end_time() -> float:
        reads.append(time.monotonic())
        return end

    watch = deadline.DeadlineWatch(
        60, end_time=end_time, fire=fired.append, ready=ready.is_set, finished=lambda: False, poll_s=1.0
    )
    watch.start()
    time.sleep(1.5)
    assert fired == []  # the server does not serve yet
    # past the save time, waiting for the server, it wakes every 0.5 s but asks Slurm once per poll_s
    assert len(reads) in (1, 2) and all(b - a >= 1.0 for a, b in itertools.pairwise(reads))
    ready.set()
    watch.join(timeout=5)
    assert len(fired) == 1 and fired[0].startswith("time limit in")

    done = deadline.DeadlineWatch(
        60, end_time=lambda: time.time(), fire=fired.append, ready=lambda: True, finished=lambda: True
    )
    done.start()
    done.join(timeout=5)
    unlimited = deadline.DeadlineWatch(60, lambda: None, fired.append, lambda: True, lambda: False)
    unlimited.start()
    unlimited.join(timeout=5)
    assert len(fired) == 1 and not done.is_alive() and not unlimited.is_alive()


def test_a_deadline_after_a_cancel_neither_saves_again_nor_requeues(fresh, monkeypatch) -> None:
    """scancel moves the end time to now: the deadline thread may fire while the server stops; the job
    must stay cancelled."""
    saves: list[float] = []
    unregister = preemption.on_signal(saves.append)
    previous = signal.signal(signal.SIGTERM, lambda s, f: preemption.on_term())
    monkeypatch.setattr(slurmcli, "job_record", lambda job: record(state="COMPLETING"))
    try:
        preemption.on_term()  # the cancel's SIGTERM
        thread = threading.Thread(target=preemption.signal_deadline, args=("time limit in -1 s",))
        thread.start()
        thread.join()
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGTERM, previous)
        unregister()
    assert saves == [20.0] and fresh == []


def test_a_signal_that_comes_during_the_save_is_handled_after_it(fresh) -> None:
    """Slurm's USR2 arriving while the deadline's save runs used to run nested in it: submitit's handler
    requeued and raised SystemExit through the save, which was cut short (CI, the dev cluster's
    preemption test). The save holds USR2 and SIGTERM back and hands them over once it is over."""
    events: list[str] = []

    def handler(signum: int, frame) -> None:
        events.append(f"handler {signal.Signals(signum).name}")
        raise SystemExit(-1)  # as submitit's checkpoint_and_try_requeue does

    def slow_save(budget_s: float) -> None:
        signal.raise_signal(signal.SIGUSR2)  # Slurm's signal, mid-save
        time.sleep(0.05)
        events.append("save done")

    previous = signal.signal(signal.SIGUSR2, handler)
    unregister = preemption.on_signal(slow_save)
    try:
        with pytest.raises(SystemExit):
            preemption.checkpoint("deadline", 10.0)
        assert events == ["save done", "handler SIGUSR2"]
        assert signal.getsignal(signal.SIGUSR2) is handler  # put back
    finally:
        unregister()
        signal.signal(signal.SIGUSR2, previous)
