"""Model specs (``builtin:tiny`` or a local folder) to a folder both engines load. Never downloads."""

from __future__ import annotations

import os
from pathlib import Path

from ajet_hpc.engine.base import EngineError

BUILTIN_PREFIX = "builtin:"
BUILTINS = ("tiny",)


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """The folder of the model ``spec`` names: ``builtin:tiny`` is built under ``cache_dir/tiny`` on first
    use; any other spec is a local folder written by ``save_pretrained`` (it must hold config.json)."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        if name != "tiny":
            raise EngineError(f"unknown built-in model {spec!r}: the built-ins are {BUILTINS}")
        from ajet_hpc.engine.tiny import build_tiny_model

        return build_tiny_model(Path(cache_dir) / "tiny")
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        what = "is not a folder" if not path.is_dir() else "has no config.json"
        raise EngineError(
            f"model {spec!r}: {path} {what}; give a local folder written by save_pretrained "
            f"(models are never downloaded) or 'builtin:tiny'"
        )
    return path.resolve()


def offline_hub() -> None:
    """Forbid Hugging Face Hub access in this process (and the ones it spawns): weights are local only."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
