"""``docs/config.md`` is what ``tools/config_reference.py`` generates from the config models today: a field
added, renamed or described anew without writing the reference again fails here, naming the command."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "tools" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_the_generated_reference() -> None:
    generator = _generator()
    written = (REPO / "docs" / "config.md").read_text()
    assert written == generator.reference(), (
        "docs/config.md is stale: run .venv/bin/python tools/config_reference.py"
    )


def test_the_reference_lists_every_key_of_the_models() -> None:
    """Every field of every config model reachable from the topology has its row, with its description."""
    from pydantic import BaseModel

    from ajet_hpc.config import Topology

    generator = _generator()
    text = generator.reference()
    models: list[type[BaseModel]] = [Topology]
    seen: set[type[BaseModel]] = set()
    while models:
        model = models.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            assert f".{name}` |" in text or f"| `{name}` |" in text, f"{model.__name__}.{name} has no row"
            described = " ".join((field.description or "").split()).replace("|", "\\|")
            assert described and described[:40] in text, (model, name)
            models += generator.models_in(field.annotation)
    assert len(seen) >= 10
