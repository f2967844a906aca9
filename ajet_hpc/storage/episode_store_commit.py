"""The ``commit`` counter of the server store, read back: what its writer and its readers take as committed.

The 1-element-per-space ``commit`` dataset (:mod:`ajet_hpc.storage.h5_layout`) counts the committed
elements of each space, then a check value (``commit_check``). The writer
(:mod:`ajet_hpc.storage.episode_store_writer`) writes it last in each commit and reads it back when it
(re)opens the file; readers (:mod:`ajet_hpc.storage.episode_store_reader`) read it at each refresh and see
nothing past it. A counter read while a write of it is half-done fails its check and is read again.
"""

from __future__ import annotations

import time
from pathlib import Path

import h5py
import numpy as np

from ajet_hpc.storage.h5_layout import SPACES, StoreError, commit_check

__all__ = ["SPACE_INDEX", "read_commit"]

SPACE_INDEX = {space: i for i, space in enumerate(SPACES)}
"""Where each space's count sits in the ``commit`` and ``sealed`` datasets."""


def read_commit(ds: h5py.Dataset, path: Path, tries: int = 50) -> np.ndarray:
    """The committed counts per space; retried while a concurrent write is seen half-done."""
    for _ in range(tries):
        ds.refresh()
        raw = ds[:]
        if len(raw) == len(SPACES) + 1 and int(raw[-1]) == commit_check(raw[:-1]):
            return raw[:-1].astype(np.int64)
        time.sleep(0.002)
    raise StoreError(f"{path}: the commit counter does not check out; the file is damaged")
