"""Pick and build an engine: vLLM where it is installed, else the transformers debug engine."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path
from typing import Any, Literal

from ajet_hpc.engine.base import Engine
from ajet_hpc.engine.transformers_engine import TransformersEngine, TransformersSettings
from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

log = logging.getLogger(__name__)

EngineKind = Literal["auto", "vllm", "transformers"]
_ENGINES = {"vllm": (VllmEngine, VllmSettings), "transformers": (TransformersEngine, TransformersSettings)}


def vllm_available() -> tuple[bool, str]:
    """Whether ``import vllm`` works here, and why not when it does not."""
    if importlib.util.find_spec("vllm") is None:
        return False, "the vllm package is not installed"
    try:
        import vllm  # noqa: F401
    except Exception as error:  # a broken install (e.g. a CUDA build on a machine without CUDA)
        return False, f"import vllm failed: {error!r}"
    return True, "vllm imports"


def resolve_kind(kind: EngineKind) -> Literal["vllm", "transformers"]:
    """The engine ``kind`` builds: ``auto`` is vLLM where it imports, else transformers (logged)."""
    if kind == "auto":
        ok, why = vllm_available()
        log.info("engine auto: %s (%s)", "vllm" if ok else "transformers", why)
        return "vllm" if ok else "transformers"
    if kind not in _ENGINES:
        raise ValueError(f"engine kind must be 'auto', 'vllm' or 'transformers', got {kind!r}")
    return kind


def create_engine(kind: EngineKind, model_path: Path, **settings: Any) -> Engine:
    """An engine of ``kind`` for the model folder, not started.

    ``settings`` are fields of `VllmSettings` / `TransformersSettings`. With ``kind="auto"`` fields only
    the other engine knows (e.g. gpu_memory_utilization for transformers) are dropped, with a log line;
    with an explicit kind they are an error, and so is a field neither engine knows.
    """
    auto = kind == "auto"
    resolved = resolve_kind(kind)
    everywhere = {f.name for _, s in _ENGINES.values() for f in dataclasses.fields(s)}
    unknown = sorted(set(settings) - everywhere)
    if unknown:
        raise TypeError(f"unknown engine settings {unknown}; known: {sorted(everywhere)}")
    engine_class, settings_class = _ENGINES[resolved]
    known = {f.name for f in dataclasses.fields(settings_class)}
    dropped = sorted(set(settings) - known)
    if dropped and not auto:
        raise TypeError(f"settings {dropped} do not apply to the {kind} engine; known: {sorted(known)}")
    if dropped:
        log.info("engine %s: ignoring settings of the other engine: %s", resolved, dropped)
    return engine_class(Path(model_path), settings_class(**{k: v for k, v in settings.items() if k in known}))
