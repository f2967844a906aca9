"""The server form written before a server job became an engine and its models, read on load.

Until the engine block and ``models:`` list, a server entry was flat: ``model``, ``engine`` (a string),
``engine_gpus``, ``gpu_memory_gib`` and ``vllm`` described the engine; ``trainer`` and ``store`` the model
served under the server's own name; ``adapters`` more models (LoRA adapters of the same base, each with a
trainer that defaulted to a rank-16 adapter). Such an entry still loads: :func:`to_new_form` rewrites it,
meaning for meaning, before it is validated (``ServerConfig``), and an error in it is reported at the path
the user wrote (:func:`old_path`). Overrides given in either form reach a server written in the other
(``config.overrides``).
"""

from __future__ import annotations

import re
from typing import Any

ENGINE_KEYS = {"model": "model", "engine": "kind", "engine_gpus": "gpus", "gpu_memory_gib": "gpu_memory_gib"}
"""Old key -> key of the new ``engine`` block (``vllm`` keeps its name there)."""
ENGINE_KEYS_OLD = {new: old for old, new in ENGINE_KEYS.items()}

MODEL_KEYS = ("trainer", "store")
"""Old keys that belong to the model served under the server's name (``models[0]``)."""

OLD_KEYS = (*ENGINE_KEYS, "vllm", *MODEL_KEYS, "adapters")
NEW_KEYS = ("engine", "models")

OLD_FORM_KEYS = (
    *("name", "model", "engine", "partition", "nodes", "gpus_per_node", "placement", "engine_gpus"),
    *("gpu_memory_gib", "vllm", "cpus", "mem", "time", "port", "serving", "store", "trainer", "adapters"),
)
"""The keys of an old-form server, in the order it listed them."""


def is_old_form(server: dict[str, Any]) -> bool:
    """Whether a raw server entry is written in the old form (an entry with neither form's keys is taken as
    old: its errors then name ``model``); ``ValueError`` naming both when it mixes the two forms' keys."""
    old = [
        key for key in OLD_KEYS if key in server and not (key == "engine" and isinstance(server[key], dict))
    ]
    new = [
        key
        for key in NEW_KEYS
        if key in server and not (key == "engine" and not isinstance(server[key], dict))
    ]
    if old and new:
        raise ValueError(
            f"this server mixes the old form's keys ({', '.join(old)}) with the new form's "
            f"({', '.join(new)}): write it in one form (docs/config.md, 'A server job'), e.g. the model and "
            "engine settings under engine: and each model's trainer and store under models:"
        )
    return bool(old) or not new


def to_new_form(server: dict[str, Any]) -> dict[str, Any]:
    """The new form of an old server entry: its engine keys in ``engine``, the model under the server's name
    (its ``trainer`` and ``store``) first in ``models``, then each adapter (its default trainer written
    out)."""
    new = {key: value for key, value in server.items() if key not in OLD_KEYS}
    engine = {new_key: server[old] for old, new_key in ENGINE_KEYS.items() if old in server}
    if "vllm" in server:
        engine["vllm"] = server["vllm"]
    new["engine"] = engine
    own = {key: server[key] for key in ("name", *MODEL_KEYS) if key in server}
    adapters = server.get("adapters", [])
    if not isinstance(adapters, list):
        raise ValueError(f"adapters must be a list of models (got {type(adapters).__name__})")
    new["models"] = [own, *(_adapter(a) for a in adapters)]
    return new


def _adapter(adapter: Any) -> Any:
    """An old ``adapters[]`` entry without ``trainer`` trained a rank-16 LoRA adapter (LoraConfig's
    defaults); a model of the new form without one has the default trainer, full fine-tuning."""
    if isinstance(adapter, dict) and "trainer" not in adapter:
        return {**adapter, "trainer": {"lora": {}}}
    return adapter


_SERVER_PATH = re.compile(r"(servers\[\d+\])(?:\.(.*))?")
_ENGINE_PATH = re.compile(r"engine\.(model|kind|gpus|gpu_memory_gib)\b(.*)|engine\.vllm\b(.*)")
_MODEL_PATH = re.compile(r"models\[(\d+)\](?:\.(.*))?")


def old_path(path: str) -> str:
    """A field path of the new form (``servers[0].engine.gpus``, ``servers[0].models[2].trainer``) as the old
    form writes it (``servers[0].engine_gpus``, ``servers[0].adapters[1].trainer``); other paths unchanged."""
    match = _SERVER_PATH.fullmatch(path)
    if match is None or match[2] is None:
        return path
    server, rest = match[1], match[2]
    engine = _ENGINE_PATH.fullmatch(rest)
    if engine is not None:
        if engine[1] is not None:
            return f"{server}.{ENGINE_KEYS_OLD[engine[1]]}{engine[2]}"
        return f"{server}.vllm{engine[3]}"
    model = _MODEL_PATH.fullmatch(rest)
    if model is None:
        return path
    index, field = int(model[1]), model[2]
    if index == 0:
        return f"{server}.{field}" if field else server
    adapter = f"{server}.adapters[{index - 1}]"
    return f"{adapter}.{field}" if field else adapter
