"""Parsing of scontrol records and the retry of cut queries (the real commands: tests/cluster)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ajet_hpc.slurm import slurmcli
from ajet_hpc.slurm.slurmcli import _parse_scontrol_record, _task_ids, expand_ranges


def test_expand_ranges() -> None:
    assert expand_ranges("0-2") == [0, 1, 2]
    assert expand_ranges("1,3-5") == [1, 3, 4, 5]
    assert expand_ranges("7") == [7]


def test_pending_array_record_stands_for_each_task() -> None:
    rec = _parse_scontrol_record("JobId=42 ArrayJobId=42 ArrayTaskId=0-2%3 JobState=PENDING Partition=cpu")
    assert _task_ids(rec) == ["42_0", "42_1", "42_2"]


def test_running_array_task_and_hetjob_component() -> None:
    task = _parse_scontrol_record("JobId=43 ArrayJobId=42 ArrayTaskId=1 JobState=RUNNING NodeList=c2")
    assert _task_ids(task) == ["42_1"]
    het = _parse_scontrol_record("JobId=51 HetJobId=50 HetJobOffset=1 JobState=RUNNING")
    assert _task_ids(het) == ["50+1"]
    plain = _parse_scontrol_record("JobId=60 JobState=COMPLETED NodeList=g1")
    assert _task_ids(plain) == ["60"]


def _flaky_tool(tmp_path: Path, failures: str) -> Path:
    """A stand-in for scontrol (a fake: a real controller cannot be made to drop one answer on demand) that
    fails the ways listed in ``failures`` (one per call, 'pipe' = killed by SIGPIPE, 'socket' = Slurm's
    "Socket timed out" message, 'bad' = a wrong question) and then answers."""
    tool = tmp_path / "scontrol"
    count = tmp_path / "calls"
    tool.write_text(
        "#!/bin/sh\n"
        f'n=$(cat "{count}" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "{count}"\n'
        f"set -- {failures}\n"
        'i=1; for f in "$@"; do if [ $i = $n ]; then\n'
        "  case $f in pipe) kill -PIPE $$;;\n"
        '  socket) echo "Socket timed out on send/recv operation" >&2; exit 1;;\n'
        '  bad) echo "invalid option" >&2; exit 1;; esac; fi; i=$((i+1)); done\n'
        'echo "JobId=27 JobState=RUNNING Partition=gpu NodeList=g1"\n'
    )
    tool.chmod(0o755)
    return tool


def _calls(tmp_path: Path) -> int:
    return int((tmp_path / "calls").read_text())


def test_a_query_cut_by_the_controller_is_asked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurmcli, "QUERY_BACKOFF_S", 0.01)
    tool = _flaky_tool(tmp_path, "pipe socket")
    done = slurmcli._query([str(tool)])
    assert done.returncode == 0 and "JobState=RUNNING" in done.stdout
    assert _calls(tmp_path) == 3


def test_a_wrong_query_is_not_asked_again_and_a_dead_controller_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurmcli, "QUERY_BACKOFF_S", 0.01)
    tool = _flaky_tool(tmp_path, "bad")
    assert slurmcli._query([str(tool)]).returncode == 1
    assert _calls(tmp_path) == 1
    (tmp_path / "calls").unlink()
    tool = _flaky_tool(tmp_path, "pipe pipe pipe")
    done = slurmcli._query([str(tool)])
    assert done.returncode == -signal.SIGPIPE  # the last answer, for the caller to raise on
    assert _calls(tmp_path) == slurmcli.QUERY_TRIES
