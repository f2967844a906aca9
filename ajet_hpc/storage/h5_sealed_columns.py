"""The sealed columns of the server store: its big per-element columns (tokens, logprobs, JSON bytes),
deflate-compressed, each chunk written exactly once (see :mod:`ajet_hpc.storage.h5_layout` and
docs/storage.md, "Server store").

Under SWMR, HDF5 never frees a chunk that is rewritten with another size (a reader may still hold its old
address), so only full chunks go to the column, compressed by us (shuffle + deflate: what HDF5's own
filters would write, through ISA-L where installed, :func:`deflate`) with ``write_direct_chunk``; the open
chunk lives uncompressed in ``_tail/<column>``, two slots used in turn (chunk ``k`` in slot ``k % 2``). The
``sealed`` dataset counts the full chunks per space; it is flushed before a slot is reused, so a reader
that read a slot and then sees the count pass that chunk knows to read the column instead (a sequence
lock). :class:`SealedColumn` is the writer's side, :class:`SealedReader` the reader's.
"""

from __future__ import annotations

import importlib
import zlib
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from ajet_hpc.storage.h5_layout import StoreError, write_at


def _isal() -> Any:
    """ISA-L's zlib module (the ``isal`` package, a declared dependency), or None without it (``deflate``
    then uses zlib: the same format, more CPU)."""
    try:
        return importlib.import_module("isal.isal_zlib")
    except ImportError:
        return None


_isal_zlib = _isal()


