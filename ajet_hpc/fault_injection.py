"""Fault-injection hooks: the few failures a test must provoke at an instant no real part can be timed to,
and one production wait that a test shortens.

Each hook is an environment variable, unset in production; a module reads its hook only through `armed`,
and no other module of the package spells ``AJET_TEST_`` (``tests/unit/test_fault_injection.py``, which also
checks that every other ``AJET_`` variable the package spells is one of its known production variables). A
hook stays only where a real kill, a real full disk or a real network fault cannot land where the test
needs it, or where the production timing would make a test wait minutes for nothing:

- `EXIT_AFTER_COMMIT` (``trainer/ranks/zero.py``), ``N``: rank 0 exits like a kill -9 right after naming step
  N's checkpoint trusted and before the step's result is written, once per work dir. That window is a few
  microseconds between two file renames; a signal sent from outside lands before or after it.
- `SYNC_STALL_BUCKET` (``engine/weight_transfer.py``), ``K``: the gloo weight sender stops before bucket K
  (sleeps), so a test can kill it midway through a transfer. A transfer of the tiny model takes
  milliseconds; without the stall a kill cannot be placed inside it.
- `EXIT_AFTER_END` (``client/runner.py``), ``N``: a client array task exits like a kill -9 right after its
  N-th episode ended at the servers and before its own commit, once per run directory. The gap between the
  server's answer and the client's commit is one function call.
- `KEEPER_POLL_S` (``launch/keeper.py``), ``S``: the keeper of client arrays passes every S seconds instead of
  every 60 (``keeper.POLL_S``). A real whole-task death is what the test provokes; only the wait for the
  keeper's next pass is shortened (a pass costs the controller one query per array job, hence the minute).

The tests that use them and what they show are listed in docs/reliability.md ("Fault-injection hooks").
"""

from __future__ import annotations

import os
from collections.abc import Mapping

EXIT_AFTER_COMMIT = "AJET_TEST_EXIT_AFTER_COMMIT"
SYNC_STALL_BUCKET = "AJET_TEST_SYNC_STALL_BUCKET"
EXIT_AFTER_END = "AJET_TEST_EXIT_AFTER_END"
KEEPER_POLL_S = "AJET_TEST_KEEPER_POLL_S"

HOOKS: dict[str, str] = {
    EXIT_AFTER_COMMIT: "rank 0 exits right after step N's checkpoint is committed, before its result",
    SYNC_STALL_BUCKET: "the gloo weight sender stalls before bucket K of a transfer",
    EXIT_AFTER_END: "a client task exits after its N-th episode ended at the servers, before its commit",
    KEEPER_POLL_S: "the keeper of client arrays passes every S seconds instead of every 60",
}


def armed(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The hook's value when it is set (and not empty), else None; ``environ`` defaults to ``os.environ``."""
    if name not in HOOKS:
        raise ValueError(f"{name!r} is not a fault-injection hook ({', '.join(HOOKS)})")
    value = (os.environ if environ is None else environ).get(name, "")
    return value or None
