"""The server process's heap ager (``ajet_hpc.server.heap``): what lives on leaves the collector's sight
within one tick, young cyclic garbage is collected before anything is frozen, and cyclic garbage among
frozen objects is collected at the next thaw. Each case runs in a subprocess: a freeze would outlive the
test."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ajet_hpc.server.heap import HeapAger

AGER = """
import gc, weakref
from ajet_hpc.server.heap import HeapAger

class Node:
    pass

def cycle(freed, name):
    node = Node()
    node.me = node  # freed only by the cyclic collector
    return node, weakref.ref(node, lambda _: freed.append(name))

freed = []
ager = HeapAger(interval_s=1, thaw_every=2)
young, _ = cycle(freed, "young")
kept, kept_ref = cycle(freed, "kept")
del young  # garbage before the first tick
first = ager.tick()
print("first", first.thawed, first.collected >= 1, freed, gc.get_freeze_count() > 0)
del kept  # garbage now, but frozen
gc.collect()  # an ordinary full collection does not traverse the frozen
print("frozen", kept_ref() is not None, freed)
second = ager.tick()  # the thaw
print("thaw", second.thawed, second.collected >= 1, freed, gc.get_freeze_count() > 0)
"""


def test_the_ager_freezes_survivors_and_collects_frozen_garbage_at_the_thaw() -> None:
    done = subprocess.run([sys.executable, "-c", AGER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "first False True ['young'] True",  # the young garbage collected, the survivor frozen
        "frozen True ['young']",  # frozen cyclic garbage waits ...
        "thaw True True ['young', 'kept'] True",  # ... for the thaw, which freezes the survivors again
    ]


def test_bad_ager_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        HeapAger(interval_s=0)
    with pytest.raises(ValueError, match="thaw_every"):
        HeapAger(thaw_every=0)
