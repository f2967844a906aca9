"""math-verify as a reward: is a model's answer the same mathematical object as the gold answer?

``math_reward(answer, gold)`` is 1.0 when math-verify (``parse`` both, ``verify(gold, answer)``) finds them
equal, else 0.0: ``1/2``, ``0.5``, ``\\frac{1}{2}`` and ``\\boxed{0.5}`` are the same answer; the last
answer in a reasoning text counts.

math-verify bounds its own work with ``signal.alarm``, which works only in a process's main thread, and a
runner runs its agents in threads. So the check runs in a small pool of its own (one spawned process per
client task, started at the first call and reused), where math-verify's timeouts work; a check that still
takes longer than ``timeout_s`` is abandoned (the pool is replaced) and scores 0.0. Install math-verify in
the group's runtime (``env: math.txt``).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import threading
from multiprocessing.pool import Pool

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0
"""Longest one check may take, beyond math-verify's own limits (5 s to parse, 5 s to compare)."""

_pool: Pool | None = None
_lock = threading.Lock()


class MathVerifyMissing(ImportError):
    """math-verify is not installed in this runtime."""


def _verify(answer: str, gold: str) -> bool:
    """(In the pool's process, its main thread.)"""
    from math_verify import parse, verify

    return bool(verify(parse(gold), parse(answer)))


def _get_pool() -> Pool:
    global _pool
    with _lock:
        if _pool is None:
            if importlib.util.find_spec("math_verify") is None:
                raise MathVerifyMissing(
                    "math-verify is not installed in this client runtime: give the group `env: math.txt` "
                    "(envs/math.txt) or install math-verify there"
                )
            _pool = multiprocessing.get_context("spawn").Pool(1)
        return _pool


def _replace_pool(stuck: Pool) -> None:
    global _pool
    with _lock:
        if _pool is stuck:
            _pool = None
    stuck.terminate()


def math_reward(answer: str, gold: str, timeout_s: float = TIMEOUT_S) -> float:
    """1.0 if ``answer`` is mathematically ``gold`` (math-verify), else 0.0; 0.0 (logged) when the check
    fails or takes longer than ``timeout_s``."""
    pool = _get_pool()
    pending = pool.apply_async(_verify, (answer, gold))
    try:
        return 1.0 if pending.get(timeout_s) else 0.0
    except multiprocessing.TimeoutError:
        log.warning(
            "math-verify took over %.0f s on an answer of %d characters: reward 0", timeout_s, len(answer)
        )
        _replace_pool(pool)
    except Exception as exc:  # math-verify raised: the answer is not a match
        log.warning("math-verify failed (%s: %s): reward 0", type(exc).__name__, exc)
    return 0.0
