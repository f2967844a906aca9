"""Command-line overrides of a raw topology: ``servers.main.nodes=2``, ``cluster.qos=high``.

A path is dotted keys; where it meets a list, a segment is an integer index or the ``name`` of an element
(names may contain dots: the longest matching name wins). ``[0]`` and ``[main]`` brackets are accepted too,
so a path from an error message (``clients[0].array``) can be pasted back. Values are YAML (``3`` is an int,
``true`` a bool, ``[a, b]`` a list, ``4:00:00`` a string).

Below a server, a path in either form of a server (``config.old_form``) reaches a server written in the
other: ``servers.policy.trainer.lr`` sets ``models[policy].trainer.lr`` of a server written with ``models:``,
``servers.policy.engine.gpus`` sets ``engine_gpus`` of one written in the old form, and so on.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ajet_hpc.config.errors import ConfigError, format_path
from ajet_hpc.config.old_form import ENGINE_KEYS, ENGINE_KEYS_OLD, MODEL_KEYS, is_old_form, to_new_form
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
            if loc == ["servers"] and i < len(segments):
                segments = segments[:i] + _in_form_of(
                    node[index], segments[i:], value, override, [*loc, index]
                )
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


def _in_form_of(
    server: Any, rest: list[_Segment], value: Any, override: str, loc: list[str | int]
) -> list[_Segment]:
    """``rest``, the path below a server entry, in the form ``server`` is written in (see the module doc); a
    whole ``engine`` block or model set on a server of the old form first rewrites it to the new form."""
    if not isinstance(server, dict):
        return rest
    try:
        old = is_old_form(server)
    except ValueError:  # both forms mixed: validation names them
        return rest
    head, tail = rest[0].text, rest[1:]
    if old:
        try:
            return _in_old_form(server, rest, value, override, loc)
        except ValueError:  # not a server the new form can hold (adapters not a list): validation says so
            return rest
    if head in ("models", *MODEL_KEYS, "adapters") and "models" not in server and "name" in server:
        server["models"] = [{"name": server["name"]}]  # the default, written out to be set
    if head in ENGINE_KEYS and not (head == "engine" and (tail or isinstance(value, dict))):
        return [_Segment("engine", False), _Segment(ENGINE_KEYS[head], False), *tail]
    if head == "vllm":
        return [_Segment("engine", False), *rest]
    if head in MODEL_KEYS or head == "adapters":
        if head in MODEL_KEYS:
            return [_Segment("models", False), _Segment("0", False), *rest]
        if not tail:
            raise ConfigError.at(
                format_path([*loc, "adapters"]),
                f"override {override!r}: this server is written with models:, set servers.<name>.models",
            )
        adapters = server.get("models", [])[1:]
        index, end = _list_index(adapters, rest, 1, [*loc, "adapters"], override)
        return [_Segment("models", False), _Segment(str(index + 1), False), *rest[end:]]
    return rest


def _in_old_form(
    server: dict[str, Any], rest: list[_Segment], value: Any, override: str, loc: list[str | int]
) -> list[_Segment]:
    head, tail = rest[0].text, rest[1:]
    if head == "engine" and tail and tail[0].text in ENGINE_KEYS_OLD:
        return [_Segment(ENGINE_KEYS_OLD[tail[0].text], False), *tail[1:]]
    if head == "engine" and tail and tail[0].text == "vllm":
        return tail
    if head == "models" and tail:
        index, end = _list_index(to_new_form(server)["models"], rest, 1, [*loc, "models"], override)
        if index > 0:
            return [_Segment("adapters", False), _Segment(str(index - 1), False), *rest[end:]]
        if len(rest) > end and rest[end].text in MODEL_KEYS:
            return rest[end:]
    if head in ("engine", "models") and (tail or head == "models" or isinstance(value, dict)):
        new = to_new_form(server)  # what the old form cannot say: the server is rewritten to the new one
        server.clear()
        server.update(new)
    return rest


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
