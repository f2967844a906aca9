"""The HDF5 layout of the server store, and the plumbing under it (see docs/storage.md, "Server store").

Everything lives in flat, appendable datasets; a *space* is one kind of element (episodes, timelines, tokens,
bytes of JSON...) and the 1-element-per-space ``commit`` dataset says how many of each are committed. Three
kinds of dataset:

- **rows**: a table of fixed-size records, one per element of its space (``episodes``, ``timelines``...),
  unfiltered, rewritten nowhere: an append writes past the end.
- **offsets**: ``int64 [n+1]`` per row, into another space (``timeline_offsets`` into tokens...).
- **sealed columns**: the big ones (tokens, logprobs, JSON bytes), deflate-compressed, each chunk written
  exactly once; the open chunk lives uncompressed in ``_tail/<column>``, and the ``sealed`` dataset counts
  the full chunks per space (:mod:`ajet_hpc.storage.h5_sealed_columns`, which writes and reads them).

This module holds the layout (its spaces, rows, offsets and columns), creating, opening and checking a file,
a read-only view of a file a failed writer left, the HDF5 superblock's write flags and checksum, and the
low-level dataset writes every dataset uses.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ajet_hpc.storage.files import fsync_dir, pid_alive

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
TAIL = "_tail"
DEFLATE_LEVEL = (
    1  # docs/storage.md: level 4 (layout 1 files written before 2026-12-01) is 5-13% smaller, 1.7x slower
)
ROW_CHUNK = 4096  # rows per chunk of the uncompressed tables and offsets

# Kinds of element: ``commit`` counts each (then a check value), ``sealed`` counts full chunks of each.
SPACES = (
    "episodes", "timelines", "tokens", "episode_json", "timeline_json",
    "steps", "samples", "sample_tokens", "step_json", "sample_json",
)  # fmt: skip

EPISODE_ROW = np.dtype([("reward", "<f8"), ("started_at", "<f8"), ("ended_at", "<f8"), ("id_hash", "<u8")])
TIMELINE_ROW = np.dtype(
    [
        ("prompt_len", "<i4"),
        ("n_drift", "<i4"),
        ("policy_version", "<i8"),
        ("started_at", "<f8"),
        ("finished_at", "<f8"),
    ]
)
STEP_ROW = np.dtype([("step", "<i8")])
SAMPLE_ROW = np.dtype([("policy_version", "<i8"), ("weight", "<f8")])

ROWS = {"episodes": EPISODE_ROW, "timelines": TIMELINE_ROW, "steps": STEP_ROW, "samples": SAMPLE_ROW}
# name -> (space of its rows, space it points into)
OFFSETS = {
    "episode_timeline_offsets": ("episodes", "timelines"),
    "episode_json_offsets": ("episodes", "episode_json"),
    "timeline_offsets": ("timelines", "tokens"),
    "timeline_json_offsets": ("timelines", "timeline_json"),
    "step_sample_offsets": ("steps", "samples"),
    "step_json_offsets": ("steps", "step_json"),
    "sample_token_offsets": ("samples", "sample_tokens"),
    "sample_json_offsets": ("samples", "sample_json"),
}
# name -> (dtype, space)
SEALED = {
    "tokens": ("<i4", "tokens"),
    "logprobs": ("<f4", "tokens"),
    "loss_mask": ("i1", "tokens"),
    "authors": ("i1", "tokens"),
    "episode_json": ("u1", "episode_json"),
    "timeline_json": ("u1", "timeline_json"),
    "step_json": ("u1", "step_json"),
    "sample_json": ("u1", "sample_json"),
    "sample_tokens": ("<i4", "sample_tokens"),
    "sample_loss_mask": ("i1", "sample_tokens"),
    "sample_advantages": ("<f4", "sample_tokens"),
    "sample_old_logprobs": ("<f4", "sample_tokens"),
}


class StoreError(Exception):
    """A store that cannot be used as asked; the message names the file and the problem."""


def commit_check(counts: np.ndarray) -> int:
    """The last element of ``commit``: a reader that sees another value read a torn write and retries."""
    total = 0x5BD1E995
    for i, count in enumerate(counts.tolist()):
        total = (total * 0x9E3779B1 + (i + 1) * int(count)) & 0x3FFFFFFFFFFFFFFF
    return total


# ------------------------------------------------------------------------------------------ files
def create_file(path: Path, chunk_tokens: int) -> None:
    """Create an empty store at ``path``: written under a temporary name, fsynced, renamed."""
    if chunk_tokens < 1:
        raise StoreError(f"{path}: chunk_tokens must be >= 1, got {chunk_tokens}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w", libver="latest", locking=False) as f:
            f.attrs["layout_version"] = LAYOUT_VERSION
            f.attrs["chunk_tokens"] = chunk_tokens
            f.attrs["deflate_level"] = DEFLATE_LEVEL
            f.attrs["created_at"] = time.time()
            commit = _fixed(f, "commit", len(SPACES) + 1)
            commit[:] = np.append(np.zeros(len(SPACES), np.int64), commit_check(np.zeros(len(SPACES))))
            commit.attrs["spaces"] = json.dumps(SPACES)
            _fixed(f, "sealed", len(SPACES)).attrs["spaces"] = json.dumps(SPACES)
            for name, dtype in ROWS.items():
                f.create_dataset(name, (0,), dtype, maxshape=(None,), chunks=(ROW_CHUNK,))
            for name in OFFSETS:
                f.create_dataset(name, data=np.zeros(1, np.int64), maxshape=(None,), chunks=(ROW_CHUNK,))
            for name, (column_dtype, _) in SEALED.items():
                chunk, wide = chunk_tokens, np.dtype(column_dtype).itemsize > 1
                filters = {"shuffle": True} if wide else {}
                f.create_dataset(
                    name, (0,), column_dtype, maxshape=(None,), chunks=(chunk,), compression="gzip",
                    compression_opts=DEFLATE_LEVEL, **filters,
                )  # fmt: skip
                _fixed(f, f"{TAIL}/{name}", 2 * chunk, column_dtype, chunk)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _fixed(
    f: h5py.File, name: str, size: int, dtype: Any = np.int64, chunk: int | None = None
) -> h5py.Dataset:
    """A fixed-size dataset whose chunks are allocated now: rewritten in place, its chunk index never
    changes (so a reader's cached index never goes stale)."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_chunk((chunk or size,))
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_value(np.zeros(1, dtype))
    space = h5py.h5s.create_simple((size,))
    group = f.require_group(name.rsplit("/", 1)[0]) if "/" in name else f
    dsid = h5py.h5d.create(
        group.id, name.rsplit("/", 1)[-1].encode(), h5py.h5t.py_create(np.dtype(dtype)), space, dcpl=dcpl
    )
    return h5py.Dataset(dsid)


def open_file(path: Path, *, write: bool) -> h5py.File:
    """Open a store: for append (``r+``, no chunk cache: every write goes straight to the file) or for SWMR
    reading. HDF5's file locks are off (they fail on NFS with errno 37, and SWMR does not need them)."""
    try:
        if write:
            handle = h5py.File(path, "r+", libver="latest", locking=False, rdcc_nbytes=0)
        else:
            handle = h5py.File(path, "r", libver="latest", swmr=True, locking=False)
    except FileNotFoundError:
        raise StoreError(f"{path}: no such store") from None
    except OSError as exc:
        raise StoreError(f"{path}: cannot open the store: {_why(exc)}") from exc
    try:
        check_layout(handle, path)
    except BaseException:
        handle.close()
        raise
    return handle


def _why(exc: OSError) -> str:
    text = str(exc)
    if "signature" in text or "not an HDF5" in text or "file signature not found" in text:
        return f"not an HDF5 file ({text})"
    if "already open for read-only" in text:
        return f"{text}: close this process's EpisodeReader on it before opening a writer"
    if "already open for write" in text:
        return f"{text}: another process writes it without SWMR (one writer per store)"
    if "errno = 37" in text or "No locks available" in text:
        return f"{text}: set HDF5_USE_FILE_LOCKING=FALSE on this file system"
    return text


def check_layout(handle: h5py.File, path: Path) -> None:
    version = handle.attrs.get("layout_version")
    if version is None or "commit" not in handle:
        raise StoreError(
            f"{path}: not a server episode store (no layout_version attribute or commit counter)"
        )
    if isinstance(version, bytes):
        version = version.decode(errors="replace")
    if isinstance(version, str) and version.strip().isdigit():
        version = int(version)
    if isinstance(version, bool) or not isinstance(version, int | np.integer):
        raise StoreError(
            f"{path}: its layout_version attribute is {version!r}, not a version number: the file is not "
            "a store this code wrote, or it was damaged"
        )
    number = int(version)
    if number != LAYOUT_VERSION:
        raise StoreError(
            f"{path}: store layout version {number}, this code reads layout version {LAYOUT_VERSION}; "
            "read it with the ajet_hpc release that wrote it, or start a new run directory"
        )


def open_for_read(path: Path, wait_s: float = 3.0) -> h5py.File:
    """Open for SWMR reading; while a writer is switching the file to SWMR (at its start), wait for it.

    A file left as a writer failed (disk full: shorter than its superblock says; or still marked open for
    writing without SWMR, by a writer that died) is read through a :class:`RepairedView` instead: what is
    committed in it is intact, the reader sees exactly that (and nothing appended later)."""
    try:
        check_not_truncated(path)
    except StoreError as exc:
        if "truncated" not in str(exc):
            raise
        return _open_repaired(path, str(exc))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return open_file(path, write=False)
        except StoreError as exc:
            text = str(exc)
            if "already open for write" in text and time.monotonic() <= deadline:
                time.sleep(0.05)
                continue
            if "already open for write" in text or "not already open for SWMR writing" in text:
                return _open_repaired(path, text)
            raise


def _open_repaired(path: Path, why: str) -> h5py.File:
    log.warning("%s: %s; reading its committed part through a repaired read-only view", path, why)
    view = RepairedView(path)
    try:
        handle = h5py.File(view, "r", libver="latest", locking=False)
    except OSError as exc:
        view.close()
        raise StoreError(f"{path}: cannot read the store even through a repaired view: {exc}") from exc
    weakref.finalize(handle, view.close)
    try:
        check_layout(handle, path)
        _check_committed_on_disk(handle, path, view.real_size)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        handle.close()
        raise StoreError(f"{path}: truncated inside its committed part; the file is damaged ({exc})") from exc
    except BaseException:
        handle.close()
        raise
    return handle


def _check_committed_on_disk(handle: h5py.File, path: Path, real_size: int) -> None:
    """Refuse a file cut inside its committed part (not by a failed append: by a copy or a lost write):
    every chunk that holds committed data must lie before the file's real end."""
    raw = handle["commit"][:]
    if int(raw[-1]) != commit_check(raw[:-1]):
        raise StoreError(f"{path}: the commit counter does not check out; the file is damaged")
    count = dict(zip(SPACES, raw[:-1].tolist(), strict=True))
    sealed = dict(zip(SPACES, handle["sealed"][:].tolist(), strict=True))
    need = {"commit": len(SPACES) + 1, "sealed": len(SPACES)}
    need |= {name: count[name] for name in ROWS}
    need |= {name: count[rows] + 1 for name, (rows, _) in OFFSETS.items()}
    chunk_tokens = int(handle.attrs["chunk_tokens"])
    for name, (_, space) in SEALED.items():
        need[name] = sealed[space] * chunk_tokens
        need[f"{TAIL}/{name}"] = 2 * chunk_tokens
    for name, n in need.items():
        dsid = handle[name].id
        chunk = dsid.get_create_plist().get_chunk()[0]
        for k in range(math.ceil(n / chunk)):
            info = dsid.get_chunk_info_by_coord((k * chunk,))
            if info.byte_offset is None or info.byte_offset + info.size > real_size:
                raise StoreError(
                    f"{path}: committed data of {name} lies past the file's end ({real_size} bytes); "
                    "the file was cut inside its committed part and is damaged"
                )


class RepairedView(io.RawIOBase):
    """A read-only view of a store as its writer's reopen would repair it, for readers that must not
    change the file: write flags cleared in the superblock (a fresh checksum), and the file padded with
    zeros up to the end its superblock names (the part a failed append did not write; nothing committed
    lies there: a commit is written only after its data is fsynced)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._handle = open(path, "rb")  # noqa: SIM115 -- closed with the view (h5py closes the view)
        block = read_superblock(path)
        self.real_size = self._size = os.fstat(self._handle.fileno()).st_size
        self._head = b""
        if block is not None:
            self._size = max(self._size, block.eof)
            fixed = block.head[:11] + b"\x00" + block.head[12:]
            self._head = fixed + lookup3(fixed).to_bytes(4, "little")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        self._handle.seek(self._pos)
        got = self._handle.readinto(view[:n]) or 0
        view[got:n] = bytes(n - got)  # past the real end: zeros
        head = self._head[self._pos : self._pos + n] if self._pos < len(self._head) else b""
        view[: len(head)] = head
        self._pos += n
        return n

    def close(self) -> None:
        self._handle.close()
        super().close()


# ---------------------------------------------------------------- a writer that died with the file open
def writer_identity() -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()})


@dataclass(frozen=True)
class Superblock:
    """The fields of an HDF5 superblock (version 2 or 3, as ``libver="latest"`` writes) we look at."""

    head: bytes  # the checksummed bytes
    flags: int  # file consistency flags: 1 open for writing, 4 open for SWMR writing
    eof: int  # end-of-file address at the writer's last flush


def read_superblock(path: Path) -> Superblock | None:
    """The superblock at the start of ``path``; None for the old formats (versions 0, 1: not a store)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(64)
    except FileNotFoundError:
        raise StoreError(f"{path}: no such store") from None
    if len(head) < 12 or head[:8] != b"\x89HDF\r\n\x1a\n":
        raise StoreError(f"{path}: not an HDF5 file (no HDF5 signature at its start)")
    if head[8] < 2:
        return None
    size = head[9]
    end = 12 + 4 * size
    if size not in (4, 8) or int.from_bytes(head[end : end + 4], "little") != lookup3(head[:end]):
        raise StoreError(f"{path}: its HDF5 superblock does not check out; the file is damaged")
    return Superblock(head[:end], head[11], int.from_bytes(head[12 + 2 * size : 12 + 3 * size], "little"))


def check_not_truncated(path: Path) -> None:
    """Refuse a file shorter than its superblock says (HDF5's SWMR reader would retry its reads for long)."""
    eof = 0
    for _ in range(5):
        block = read_superblock(path)
        if block is None or path.stat().st_size >= block.eof:
            return
        eof = block.eof
        time.sleep(0.02)  # a live writer extends the file at the end of each flush
    raise StoreError(
        f"{path}: truncated: {path.stat().st_size} bytes where its superblock says {eof}; the file is damaged"
    )


def repair_truncated(path: Path) -> bool:
    """Writer side, under the lease: a file cut short by a failed append (disk full: HDF5 had raised the
    end-of-file in the superblock, the data after it was never written) is padded with zeros to the end
    its superblock names, so HDF5 opens it again; the reopen then shrinks everything to the last commit.
    True if it was."""
    block = read_superblock(path)
    size = path.stat().st_size
    if block is None or size >= block.eof:
        return False
    why = f"{size} bytes where its superblock says {block.eof} (an append failed, disk full?)"
    _open_repaired(path, why).close()  # refuses a file cut inside its committed part
    log.warning("%s: %s; padding it to that end before going back to the last commit", path, why)
    with open(path, "rb+") as handle:
        handle.truncate(block.eof)
        os.fsync(handle.fileno())
    return True


def clear_write_flags(path: Path) -> None:
    """Mark the file closed in its superblock (after a writer let go of it without HDF5's close)."""
    block = read_superblock(path)
    if block is not None and block.flags != 0:
        _write_flags(path, block, 0)


def _write_flags(path: Path, block: Superblock, flags: int) -> None:
    fixed = block.head[:11] + bytes([flags]) + block.head[12:]
    with open(path, "rb+") as handle:
        handle.write(fixed + lookup3(fixed).to_bytes(4, "little"))
        handle.flush()
        os.fsync(handle.fileno())


def clear_stale_write_flags(path: Path, taken_from_pid: int | None = None) -> None:
    """Clear the "open for writing" flags a killed writer left in the superblock (what ``h5clear -s`` does).
    Called with the writer lease held; as a second check, refuses if the ``writer`` attribute names a live
    process on this host, unless it is ``taken_from_pid``, the holder of the stale lease we took over."""
    block = read_superblock(path)
    if block is None or block.flags == 0:
        return
    _refuse_live_writer(path, taken_from_pid)
    log.warning("%s: the last writer did not close it (killed?); clearing its write flags", path)
    _write_flags(path, block, 0)


def _refuse_live_writer(path: Path, taken_from_pid: int | None) -> None:
    try:
        with h5py.File(path, "r", libver="latest", swmr=True, locking=False) as handle:
            owner = json.loads(str(handle.attrs.get("writer", "{}")))
    except (OSError, ValueError):
        return  # not readable (killed before SWMR started): nobody can be writing it through SWMR either
    if owner.get("host") != socket.gethostname() or owner.get("pid") in (None, os.getpid(), taken_from_pid):
        return
    if not pid_alive(int(owner["pid"])):
        return
    raise StoreError(
        f"{path}: process {owner['pid']} on this host still has it open for writing, without holding the "
        "writer lease; one writer per store: stop it first"
    )


_MASK = 0xFFFFFFFF
_MIX = ((0, 2, 1, 4), (1, 0, 2, 6), (2, 1, 0, 8), (0, 2, 1, 16), (1, 0, 2, 19), (2, 1, 0, 4))
_FINAL = ((2, 1, 14), (0, 2, 11), (1, 0, 25), (2, 1, 16), (0, 2, 4), (1, 0, 14), (2, 1, 24))


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``: the checksum of HDF5's superblock and metadata."""
    v = [(0xDEADBEEF + len(data) + initval) & _MASK] * 3
    padded = data + bytes(-len(data) % 12)
    for start in range(0, len(padded), 12):
        v = [
            (v[j] + int.from_bytes(padded[start + 4 * j : start + 4 * j + 4], "little")) & _MASK
            for j in range(3)
        ]
        if start + 12 < len(padded):
            for x, y, z, k in _MIX:
                v[x] = ((v[x] - v[y]) & _MASK) ^ _rot(v[y], k)
                v[y] = (v[y] + v[z]) & _MASK
        else:
            for x, y, k in _FINAL:
                v[x] = ((v[x] ^ v[y]) - _rot(v[y], k)) & _MASK
    return v[2]


# ------------------------------------------------------------------------------------ sealed columns
def write_at(ds: h5py.Dataset, start: int, values: np.ndarray) -> None:
    """``ds[start:start + len(values)] = values``, growing ``ds`` if needed, through h5py's low-level API
    (a quarter of the high-level call's overhead, which dominates the cost of a small append)."""
    n = len(values)
    if n == 0:
        return
    dsid = ds.id
    if dsid.shape[0] < start + n:
        dsid.set_extent((start + n,))
    file_space = dsid.get_space()
    file_space.select_hyperslab((start,), (n,))
    data = np.ascontiguousarray(values, ds.dtype)
    file_type = dsid.get_type()  # our arrays have the file's layout: no conversion (half the cost of a row)
    mem_type = file_type if file_type.get_size() == data.dtype.itemsize else None
    dsid.write(h5py.h5s.create_simple((n,)), file_space, data, mtype=mem_type)


def open_uncached(handle: h5py.File, name: str) -> h5py.Dataset:
    """``name`` opened without a chunk cache: it is rewritten in place, a cached chunk could be stale."""
    dapl = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
    dapl.set_chunk_cache(0, 0, 1.0)
    return h5py.Dataset(h5py.h5d.open(handle.id, name.encode(), dapl=dapl))
