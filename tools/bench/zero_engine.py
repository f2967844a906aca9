"""A zero-latency engine for benchmarks: every request gets the same short answer at once.

It satisfies `ajet_hpc.engine.base.Engine` with the tokenizer of a real model folder (e.g. the built-in
tiny model), so the server does all of its real work — auth, request validation, chat template, token
tracking, recording the timeline, building the response — while the engine costs (almost) nothing. What a
benchmark then measures is the server's own overhead per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from ajet_hpc.engine.base import Chunk, EngineError, FinishReason, SamplingParams, fit_max_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ANSWER_TEXT = "Done."
ANSWER_LOGPROB = -0.5


class ZeroEngine:
    """`Engine` that answers ``ANSWER_TEXT`` + EOS (finish "stop") in one `Chunk`, without waiting.

    ``max_tokens`` (clamped to the context room like the real engines) shorter than the answer cuts it and
    finishes with "length".
    """

    name = "zero"

    def __init__(self, model_path: Path, max_model_len: int = 1024, text: str = ANSWER_TEXT) -> None:
        self.model_path = Path(model_path)
        self.max_model_len = max_model_len
        self.policy_version = 0
        self.text = text
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._ids: list[int] = []
        self._logprobs: list[float] = []

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise EngineError("the engine is not started: call start() first")
        return self._tokenizer

    async def __aenter__(self) -> ZeroEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def sleep(self) -> float:
        return 0.0  # nothing to free

    async def wake_up(self) -> float:
        return 0.0

    async def start(self) -> None:
        if self._tokenizer is not None:
            return
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        ids = list(tokenizer(self.text, add_special_tokens=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(int(tokenizer.eos_token_id))
        self._tokenizer, self._ids = tokenizer, ids
        self._logprobs = [ANSWER_LOGPROB] * len(ids)

    async def stop(self) -> None:
        pass

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, stream: bool = True
    ) -> AsyncIterator[Chunk]:
        if self._tokenizer is None:
            raise EngineError("the engine is not started: call start() first")
        room = fit_max_tokens(len(prompt_ids), params.max_tokens, self.max_model_len)
        ids = self._ids[:room]
        finish: FinishReason = "stop" if len(ids) == len(self._ids) else "length"
        yield Chunk(list(ids), self._logprobs[: len(ids)], finish)

    async def abort(self, request_id: str) -> None:
        pass

    async def load_weights(self, path: Path, version: int) -> None:
        self.policy_version = version
