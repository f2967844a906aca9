"""One model of a server whose vLLM engine serves LoRA adapters: an adapter of the base (a lone LoRA model,
or one of several), or the bare base, under its own name (``servers[].models``, docs/lora.md).

A `SharedModel` is an `ajet_hpc.engine.base.Engine` to everything above it (the HTTP layer, the recorder,
the coordinator): it has its own policy version, and its ``load_weights`` replaces only its adapter
(`VllmEngine.load_adapter`: pause, in-place ``add_lora``, prefix-cache reset, version tag). Every request
it generates names its adapter. Starting and stopping belong to the shared engine, which the server's
application starts once for all its models (``ajet_hpc.server.app.ServerApp``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from ajet_hpc.engine.base import Chunk, EngineError, SamplingParams
from ajet_hpc.engine.vllm_engine import BARE_BASE, VllmEngine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SharedModel:
    """The model ``adapter`` (`BARE_BASE`: the base itself) of the shared ``engine``."""

    def __init__(self, engine: VllmEngine, adapter: str) -> None:
        self.shared, self.adapter = engine, adapter
        self.name = engine.name
        self.max_model_len = engine.max_model_len
        self.policy_version = 0

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.shared.tokenizer

    @property
    def failure(self) -> str | None:
        """The shared engine's failure (``watchdog.engine_failure``): every model of it has lost it."""
        return self.shared.failure

    @property
    def last_pause_s(self) -> float:
        return self.shared.last_pause_s

    async def start(self) -> None:
        """Nothing: the server starts the shared engine once for all its models."""

    async def stop(self) -> None:
        """Nothing: the server stops the shared engine once all its models are done."""

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, stream: bool = True
    ) -> AsyncIterator[Chunk]:
        return self.shared.generate(prompt_ids, params, request_id, stream=stream, adapter=self.adapter)

    async def abort(self, request_id: str) -> None:
        await self.shared.abort(request_id)

    async def load_weights(self, path: Path, version: int) -> None:
        """Replace this model's adapter by the folder ``path`` as policy version ``version``."""
        if self.adapter == BARE_BASE:
            raise EngineError("this model is the bare base of a shared engine: it takes no weights")

        def tag() -> None:
            self.policy_version = version

        await self.shared.load_adapter(self.adapter, Path(path), version, tag)

    async def sleep(self) -> float:
        """The shared engine's sleep: placement colocate is refused for a job with several models
        (config.rules), so only a lone LoRA model's trainer puts it to sleep."""
        return await self.shared.sleep()

    async def wake_up(self) -> float:
        return await self.shared.wake_up()
