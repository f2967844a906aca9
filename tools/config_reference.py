"""Write ``docs/config.md``: every key of the topology YAML, from the config models' own descriptions.

    .venv/bin/python tools/config_reference.py            # rewrite docs/config.md
    .venv/bin/python tools/config_reference.py --check    # exit 1 when docs/config.md is stale

One section per model, in the order the keys nest (``servers[].trainer.lora`` after ``servers[].trainer``),
each a table of its keys: type, default, bounds and the field's description. Nothing is written by hand:
a field whose description changes changes the reference, and ``tests/unit/test_config_reference.py`` fails
until it is written again.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "config.md"
HEADER = """\
# Topology reference

Every key of a topology file (`configs/*.yaml`), generated from the config models' own descriptions by
`tools/config_reference.py`; `tests/unit/test_config_reference.py` fails when this file is stale. A key
left out takes its default; an unknown key is an error that lists the allowed ones. Overrides on the
command line use the same paths: `servers.policy.trainer.lr=1e-5` (a list element by its name or index).
Times are Slurm times (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`); memory is an integer
with `K`/`M`/`G`/`T` (megabytes without).
"""


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds (itself, or inside list / Optional / dict / Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in models_in(arg)]


def render_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Annotated:
        return render_type(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(render_type(a) for a in args)
    if origin in (list, tuple, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        return f"list of {render_type(inner[0])}" if inner else "list"
    if origin is dict:
        return f"mapping of {render_type(args[0])} to {render_type(args[1])}" if args else "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(json.dumps(m.value) for m in annotation)
    name = getattr(annotation, "__name__", None) or str(annotation)
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(name, name)


def render_default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(its keys' defaults)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, tuple | frozenset | set):
        value = list(value)
    return f"`{json.dumps(value)}`"


BOUNDS = {  # annotated-types' constraint -> (its attribute, how it reads)
    annotated_types.Ge: ("ge", "≥ {}"),
    annotated_types.Gt: ("gt", "> {}"),
    annotated_types.Le: ("le", "≤ {}"),
    annotated_types.Lt: ("lt", "< {}"),
    annotated_types.MinLen: ("min_length", "length ≥ {}"),
    annotated_types.MaxLen: ("max_length", "length ≤ {}"),
}


def render_bounds(field: FieldInfo) -> str:
    found = []
    for item in field.metadata:
        for kind, (attribute, text) in BOUNDS.items():
            if isinstance(item, kind):
                found.append(text.format(getattr(item, attribute)))
    return ", ".join(found)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections(model: type[BaseModel], path: str, seen: dict[type[BaseModel], str]) -> list[str]:
    """The section of ``model`` at ``path`` and, after it, those of the models it holds; a model met again
    (an adapter's trainer) points to its first section instead (``seen``: model -> that section's path)."""
    seen[model] = path
    doc = inspect.cleandoc(model.__doc__ or "").split("\n\n")[0]
    lines = [f"## `{path}`" if path else "## The whole file", "", _cell(doc), ""]
    lines += ["| key | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
    nested: list[tuple[type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        meaning = field.description or ""
        for inner in models_in(field.annotation):
            if inner in seen:
                meaning += f" Its keys: as `{seen[inner]}`."
                continue
            is_list = typing.get_origin(_strip_optional(field.annotation)) in (list, tuple)
            inner_path = f"{key}[]" if is_list else key
            seen[inner] = inner_path
            nested.append((inner, inner_path))
        lines.append(
            f"| `{key}` | {_cell(render_type(field.annotation))} | {render_default(field)} | "
            f"{render_bounds(field)} | {_cell(meaning)} |"
        )
    lines.append("")
    for inner, inner_path in nested:
        lines += sections(inner, inner_path, seen)
    return lines


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def reference() -> str:
    from ajet_hpc.config import Topology

    return HEADER + "\n" + "\n".join(sections(Topology, "", {})).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is stale")
    args = parser.parse_args(argv)
    text = reference()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC.relative_to(REPO)} is stale: run .venv/bin/python tools/config_reference.py")
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
