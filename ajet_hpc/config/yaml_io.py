"""YAML reading and writing for configuration files, with YAML 1.2 scalars and no duplicate keys.

PyYAML follows YAML 1.1, where ``time: 4:00:00`` is the integer 14400 (base 60), ``lr: 1e-5`` is a string
and ``on``/``no`` are booleans. Topologies are full of Slurm times, so the loader here resolves plain
scalars as YAML 1.2's core schema does: ``true``/``false``, ``null``/``~``, decimal/``0o``/``0x`` integers
and decimal floats (exponent without a dot allowed); everything else is a string. A key repeated in one
mapping is an error instead of silently keeping the last value. The writer quotes any string that either
YAML version would read as something else, so what it writes reads back unchanged.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, ScalarNode

from ajet_hpc.config.errors import ROOT, ConfigError

_DIGITS = list("0123456789")
_RESOLVERS: list[tuple[str, re.Pattern[str], list[str]]] = [
    ("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")),
    ("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), ["-", "+", *_DIGITS]),
    (
        "tag:yaml.org,2002:float",
        re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
            r"|[-+]?\.(?:inf|Inf|INF)|\.nan|\.NaN|\.NAN)$"
        ),
        ["-", "+", ".", *_DIGITS],
    ),
    ("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"]),
]
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """Safe loader with YAML 1.2 core scalars and duplicate-key detection."""

    # none of 1.1's. A class variable in PyYAML (add_implicit_resolver fills it per class); types-PyYAML
    # declares it an instance variable.
    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {}  # type: ignore[misc]

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):  # a !!map tag on a scalar lands here too: the base class reports it
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key; the base class reports it
                    continue
                if duplicate:
                    raise ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"duplicate key {key!r}",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: _Loader, node: ScalarNode) -> int:
    text = loader.construct_scalar(node)
    try:
        if text.startswith("0o"):
            return int(text[2:], 8)
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text, 10)
    except ValueError:
        raise ConstructorError(None, None, f"invalid integer {text!r}", node.start_mark) from None


def _construct_float(loader: _Loader, node: ScalarNode) -> float:
    text = loader.construct_scalar(node)
    special = text.lower().lstrip("+")
    if special in (".inf", "-.inf", ".nan"):
        return {".inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}[special]
    try:
        return float(text)
    except ValueError:
        raise ConstructorError(None, None, f"invalid float {text!r}", node.start_mark) from None


class _Dumper(yaml.SafeDumper):
    """Safe dumper that also quotes strings a YAML 1.2 reader would take for numbers."""


for _tag, _regexp, _first in _RESOLVERS:
    _Loader.add_implicit_resolver(_tag, _regexp, _first)
    _Dumper.add_implicit_resolver(_tag, _regexp, _first)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def parse_yaml(text: str, source: str) -> Any:
    """Parse one YAML document; syntax errors become a ``ConfigError`` naming ``source``, line and column."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader derives from SafeLoader
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}, line {mark.line + 1}, column {mark.column + 1}" if mark else source
        problem = err.problem or err.context or "syntax error"
        raise ConfigError.at(ROOT, f"invalid YAML in {where}: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError.at(ROOT, f"invalid YAML in {source}: {err}") from None


def to_yaml(data: Any) -> str:
    """YAML text for plain data, keys in insertion order, that :func:`parse_yaml` reads back unchanged."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False)
