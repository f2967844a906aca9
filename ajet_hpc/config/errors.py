"""Configuration errors that name the field path of every problem.

A :class:`ConfigError` carries one :class:`ConfigIssue` per problem, each with a path in the notation users
type and read (``servers[0].nodes``, ``clients[1].servers[0]``, ``cluster.backend``, ``(root)`` for the
top), so a bad topology is reported completely, once, and in terms of the YAML file rather than of Python
objects.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

ROOT = "(root)"
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
# Segments pydantic adds to a location that are not keys of the document.
_SCHEMA_TAGS = frozenset({"[key]"})


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a configuration: where it is and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """A configuration is invalid; ``str()`` gives one ``<path>: <message>`` line per issue."""

    def __init__(self, issues: Iterable[ConfigIssue]) -> None:
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        if not self.issues:
            raise ValueError("ConfigError needs at least one issue")
        super().__init__(str(self))

    @classmethod
    def at(cls, path: str, message: str) -> ConfigError:
        """An error with a single issue."""
        return cls([ConfigIssue(path, message)])

    def __str__(self) -> str:
        return "\n".join(str(issue) for issue in self.issues)


def format_path(loc: Sequence[str | int]) -> str:
    """Render a location such as ``("servers", 0, "nodes")`` as ``servers[0].nodes``."""
    out = ""
    for seg in loc:
        if isinstance(seg, int):
            out += f"[{seg}]"
        elif seg in _SCHEMA_TAGS:
            continue
        elif _PLAIN_KEY.fullmatch(seg):
            out += f".{seg}" if out else seg
        else:
            out += f"[{seg!r}]"
    return out or ROOT


def issues_from_validation_error(
    error: ValidationError, model: type[BaseModel] | None = None
) -> list[ConfigIssue]:
    """Convert pydantic's errors into issues.

    ``model`` is the class that was validated; with it, unknown-key issues list the keys allowed at that
    place.
    """
    issues = []
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        issues.append(ConfigIssue(format_path(loc), _message(err, loc, model)))
    return issues


def _message(err: Mapping[str, Any], loc: tuple[str | int, ...], model: type[BaseModel] | None) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key_message(str(loc[-1]) if loc else "?", _model_at(model, loc[:-1]))
    if kind == "missing":
        return "required key is missing"
    if kind in ("value_error", "assertion_error") and "error" in err.get("ctx", {}):
        return str(err["ctx"]["error"])
    value = err.get("input")
    if isinstance(value, (str, int, float, bool)) or value is None:
        return f"{err['msg']} (got {value!r})"
    return err["msg"]


def _unknown_key_message(key: str, owner: type[BaseModel] | None) -> str:
    return unknown_key_message(key, None if owner is None else list(owner.model_fields))


def unknown_key_message(key: str, allowed: list[str] | None) -> str:
    """That ``key`` is unknown, the closest of the ``allowed`` keys, and all of them."""
    message = f"unknown key {key!r}"
    if allowed is None:
        return message
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        message += f" (did you mean {close[0]!r}?)"
    return f"{message}; allowed keys: {', '.join(allowed)}"


def _model_at(root: type[BaseModel] | None, loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class found at ``loc`` below ``root``, following fields, list items and dict values."""
    current: Any = root
    for seg in loc:
        current = _unwrap(current)
        if _is_model(current):
            field = current.model_fields.get(seg) if isinstance(seg, str) else None
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) is list and isinstance(seg, int):
            current = get_args(current)[0]
        elif get_origin(current) is dict:
            current = get_args(current)[1]
        else:
            return None
    current = _unwrap(current)
    return current if _is_model(current) else None


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``X | None`` down to the type that holds the structure."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)
