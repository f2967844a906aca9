"""Agent for code tasks (``builtin:code``, or any source whose tasks carry ``question``, ``function`` and
``tests``): ask once for the function, run the reply with the hidden tests in the sandbox, reward the share
of tests passed.

The script the sandbox runs is the model's code, then the tests. They print one result line that starts
with a random nonce the model never sees, so no output of its own can pass for a result. Code that
crashes, is stopped by a limit, or prints no result line earns 0, and the reason is in the episode's
metadata (``sandbox``: e.g. ``wall_time``, ``memory: MemoryError``). A test compares the JSON text of
the function's answer with the expected one. Code that patches the interpreter to fake it can still pass,
as with any in-process checker.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from ajet_hpc.environments.episode import EpisodeContext, Outcome
from ajet_hpc.environments.sandbox import Limits, run_python
from ajet_hpc.environments.single_call import ask

MAX_TOKENS = 96
LIMITS = Limits(wall_s=6, cpu_s=3, memory_mb=512, file_mb=4, processes=8, scratch_mb=16)
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

TESTS = """

import json as _json
_passed = 0
for _args, _expected in _json.loads({cases!r}):
    try:
        _passed += _json.dumps({function}(*_args)) == _json.dumps(_expected)
    except Exception:
        pass
print({nonce!r}, _passed, flush=True)
"""


def solve(ctx: EpisodeContext) -> Outcome:
    return check(extract_code(ask(ctx, "", MAX_TOKENS)), ctx.task.data)


def extract_code(reply: str) -> str:
    """The first fenced block of the reply, or the whole reply when it has none."""
    found = _BLOCK.search(reply)
    return found.group(1) if found else reply


def check(code: str, data: dict[str, Any], limits: Limits = LIMITS) -> Outcome:
    """Run ``code`` with the task's hidden tests in the sandbox; reward = share of tests passed."""
    tests = data["tests"]
    nonce = secrets.token_hex(16)
    script = code + TESTS.format(cases=json.dumps(tests), function=data["function"], nonce=nonce)
    result = run_python(script, limits)
    passed: int | None = None
    for line in result.stdout.splitlines():
        head, _, count = line.partition(" ")
        if head == nonce and count.strip().isdigit():
            passed = int(count)
    reason = result.reason or ("ok" if passed is not None else "no result line (the code ended the script)")
    passed = passed or 0
    metadata = {
        "code": code,
        "passed": passed,
        "tests": len(tests),
        "sandbox": reason,
        "isolation": result.isolation,
        "sandbox_s": round(result.wall_s, 3),
    }
    reward = passed / len(tests) if tests and result.ok else 0.0
    return Outcome(reward=reward, metadata=metadata)
