"""Command-line overrides of a raw topology: ``servers.main.nodes=2``, ``cluster.qos=high``.

A path is dotted keys; where it meets a list, a segment is an integer index or the ``name`` of an element
(names may contain dots: the longest matching name wins). ``[0]`` and ``[main]`` brackets are accepted too,
so a path from an error message (``clients[0].array``) can be pasted back. Values are YAML (``3`` is an int,
``true`` a bool, ``[a, b]`` a list, ``4:00:00`` a string).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ajet_hpc.config.errors import ConfigError, format_path
from ajet_hpc.config.yaml_io import parse_yaml

_PATH = re.compile(r"(?:[^.\[\]=]+|\[[^\[\]]+\])(?:\.[^.\[\]=]+|\[[^\[\]]+\])*")
_SEGMENT = re.compile(r"\[([^\[\]]+)\]|([^.\[\]]+)")


@dataclass(frozen=True)
class _Segment:
    text: str
    bracketed: bool


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``data`` with each ``path=value`` override applied in order; ``data`` is left untouched."""
    result = copy.deepcopy(data)
    for override in overrides:
        key, sep, raw_value = override.partition("=")
        key = key.strip()
        if not sep or not _PATH.fullmatch(key):
            raise ConfigError.at(key or override, f"override {override!r} must look like 'dotted.path=value'")
        value = parse_yaml(raw_value, source=f"override {override!r}")
        segments = [_Segment(m[1] or m[2], bool(m[1])) for m in _SEGMENT.finditer(key)]
        _set(result, segments, value, override)
    return result


def _set(root: dict[str, Any], segments: list[_Segment], value: Any, override: str) -> None:
    node: Any = root
    loc: list[str | int] = []
    i = 0
    while True:
        if isinstance(node, dict):
            key = segments[i].text
            loc.append(key)
            i += 1
            if i == len(segments):
                node[key] = value
                return
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        elif isinstance(node, list):
            index, i = _list_index(node, segments, i, loc, override)
            loc.append(index)
            if i == len(segments):
                node[index] = value
                return
            node = node[index]
        else:
            where = format_path(loc)
            raise ConfigError.at(
                where, f"override {override!r}: {where} is a {type(node).__name__}, not a mapping or list"
            )


def _list_index(
    items: list[Any], segments: list[_Segment], i: int, loc: list[str | int], override: str
) -> tuple[int, int]:
    """The list index that ``segments[i:]`` selects (by index or by name) and the position after it."""
    first = segments[i].text
    if first.isdigit():
        index = int(first)
        if index >= len(items):
            raise ConfigError.at(
                format_path([*loc, index]),
                f"override {override!r}: index {index} is out of range; "
                f"{format_path(loc)} has {len(items)} element(s)",
            )
        return index, i + 1
    names = [item.get("name") if isinstance(item, dict) else None for item in items]
    last = i + 1 if segments[i].bracketed else _dotted_run_end(segments, i)
    for end in range(last, i, -1):
        wanted = ".".join(s.text for s in segments[i:end])
        if wanted in names:
            return names.index(wanted), end
    known = ", ".join(str(n) for n in names if n is not None) or "(none)"
    raise ConfigError.at(
        format_path([*loc, first]),
        f"override {override!r}: no element named {first!r} in {format_path(loc)}; names are: {known}",
    )


def _dotted_run_end(segments: list[_Segment], i: int) -> int:
    """End of the run of unbracketed segments starting at ``i`` (a name with dots spans several)."""
    end = i
    while end < len(segments) and not segments[end].bracketed:
        end += 1
    return end
