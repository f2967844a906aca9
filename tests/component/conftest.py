"""Session-wide real engines for the component tests (loaded once: vLLM takes ~20 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
from scripted_model import build_scripted_model
from server_harness import Harness

from ajet_hpc.engine.model_path import resolve_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("builtin:tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def scripted_model(tiny_model: Path) -> Path:
    return build_scripted_model(tiny_model, tiny_model.parent / "scripted")


@pytest.fixture(scope="session")
def hf_harness(scripted_model: Path):
    harness = Harness("transformers", scripted_model)
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def vllm_harness(scripted_model: Path):
    harness = Harness("vllm", scripted_model)
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def hf_server(hf_harness: Harness):
    return hf_harness.serve()


@pytest.fixture(scope="session")
def vllm_server(vllm_harness: Harness):
    return vllm_harness.serve()