@dataclass
class SealedColumn:
    """One compressed column, writer side: full chunks compressed once into the column, the open chunk in
    its tail slot. ``stage`` fills the chunk and seals it when full; ``write_tail`` writes what is new."""

    main: h5py.Dataset
    tail: h5py.Dataset
    space: str
    chunk: int

    def __post_init__(self) -> None:
        self.buf = np.zeros(self.chunk, self.main.dtype)
        self.fill = self.sealed = self._clean = 0
        self._shuffle, self._level = _filters(self.main)
        # Buffers of chunks written out, reused for the chunks to come (up to ~8 MB a column): a fresh
        # buffer, or a copy of each full one, cost more than filling it (page faults on every allocation).
        self._spare: list[np.ndarray] = []
        self._spare_max = max(2, (8 << 20) // self.buf.nbytes)

    def recover(self, count: int, sealed_on_disk: int) -> None:
        """Continue after ``count`` committed elements. The open chunk's committed part is in its tail slot,
        unless a failed append sealed that chunk (``sealed_on_disk`` is past it): then the slot may have been
        reused, and the column holds it. Either way it is written back to the slot, where readers look."""
        self.sealed, self.fill = divmod(count, self.chunk)
        base, start = (self.sealed % 2) * self.chunk, self.sealed * self.chunk
        if self.fill:
            source = self.main[start : start + self.fill] if sealed_on_disk > self.sealed else None
            self.buf[: self.fill] = source if source is not None else self.tail[base : base + self.fill]
            write_at(self.tail, base, self.buf[: self.fill])
        self._clean = self.fill

    def save(self) -> tuple[int, int, int, np.ndarray]:
        """The staging state, for ``restore`` (a group that turns out unstorable is undone). Without a copy:
        staging never writes below ``fill`` of the open chunk's buffer, and a chunk that fills is handed on
        in its buffer (another takes its place), so the buffer kept here still holds the open part."""
        return self.sealed, self.fill, self._clean, self.buf

    def restore(self, state: tuple[int, int, int, np.ndarray]) -> None:
        self.sealed, self.fill, self._clean, self.buf = state

    def drop_unsealed(self) -> None:
        """Shrink the column to its sealed chunks (after ``sealed`` says so: readers never look past it)."""
        self.main.resize((self.sealed * self.chunk,))

    def stage(self, values: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Add ``values``; returns the chunks they filled, ``(index, data)``, to compress (``compress``, any
        thread: zlib releases the GIL) and write (``seal``) before ``sealed`` is flushed and ``write_tail``
        runs; each ``data`` is given back with ``recycle`` once written."""
        pos, full = 0, []
        while pos < len(values):
            take = min(self.chunk - self.fill, len(values) - pos)
            self.buf[self.fill : self.fill + take] = values[pos : pos + take]
            self.fill += take
            pos += take
            if self.fill == self.chunk:
                full.append((self.sealed, self.buf))
                self.buf = self._spare.pop() if self._spare else np.empty(self.chunk, self.main.dtype)
                self.sealed, self.fill, self._clean = self.sealed + 1, 0, 0
        return full

    def recycle(self, data: np.ndarray) -> None:
        """Take back the buffer of a chunk that ``stage`` handed on, once it is compressed and written."""
        if len(self._spare) < self._spare_max and data is not self.buf:
            self._spare.append(data)

    def seal(self, k: int, compressed: bytes) -> None:
        """Write chunk ``k``, compressed, to the column (once: see the module's docstring); the column grows
        to hold it unless ``reserve`` made it long enough."""
        end = (k + 1) * self.chunk
        if self.main.id.shape[0] < end:
            self.main.resize((end,))
        self.main.id.write_direct_chunk((k * self.chunk,), compressed, 0)

    def reserve(self, chunks: int) -> None:
        """Grow the column to ``chunks`` full chunks at once (a group's chunks are then written without a
        resize each; readers never look past ``sealed``, a reopen shrinks the column back to it)."""
        if self.main.id.shape[0] < chunks * self.chunk:
            self.main.resize((chunks * self.chunk,))

    def seal_open(self) -> None:
        """Write the open chunk's part into the column as well (padded with zeros, compressed) and set the
        column's extent to exactly the elements staged, so that the column read whole (plain h5py, any HDF5
        tool) holds all of them. Readers of this package still read the open chunk from its tail slot
        (``sealed`` is not changed). The chunk is written again when it fills (under SWMR its old space is
        not reused: one partial chunk per column per ``seal_open`` call, see docs/storage.md) and a reopen
        drops it again (``drop_unsealed``)."""
        edge = self.sealed * self.chunk
        if self.fill:
            data = self.buf.copy()
            data[self.fill :] = 0
            self.main.resize((edge + self.fill,))
            self.main.id.write_direct_chunk((edge,), self.compress(data), 0)
        else:
            self.main.resize((edge,))

    def write_tail(self) -> None:
        if self.fill > self._clean:
            write_at(
                self.tail, (self.sealed % 2) * self.chunk + self._clean, self.buf[self._clean : self.fill]
            )
            self._clean = self.fill

    @property
    def fast_deflate(self) -> bool:
        """Whether this column's chunks deflate through ISA-L (:func:`isal_deflates`)."""
        return isal_deflates(self._level)

    def compress(self, data: np.ndarray) -> bytes:
        """``data`` through the column's filters: shuffled (multi-byte types), then deflated
        (:func:`deflate`): what HDF5's shuffle + deflate filters read back. The shuffle is a transposed
        copy made contiguous by numpy (``.T.tobytes()`` takes a slow element-wise path: 5-10x the time on a
        65k-token chunk, more than deflating it), handed to deflate without another copy."""
        contiguous = np.ascontiguousarray(data)
        if self._shuffle:
            contiguous = np.ascontiguousarray(contiguous.view(np.uint8).reshape(-1, data.itemsize).T)
        return deflate(contiguous.data, self._level)


def deflate(raw: bytes | memoryview, level: int) -> bytes:
    """``raw`` as a zlib stream (what HDF5's deflate filter stores and inflates), at the column's ``level``.
    Levels 1-3 go through ISA-L's igzip when the ``isal`` package is there: the same format (any zlib
    inflates it, HDF5 included), about 6x less CPU than zlib at level 1 on the benchmark's chunks and a
    smaller result (docs/storage.md, "Compression choice"); other levels, or without ``isal``, zlib."""
    if isal_deflates(level):
        return _isal_zlib.compress(raw, level)
    return zlib.compress(raw, level)


def isal_deflates(level: int) -> bool:
    """Whether :func:`deflate` at ``level`` goes through ISA-L (the fast path), not zlib."""
    return _isal_zlib is not None and 1 <= level <= 3


def _filters(dataset: h5py.Dataset) -> tuple[bool, int]:
    """(shuffle?, deflate level) of a sealed column, read from the file: chunks are written pre-filtered."""
    dcpl = dataset.id.get_create_plist()
    codes = [dcpl.get_filter(i) for i in range(dcpl.get_nfilters())]
    names = [code for code, *_ in codes]
    if names not in ([h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_DEFLATE], [h5py.h5z.FILTER_DEFLATE]):
        raise StoreError(f"{dataset.file.filename}: column {dataset.name} has unexpected filters {names}")
    return names[0] == h5py.h5z.FILTER_SHUFFLE, int(codes[-1][2][0])


@dataclass
class SealedReader:
    """One compressed column, reader side."""

    main: h5py.Dataset
    tail: h5py.Dataset
    space: str
    chunk: int
    fresh_for: int = 0  # the main column was refreshed when this many chunks were known sealed

    def read(self, start: int, stop: int, sealed: int) -> tuple[np.ndarray, int | None]:
        """Elements ``[start, stop)`` given ``sealed`` full chunks; and the chunk read from a tail slot."""
        if start >= stop:
            return np.zeros(0, self.main.dtype), None
        edge = sealed * self.chunk
        parts = []
        if start < edge:
            end = min(stop, edge)
            if (end - 1) // self.chunk >= self.fresh_for:
                self.main.refresh()
                self.fresh_for = sealed
            parts.append(self.main[start:end])
        if stop <= edge:
            return parts[0] if parts else np.zeros(0, self.main.dtype), None
        base = (sealed % 2) * self.chunk - edge
        parts.append(self.tail[base + max(start, edge) : base + stop])
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)), sealed
