"""Session-wide real engines for the component tests (loaded once: vLLM takes ~20 s on 2 cores).

Each built-in model has its fixtures: ``tiny_model`` (character-level Llama) and ``tiny_qwen_model``
(Qwen2.5's vocabulary and chat format, tied embeddings), each with a scripted copy and harnesses on both
engines (``hf_harness``, ``vllm_harness``; ``qwen_hf_harness``, ``qwen_vllm_harness``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from scripted_model import EXAMPLES, build_scripted_model
from server_harness import Harness

from ajet_hpc.engine.model_path import resolve_model


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's models are built. The pytest-xdist workers share one folder (the parent of their
    base folders), so each model is built once: teaching tiny-qwen its script takes a minute of CPU, which
    every worker paid again before (tests/README.md, "Two workers"). The builds are safe to race:
    ``resolve_model`` renames a finished folder into place, ``build_scripted_model`` builds under a lock."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "models"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> Path:
    return resolve_model("builtin:tiny", models_dir)


@pytest.fixture(scope="session")
def tiny_qwen_model(models_dir: Path) -> Path:
    return resolve_model("builtin:tiny-qwen", models_dir)


@pytest.fixture(scope="session")
def scripted_model(tiny_model: Path) -> Path:
    return build_scripted_model(tiny_model, tiny_model.parent / "scripted", examples=EXAMPLES[:1])


@pytest.fixture(scope="session")
def scripted_qwen_model(tiny_qwen_model: Path) -> Path:
    """tiny-qwen taught the script, with both tool schemas."""
    return build_scripted_model(tiny_qwen_model, tiny_qwen_model.parent / "scripted-qwen")


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
def qwen_hf_harness(scripted_qwen_model: Path):
    harness = Harness("transformers", scripted_qwen_model)
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def qwen_vllm_harness(scripted_qwen_model: Path):
    harness = Harness("vllm", scripted_qwen_model)
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def hf_server(hf_harness: Harness):
    return hf_harness.serve()


@pytest.fixture(scope="session")
def vllm_server(vllm_harness: Harness):
    return vllm_harness.serve()


@pytest.fixture(scope="session")
def qwen_hf_server(qwen_hf_harness: Harness):
    return qwen_hf_harness.serve()


@pytest.fixture(scope="session")
def qwen_vllm_server(qwen_vllm_harness: Harness):
    return qwen_vllm_harness.serve()
