"""The file helpers every durable log and lock uses (ajet_hpc/storage/files.py), on real files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from ajet_hpc.storage.files import (
    append_jsonl,
    fsync_dir,
    holder_dead,
    pid_alive,
    read_jsonl,
    write_json_atomic,
)


def test_append_closes_off_a_torn_line_and_the_reader_skips_it(tmp_path: Path) -> None:
    path = tmp_path / "log" / "rows.jsonl"
    append_jsonl(path, {"step": 1})
    with open(path, "ab") as handle:
        handle.write(b'{"step": 2, "tor')  # a crash mid-append
    append_jsonl(path, {"step": 3, "b": [1, 2]})
    assert path.read_bytes().count(b"\n") == 3
    assert list(read_jsonl(path)) == [{"step": 1}, {"step": 3, "b": [1, 2]}]
    assert list(read_jsonl(tmp_path / "absent.jsonl")) == []


def test_atomic_json_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary file left
    fsync_dir(tmp_path)


def test_a_holder_is_dead_only_on_this_host_and_only_when_its_process_is_gone() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone = int(done.stdout)
    here = socket.gethostname()
    assert pid_alive(os.getpid()) and not pid_alive(gone) and not pid_alive(0)
    assert holder_dead(here, gone)
    assert not holder_dead(here, os.getpid())
    assert not holder_dead("another-node", gone)  # judged by age there, not by pid
    assert not holder_dead(here, None)
