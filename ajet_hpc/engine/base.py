"""The one interface every inference engine implements, and the rules both engines share.

An engine turns prompt token ids into sampled token ids, streamed as `Chunk` increments, each token with
its log-probability under the model. Token ids in, token ids out: the chat template, the text and the
OpenAI schema belong to the HTTP layer (``ajet_hpc.server``), which records every token it serves.

Log-probabilities are *raw*: the log-softmax of the model's logits at temperature 1, before temperature,
top-p or any other processing (vLLM's ``logprobs_mode="raw_logprobs"``). They are what the trainer needs
(the behaviour policy's log-probability of each sampled token) and what a forward pass of the same weights
over prompt + response reproduces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, Self, runtime_checkable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FinishReason = Literal["stop", "length", "abort"]

GREEDY_EPS = 1e-5
"""A temperature below this samples greedily (argmax), as in vLLM."""


class EngineError(Exception):
    """A request or an operation the engine cannot serve; the message says why and what to change."""


class EngineNotRunning(EngineError):
    """The engine is not started, or stopped: the server is going down (its job requeued or over), or not up
    yet. The server answers 503 ``engine_not_running``; clients take the server as away, not as failing."""


NOT_RUNNING = "the engine is not running: not started yet, or stopped because its server is going down"


class PromptTooLong(EngineError):
    """The prompt leaves no room for even one new token within the engine's ``max_model_len``."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    A temperature below ``GREEDY_EPS`` (e.g. 0) samples greedily. A ``seed`` makes sampling reproducible
    on one engine (not across engines: their random streams differ). Generation stops after the
    tokenizer's / the model's EOS ids (always), any of ``stop_token_ids``, or the token that completes any
    of the ``stop`` strings, checked on the text decoded with special tokens skipped.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(
                f"temperature must be >= 0 and finite (0 samples greedily), got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        # Lists are accepted for convenience and frozen into tuples (the object stays hashable).
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must hold token ids (integers >= 0), got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` of a completion were sampled by policy version ``version``."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class Chunk:
    """One streamed increment of a completion.

    ``token_ids`` are the newly sampled tokens exactly as sampled: an EOS, stop token or the token that
    completes a stop string is included (the HTTP layer trims the text). ``logprobs[i]`` is the raw
    log-probability of ``token_ids[i]`` (see the module doc). ``finish_reason`` is None while running and
    set on the last chunk only: "stop" (EOS, stop token or stop string), "length" (``max_tokens`` or the
    end of the context) or "abort" (`Engine.abort` or the consumer stopped reading). The last chunk may
    carry no tokens.

    ``versions``, on the last chunk of an engine that knows it, is which policy version sampled which
    tokens of the whole completion: one span, or several when the weights were swapped while it ran (a
    swap pauses generation and keeps the requests in flight). Empty where the engine cannot say; then the
    version read when the request was submitted stands for it.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None = None
    versions: tuple[VersionSpan, ...] = ()


@runtime_checkable
class Engine(Protocol):
    """An inference engine. Use as ``async with engine:`` or call `start` / `stop`.

    ``generate(prompt_ids, params, request_id, stream=True)`` streams `Chunk` s; concatenating all chunks'
    token_ids gives exactly what was sampled, and the last chunk has ``finish_reason`` set. With
    ``stream=False`` the caller wants only the whole completion, and the engine may deliver it in fewer
    chunks (vLLM: one, at the end, which saves a Python round trip per token). The request needs at
    least one free position: a prompt of ``max_model_len`` tokens or more raises `PromptTooLong`, and
    ``max_tokens`` is clamped to the room left (``max_model_len - len(prompt_ids)``), which then ends with
    "length". Errors are `EngineError` s, raised when the iterator is first advanced.
    ``abort(request_id)`` ends a running request (its stream ends with "abort"); unknown ids are ignored.
    ``load_weights(path, version)`` loads the weights of a ``save_pretrained`` folder of the same
    architecture into the running engine and sets ``policy_version``; the engines document what happens
    to requests in flight. ``sleep()`` frees the engine's accelerator memory while colocated trainer ranks
    run and ``wake_up()`` takes it back, each returning the seconds it took (0 for an engine without a
    sleep mode: `EngineLifecycle`).
    """

    name: str
    max_model_len: int
    policy_version: int

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, stream: bool = True
    ) -> AsyncIterator[Chunk]: ...

    async def abort(self, request_id: str) -> None: ...

    async def load_weights(self, path: Path, version: int) -> None: ...

    async def sleep(self) -> float: ...

    async def wake_up(self) -> float: ...


def fit_max_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """``max_tokens`` clamped to the room the prompt leaves; `PromptTooLong` when there is none."""
    if prompt_len < 1:
        raise EngineError("the prompt is empty: give at least one token id")
    room = max_model_len - prompt_len
    if room < 1:
        raise PromptTooLong(
            f"the prompt has {prompt_len} tokens and the engine's max_model_len is {max_model_len}: "
            f"shorten the prompt to at most {max_model_len - 1} tokens or raise max_model_len"
        )
    return min(max_tokens, room)


def check_prompt(prompt_ids: list[int], vocab_size: int, max_tokens: int, max_model_len: int) -> int:
    """Validate prompt token ids; returns the max_tokens the request may use (`fit_max_tokens`)."""
    # the common case in C (types, then the range); the list of offenders only when there are some
    if set(map(type, prompt_ids)) <= {int} and (
        not prompt_ids or 0 <= min(prompt_ids) <= max(prompt_ids) < vocab_size
    ):
        return fit_max_tokens(len(prompt_ids), max_tokens, max_model_len)
    bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"prompt token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
    return fit_max_tokens(len(prompt_ids), max_tokens, max_model_len)


async def generate_all(
    engine: Engine, prompt_ids: list[int], params: SamplingParams, request_id: str
) -> Chunk:
    """The whole completion as one `Chunk` (all chunks of `Engine.generate` concatenated)."""
    token_ids: list[int] = []
    logprobs: list[float] = []
    finish_reason: FinishReason | None = None
    versions: tuple[VersionSpan, ...] = ()
    async for chunk in engine.generate(prompt_ids, params, request_id, stream=False):
        token_ids += chunk.token_ids
        logprobs += chunk.logprobs
        finish_reason, versions = chunk.finish_reason, chunk.versions
    if finish_reason is None:
        raise EngineError(f"request {request_id}: the stream ended without a finish reason")
    return Chunk(token_ids, logprobs, finish_reason, versions)


class EngineLifecycle(ABC):
    """What both engines share: ``async with engine:`` and the tokenizer, available once started."""

    _tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise EngineNotRunning(NOT_RUNNING)
        return self._tokenizer

    @abstractmethod
    async def start(self) -> None:
        """Load the model and the tokenizer (each engine its own way)."""

    @abstractmethod
    async def stop(self) -> None:
        """Abort what runs and release the model."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def sleep(self) -> float:
        """Free the engine's accelerator memory while the trainer runs (placement colocate); the seconds
        it took. Engines without a sleep mode keep their memory and return 0."""
        return 0.0

    async def wake_up(self) -> float:
        """Undo `sleep`; the seconds it took (0 when there was nothing to undo)."""
        return 0.0

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
