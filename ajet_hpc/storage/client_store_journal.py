"""The journal of a client store, its durable truth: ``<index>.h5.journal``, a sequence of records
``MAGIC(4) | length(u32 LE) | crc32(length bytes + payload)(u32 LE) | payload`` (the payload:
:func:`ajet_hpc.storage.client_records.result_payload`, or the header). Framing, the scan that keeps
every whole record up to a torn tail, and the atomic rewrite; the store that appends to it:
:mod:`ajet_hpc.storage.client_store`.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet_hpc.storage.client_records import Result, canonical, result_from_record, result_payload
from ajet_hpc.storage.files import fsync_dir, write_bytes_atomic

JOURNAL_SUFFIX = ".journal"
MAGIC = b"\xffAJR"
_FRAME = struct.Struct("<4sII")  # magic, payload length, crc32 of (length bytes + payload)


class StoreCorrupt(Exception):
    """A client store that cannot be used as it is; the message names the file and what is wrong."""


def journal_path(path: Path) -> Path:
    """The journal that goes with the HDF5 file ``path``: ``<index>.h5.journal``."""
    return path.with_name(path.name + JOURNAL_SUFFIX)


def encode_frame(payload: bytes) -> bytes:
    length = struct.pack("<I", len(payload))
    return MAGIC + length + struct.pack("<I", zlib.crc32(payload, zlib.crc32(length))) + payload


def _parse_frame(data: bytes, offset: int) -> tuple[bytes, int] | None:
    """(payload, end) of the whole, checksummed record at ``offset``; None if it is torn or damaged."""
    body = offset + _FRAME.size
    if body > len(data):
        return None
    magic, length, crc = _FRAME.unpack_from(data, offset)
    end = body + length
    if magic != MAGIC or end > len(data):
        return None
    payload = data[body:end]
    if zlib.crc32(payload, zlib.crc32(data[offset + 4 : offset + 8])) != crc:
        return None
    return payload, end


def _next_frame(data: bytes, start: int) -> int | None:
    """Offset of the first whole record at or after ``start``, if any."""
    at = data.find(MAGIC, start)
    while at >= 0:
        if _parse_frame(data, at) is not None:
            return at
        at = data.find(MAGIC, at + 1)
    return None


@dataclass
class JournalScan:
    exists: bool
    header: dict[str, Any] | None = None
    results: list[Result] = field(default_factory=list)
    valid_end: int = 0  # the byte after the last whole record
    size: int = 0
    problem: str = ""


def scan_journal(path: Path) -> JournalScan:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return JournalScan(exists=False, problem="missing")
    scan = JournalScan(exists=True, size=len(data))
    if not MAGIC.startswith(data[: len(MAGIC)]):
        raise StoreCorrupt(f"{path}: not a client store journal (it does not start with {MAGIC!r})")
    offset = 0
    seen: set[tuple[str, int]] = set()
    while (frame := _parse_frame(data, offset)) is not None:
        payload, end = frame
        try:
            record = json.loads(payload)
            kind = record["kind"]
            if (kind == "header") != (offset == 0):
                raise ValueError(f"a {kind!r} record where a {'header' if offset == 0 else 'result'} belongs")
            if kind == "header":
                scan.header = {k: record[k] for k in ("format", "group", "index", "created_at")}
            else:
                result = result_from_record(record)
                if result.key in seen:
                    raise ValueError(f"{result.key} is recorded twice")
                seen.add(result.key)
                scan.results.append(result)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreCorrupt(f"{path}: record at byte {offset} is whole but invalid: {exc}") from exc
        offset = end
    scan.valid_end = offset
    if offset < len(data):
        later = _next_frame(data, offset + 1)
        if later is not None:
            raise StoreCorrupt(
                f"{path}: damaged record at byte {offset} with whole records after it (byte {later}); "
                "this is not a torn tail, and dropping it would lose committed results"
            )
    if scan.header is None:
        scan.problem = f"its header record is cut short ({len(data)} bytes)"
    return scan


def write_journal(path: Path, header: dict[str, Any], results: list[Result]) -> None:
    """Replace the journal with one holding ``header`` and ``results`` (atomic: old or new, never a mix)."""
    frames = [encode_frame(canonical({"kind": "header", **header}).encode("utf-8"))]
    frames += [encode_frame(result_payload(result)) for result in results]
    write_bytes_atomic(path, b"".join(frames))
    fsync_dir(path.parent)
