"""The sandbox's limits on real code under bubblewrap (the hostile cases through a real client run are in
tests/component/test_environments.py) and its rlimits fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ajet_hpc.environments.sandbox import Limits, isolation_in_use, run_python

QUICK = Limits(wall_s=5, cpu_s=2, memory_mb=256, file_mb=1, processes=8, scratch_mb=4, output_chars=100)


def test_a_well_behaved_script_runs_with_its_stdin_and_a_private_writable_dir() -> None:
    code = "import sys, tempfile\nopen('f', 'w').write(sys.stdin.read())\n"
    code += "print(open('f').read(), tempfile.gettempdir())"
    result = run_python(code, QUICK, stdin="hello")
    assert result.ok and result.stdout.split() == ["hello", "/box/tmp"], result
    assert result.isolation == isolation_in_use() == "bwrap"


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        ("open('big', 'wb').write(b'x' * 2 * 1024**2)", "file_size"),  # past file_mb
        (
            "for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * 900 * 1024)",
            "exit 1: OSError: [Errno 28]",
        ),
        ("import os\nprint(os.listdir('/'))\nopen('/usr/x', 'w')", "exit 1: OSError: [Errno 30] Read-only"),
        ("import os\nos.kill(os.getpid(), 9)", "signal SIGKILL"),
        ("raise SystemExit(3)", "exit 3"),
    ],
)
def test_each_limit_names_itself_in_the_reason(code: str, reason: str) -> None:
    result = run_python(code, QUICK)
    assert result.reason is not None and result.reason.startswith(reason), result


def test_output_is_kept_up_to_its_cap_and_files_of_the_host_are_out_of_reach(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t")
    home = os.path.expanduser("~/.bashrc")
    result = run_python(f"print('y' * 10_000)\nprint(open({str(secret)!r}).read())", QUICK)
    assert (
        result.stdout == "y" * 100
        and result.reason
        == f"exit 1: FileNotFoundError: [Errno 2] No such file or directory: {str(secret)!r}"
    )
    result = run_python(f"print(open({home!r}).read())", QUICK)
    assert result.reason is not None and result.reason.startswith("exit 1: ") and not result.stdout


def test_a_limit_that_is_no_positive_number_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=0)


FALLBACK = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
from ajet_hpc.environments.sandbox import Limits, run_python
ok = run_python("print(6 * 7)", Limits(wall_s=20))
big = run_python("x = bytearray(4 * 1024**3)", Limits(wall_s=20, memory_mb=256))
print(json.dumps([ok.isolation, ok.stdout.strip(), big.reason]))
"""


def test_the_rlimits_fallback_keeps_its_limits_and_says_loudly_that_it_does_not_isolate() -> None:
    env = {**os.environ, "AJET_SANDBOX": "rlimits", "AJET_SANDBOX_PYTHON": "/usr/bin/python3"}
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["rlimits", "42", "memory: MemoryError"]
    assert "SANDBOX WITHOUT ISOLATION" in done.stderr and "network" in done.stderr


def test_bwrap_required_but_refused_names_the_setting() -> None:
    code = "from ajet_hpc.environments.sandbox import run_python; run_python('pass')"
    env = {**os.environ, "AJET_SANDBOX": "firejail"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "AJET_SANDBOX='firejail': expected bwrap or rlimits" in done.stderr
