"""Typed fields of the protocol's JSON files (a result, the ready record), read with an error naming the
field."""

from __future__ import annotations

from typing import Any, TypeVar

_T = TypeVar("_T", int, float, bool, str)


def typed_field(payload: dict[str, Any], name: str, kind: type[_T], what: str) -> _T:
    """``payload[name]`` as ``kind`` (an int is a float too; a bool is neither); ``ValueError`` naming it."""
    value: Any = payload.get(name)
    if isinstance(value, bool) and kind is not bool:
        fits = False
    elif kind is float:
        fits = isinstance(value, int | float)
    else:
        fits = isinstance(value, kind)
    if not fits:
        raise ValueError(f"{what}: field {name!r} is {value!r}, not a {kind.__name__}")
    return kind(value)
