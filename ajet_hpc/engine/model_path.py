"""Model specs (``builtin:tiny``, ``builtin:tiny-qwen`` or a local folder) to a folder both engines load.
Never downloads."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ajet_hpc.engine.base import EngineError

BUILTIN_PREFIX = "builtin:"
BUILTINS = ("tiny", "tiny-qwen")


def _build_builtin(name: str, dest: Path) -> Path:
    """The built-in model ``name`` in ``dest``, written unless it is there (``write_model_folder``)."""
    if name == "tiny":
        from ajet_hpc.engine.tiny import save_tiny_model

        return write_model_folder(dest, save_tiny_model)
    from ajet_hpc.engine.tiny_qwen import save_tiny_qwen_model

    return write_model_folder(dest, save_tiny_qwen_model)


def resolve_model(spec: str, cache_dir: Path) -> Path:
    """The folder of the model ``spec`` names: a built-in (``builtin:tiny``, ``builtin:tiny-qwen``) is built
    under ``cache_dir/<name>`` on first use; any other spec is a local folder written by
    ``save_pretrained`` (it must hold config.json)."""
    if spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTINS:
            raise EngineError(f"unknown built-in model {spec!r}: the built-ins are {_builtin_specs()}")
        return _build_builtin(name, Path(cache_dir) / name)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        what = "is not a folder" if not path.is_dir() else "has no config.json"
        raise EngineError(
            f"model {spec!r}: {path} {what}; give a local folder written by save_pretrained "
            f"(models are never downloaded) or one of {_builtin_specs()}"
        )
    return path.resolve()


def _builtin_specs() -> str:
    return ", ".join(f"'{BUILTIN_PREFIX}{name}'" for name in BUILTINS)


def write_model_folder(dest: Path, write: Callable[[Path], None]) -> Path:
    """Fill ``dest`` with ``write(folder)`` unless it already holds a model (config.json). The folder is
    written as a temporary sibling and renamed, so a crash never leaves half a model; when two processes
    race, the first rename wins and the other's copy is dropped."""
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race: keep theirs
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def offline_hub() -> None:
    """Forbid Hugging Face Hub access in this process (and the ones it spawns): weights are local only."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
