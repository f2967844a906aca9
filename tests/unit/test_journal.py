"""The consumed-episodes journal the trainer writes before each step (exactly-once training)."""

from __future__ import annotations

from pathlib import Path

from ajet_hpc.trainer.coordinator.journal import ConsumedJournal


def test_entries_read_back_and_a_torn_line_is_ignored(tmp_path: Path) -> None:
    journal = ConsumedJournal(tmp_path / "ckpt" / "consumed.jsonl")
    assert not journal.read().trained  # no file yet
    journal.append(1, ["a", "b"], ["x"])
    journal.append(2, ["c"], [])
    with open(journal.path, "ab") as f:
        f.write(b'{"step": 3, "trained": ["d"')  # a crash mid-append: step 3 never went to the ranks
    consumed = journal.read()
    assert consumed.trained == {"a": 1, "b": 1, "c": 2} and consumed.dropped == {"x": 1}
    assert "a" in consumed and "x" in consumed and "d" not in consumed
    assert consumed.trained_after(1) == 1
    journal.append(3, ["e"], [])  # the next append starts on a line of its own
    assert journal.read().trained["e"] == 3
