"""Engine choice and settings routing (no engine is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ajet_hpc.engine import select
from ajet_hpc.engine.transformers_engine import TransformersEngine
from ajet_hpc.engine.vllm_engine import VllmEngine


@pytest.mark.parametrize(("available", "expected"), [(True, VllmEngine), (False, TransformersEngine)])
def test_auto_picks_vllm_when_it_imports(
    monkeypatch: pytest.MonkeyPatch, available: bool, expected: type[VllmEngine] | type[TransformersEngine]
) -> None:
    monkeypatch.setattr(select, "vllm_available", lambda: (available, "test"))
    engine = select.create_engine("auto", Path("/models/m"), max_model_len=256, gpu_memory_utilization=0.5)
    assert isinstance(engine, expected)
    assert engine.settings.max_model_len == 256 and engine.policy_version == 0
    if isinstance(engine, VllmEngine):  # expected is VllmEngine
        assert engine.settings.gpu_memory_utilization == 0.5


def test_explicit_kind_refuses_settings_it_does_not_know() -> None:
    with pytest.raises(TypeError, match=r"\['gpu_memory_utilization'\] do not apply to the transformers"):
        select.create_engine("transformers", Path("/models/m"), gpu_memory_utilization=0.5)
    with pytest.raises(TypeError, match=r"unknown engine settings \['batch'\]"):
        select.create_engine("auto", Path("/models/m"), batch=4)
    with pytest.raises(ValueError, match="engine kind"):
        select.create_engine("tgi", Path("/models/m"))  # type: ignore[arg-type]
