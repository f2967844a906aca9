"""Write ``docs/config.md``: every key of the topology YAML, from the config models' own descriptions.

    .venv/bin/python tools/config_reference.py            # rewrite docs/config.md
    .venv/bin/python tools/config_reference.py --check    # exit 1 when docs/config.md is stale

One section per model, in the order the keys nest (``servers[].models[].trainer.lora`` after
``servers[].models[].trainer``), each a table of its keys: type, default, bounds and the field's
description. Nothing is written by hand but the header (``HEADER``, which also says how a server of the old
form is read): a field whose description changes changes the reference, and
``tests/unit/test_config_reference.py`` fails until it is written again.
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
command line use the same paths: `servers.policy.models.policy.trainer.lr=1e-5` (a list element by its
name or index). Times are Slurm times (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`); memory
is an integer with `K`/`M`/`G`/`T` (megabytes without).

## A server job

A server job (`servers[]`) is its resources (partition, CPUs, memory, time, nodes, GPUs, placement, port),
its `serving` limits, one `engine` (its kind, the base model's weights, its GPUs, `vllm`) and the `models`
that engine serves, each with its `trainer` (or `trainer: null`: a frozen model), `store`, and for a frozen
LoRA adapter its `adapter` folder. A plain server is a job with one model, named as the job; a job with
several models serves LoRA adapters of its base (each trained one has `trainer.lora`) and the bare base
(`docs/lora.md`). The first model always carries the job's name; without `models:` a job has that one
model, trained with the default trainer.

```yaml
servers:
  - name: policy
    gpus_per_node: 0
    engine: {kind: auto, model: builtin:tiny}
    models:
      - name: policy
        trainer: {lr: 0.003, total_steps: 20}
```

**The old form still loads.** A server written as before, flat, is rewritten on load to this form with the
same meaning, so every YAML written for it keeps working (`tests/fixtures/old_configs/` holds the old
form of every file in `configs/`, and a test loads each to the same topology):

| old key | becomes |
| --- | --- |
| `model` | `engine.model` |
| `engine` (a string) | `engine.kind` |
| `engine_gpus` | `engine.gpus` |
| `gpu_memory_gib` | `engine.gpu_memory_gib` |
| `vllm` | `engine.vllm` |
| `trainer`, `store` | `models[0].trainer`, `models[0].store`: the model named as the server |
| `adapters[i]` | `models[i+1]`; without `trainer`, `trainer: {lora: {}}` (a rank-16 adapter, its default) |

Errors in a server of the old form name the paths it was written with (`servers[0].engine_gpus`), and
overrides of either form reach a server of either (`servers.policy.trainer.lr`,
`servers.policy.engine_gpus`, `servers.base.adapters.solver.trainer.lr` still work, the first one as the
short path of the job's first model's trainer). One server mixing the two forms' keys is an error naming
both. A run frozen by a version before this form (`RUN/topology.yaml` in the old form) resumes.
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
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("default_text"), str):  # filled in by a validator
        return str(extra["default_text"])
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
