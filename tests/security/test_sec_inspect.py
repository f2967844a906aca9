"""The inspector prints what models and agents wrote without letting the terminal obey it (issue 14 item
13): escape sequences in model text, task ids, tool calls and tracebacks come out escaped, newlines and tabs
of model text stay readable. A real run directory with a real HDF5 store, read through the CLI's ``main``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ajet_hpc.config import dump_topology, load_topology
from ajet_hpc.engine.tiny import build_tokenizer
from ajet_hpc.offline.cli import main
from ajet_hpc.offline.views import printable
from ajet_hpc.storage.episode_store_writer import EpisodeWriter
from ajet_hpc.storage.records import EpisodeRecord
from ajet_hpc.tracking.context import ContextTracker

ESC = "\x1b"
CLEAR = f"{ESC}[2J{ESC}[H"  # clears the screen
TITLE = f"{ESC}]0;owned{ESC}\\"  # sets the window title
HIDDEN = f"{ESC}[8m"  # hides what follows
T0 = 1_700_000_000.0


def hostile_episode(episode_id: str, state: str, reason: str | None) -> EpisodeRecord:
    tracker = ContextTracker(build_tokenizer())
    question = f"Line one\n\tindented{CLEAR} question{TITLE}"
    answer = f"fine\u202eevil{HIDDEN}\nsecond line"
    call = {"id": f"c{ESC}[1m", "type": "function", "function": {"name": f"run{ESC}[5m", "arguments": "{}"}}
    reply: dict[str, Any] = {"role": "assistant", "content": answer, "tool_calls": [call]}
    plan = tracker.build_prompt([{"role": "user", "content": question}], None)
    ids = tracker.tokenizer.encode("fine second line<|im_end|>", add_special_tokens=False)
    tracker.record(plan, ids, [-0.5] * len(ids), reply, f"stop{ESC}[0m", 1, started_at=T0, finished_at=T0 + 1)
    return EpisodeRecord(
        episode_id=episode_id,
        model="policy",
        task_id=f"task{TITLE}{CLEAR}",
        group=f"math{HIDDEN}",
        state=state,
        reward=None if reason else 1.0,
        turn_rewards=None,
        reason=reason,
        metadata={"note": f"x{ESC}[31m"},
        started_at=T0,
        ended_at=T0 + 2,
        timelines=tracker.timelines,
    )


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    data = {
        "run": {"name": "hostile", "dir": str(run)},
        "servers": [{"name": "policy", "model": "builtin:tiny"}],
    }
    (run / "topology.yaml").write_text(dump_topology(load_topology(data)))
    (run / "data").mkdir()
    traceback = f'Traceback (most recent call last):\n  File "agent.py"\nValueError: {CLEAR}{TITLE}gone'
    writer = EpisodeWriter(run / "data" / "policy.h5")
    writer.append_episode(hostile_episode("ep-show", "finished", None))
    writer.append_episode(hostile_episode("ep-failed", "aborted", traceback))
    writer.close()
    return run


@pytest.mark.parametrize("command", [["show", "ep-show"], ["show", "ep-failed", "--tokens"], ["summary"],
                                     ["episodes"]])  # fmt: skip
def test_no_escape_sequence_reaches_the_terminal(run_dir: Path, capsys, command: list[str]) -> None:
    assert main([str(run_dir), *command]) == 0
    out = capsys.readouterr().out
    assert ESC not in out and "\u202e" not in out
    assert "\\x1b" in out  # shown, escaped: the reader sees that something was there


def test_show_keeps_model_text_readable_and_escapes_the_rest(run_dir: Path, capsys) -> None:
    assert main([str(run_dir), "show", "ep-failed"]) == 0
    out = capsys.readouterr().out
    assert "task task\\x1b]0;owned\\x1b\\\\x1b[2J\\x1b[H" in out
    assert "Line one\n    \tindented\\x1b[2J\\x1b[H question" in out  # the newline and tab kept
    assert "fine\\u202eevil\\x1b[8m\n    second line" in out
    assert "-> run\\x1b[5m({})" in out and "finish stop\\x1b[0m" in out
    assert "Traceback (most recent call last):\n" in out and "ValueError: \\x1b[2J" in out


def test_printable() -> None:
    assert printable("a\tb\nc\rd\x00\x7f\x9b\ud800") == "a\tb\nc\\x0dd\\x00\\x7f\\x9b\\ud800"
    assert printable("a\tb\nc", lines=False) == "a\\x09b\\x0ac"
    assert printable("plain ünïcode ✓") == "plain ünïcode ✓"
