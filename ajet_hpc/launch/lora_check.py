"""Can the server's model and engine take its ``trainer.lora``? Checked before anything is submitted.

Two questions, each answered from the model's ``config.json`` alone (the model built on the meta device,
no weights read): does the model have a linear layer of every name in ``target_modules`` (peft would
fail at the trainer's start), and, where the engine is vLLM, does vLLM's implementation of the
architecture serve LoRA adapters (``SupportsLoRA``)? A built-in model is built in a temporary folder
(it is tiny). The rank against ``vllm.max_lora_rank`` is a plain field check (`Topology`).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from ajet_hpc.config import ConfigIssue, ServerConfig, Topology
from ajet_hpc.engine.adapter import ADAPTER_CONFIG, linear_module_names
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.select import resolve_kind

log = logging.getLogger(__name__)


def lora_issues(topology: Topology) -> list[ConfigIssue]:
    """What keeps each LoRA server's model or engine from taking its adapter, naming the field."""
    issues: list[ConfigIssue] = []
    for index, server in enumerate(topology.servers):
        if not server.lora_models() and not server.frozen_adapters():
            continue
        with tempfile.TemporaryDirectory(prefix="ajet-lora-check-") as scratch:
            model_dir = _model_dir(server, Path(scratch))
            if model_dir is None:
                continue  # the model field's own check reports it
            for j, model in enumerate(server.models):
                if model.trainer is not None and model.trainer.lora is not None:
                    issues += _model_issues(index, server, j, model_dir)
            issues += _frozen_issues(index, server, model_dir)
            if server.engine.kind != "transformers" and resolve_kind(server.engine.kind) == "vllm":
                refusal = _vllm_refusal(model_dir)
                if refusal is not None:
                    issues.append(ConfigIssue(server.path(index, "engine.kind"), refusal))
    return issues


def _frozen_issues(index: int, server: ServerConfig, model_dir: Path) -> list[ConfigIssue]:
    """A frozen adapter's folder: there, a peft adapter, of layers the model has, of a rank the engine
    serves."""
    issues = []
    ranks = []
    have: set[str] | None = None
    for j, model in enumerate(server.models):
        if model.adapter is None or model.trainer is not None:
            continue
        where = server.path(index, f"models[{j}].adapter")
        folder = Path(model.adapter).expanduser()
        try:
            config = json.loads((folder / ADAPTER_CONFIG).read_text())
            rank = int(config["r"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            what = "no such folder" if not folder.is_dir() else f"not a peft adapter folder ({error})"
            issues.append(
                ConfigIssue(where, f"{folder}: {what}; give a folder with {ADAPTER_CONFIG} and its weights")
            )
            continue
        ranks.append(rank)
        targets = config.get("target_modules")
        if isinstance(targets, list):
            have = linear_module_names(model_dir) if have is None else have
            missing = [name for name in targets if name not in have]
            if missing:
                issues.append(
                    ConfigIssue(
                        where,
                        f"{folder} adapts {', '.join(map(repr, missing))}, which {server.engine.model} has "
                        "no linear layer named: an adapter of another base model?",
                    )
                )
        limit = server.lora_rank_limit(ranks)
        if limit is not None and rank > limit:
            issues.append(
                ConfigIssue(
                    where,
                    f"{folder} has rank {rank}, above "
                    f"{server.path(index, 'engine.vllm.max_lora_rank')}={limit}: raise it",
                )
            )
    return issues


def _model_dir(server: ServerConfig, scratch: Path) -> Path | None:
    if server.engine.model.startswith("builtin:"):
        return resolve_model(server.engine.model, scratch)
    folder = Path(server.engine.model).expanduser()
    return folder if (folder / "config.json").is_file() else None


def _model_issues(index: int, server: ServerConfig, j: int, model_dir: Path) -> list[ConfigIssue]:
    """The target modules of ``server.models[j]``'s ``trainer.lora`` that the model does not have."""
    trainer = server.models[j].trainer
    assert trainer is not None and trainer.lora is not None
    lora = trainer.lora
    try:
        have = linear_module_names(model_dir)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        return [
            ConfigIssue(
                server.path(index, "engine.model"), f"cannot read {model_dir / 'config.json'}: {error}"
            )
        ]
    issues = []
    missing = [name for name in lora.target_modules if name not in have]
    if missing:
        issues.append(
            ConfigIssue(
                server.path(index, f"models[{j}].trainer.lora.target_modules"),
                f"the model has no linear layer named {', '.join(map(repr, missing))}; its linear layers "
                f"are: {', '.join(sorted(have))}",
            )
        )
    return issues


def _vllm_refusal(model_dir: Path) -> str | None:
    """Why vLLM cannot serve LoRA adapters of this architecture; None when it can (or vLLM cannot say)."""
    architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    try:
        from vllm.model_executor.models.interfaces import supports_lora
        from vllm.model_executor.models.registry import ModelRegistry

        classes = [ModelRegistry._try_load_model_cls(a) for a in architectures]
    except (ImportError, AttributeError) as error:  # no vLLM here, or its registry moved
        log.info("vLLM's LoRA support of %s not checked: %s", architectures, error)
        return None
    found = [c for c in classes if c is not None]
    if not found:
        return None  # an architecture vLLM does not know at all: the engine's start says so
    if not any(supports_lora(c) for c in found):
        return (
            f"vLLM's {found[0].__name__} has no LoRA support (SupportsLoRA): train it with "
            "engine: transformers or without trainer.lora"
        )
    return None
