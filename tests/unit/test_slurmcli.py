"""Parsing of scontrol records (pure; the real commands are exercised in tests/cluster)."""

from __future__ import annotations

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
