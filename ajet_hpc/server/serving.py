"""Serving chat and text completions for an episode: prompt → engine → answer, every token recorded.

The prompt comes from the episode's context tracker (token-in, token-out: earlier answers are spliced in
as the ids that were sampled). Each answer becomes a timeline of the episode. Streaming yields text as the
engine produces tokens, holding back only what may still turn out to be a stop string or a tool call.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from jinja2 import TemplateError

from ajet_hpc.config import ServingConfig
from ajet_hpc.engine.base import (
    Chunk,
    Engine,
    EngineError,
    EngineNotRunning,
    PromptTooLong,
    SamplingParams,
    VersionSpan,
)
from ajet_hpc.server import http_schemas as p
from ajet_hpc.server.episodes import OPEN, Episode
from ajet_hpc.server.errors import ENGINE_NOT_RUNNING, BadRequest, NotFound, Unavailable
from ajet_hpc.server.toolcalls import PARSERS, holdback
from ajet_hpc.tracking.context import PromptPlan
from ajet_hpc.tracking.timeline import USER

log = logging.getLogger(__name__)


FinishReason = Literal["stop", "length", "tool_calls"]


@dataclass
class Answer:
    """One choice being generated: the tokens so far and what of its text was already streamed."""

    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    streamed: int = 0  # characters of visible text already sent
    versions: tuple[VersionSpan, ...] = ()  # which policy version sampled which tokens (`Chunk.versions`)

    def policy_version(self, submitted: int) -> int:
        """The version of the weights that sampled its first tokens (the oldest, where a swap came while it
        ran); ``submitted`` (read when it was submitted) where the engine does not say."""
        return self.versions[0].version if self.versions else submitted


@dataclass
class Finished:
    content: str | None
    tool_calls: list[p.ToolCall]
    finish_reason: FinishReason


def _one_text(decoded: str | list[str]) -> str:
    """``tokenizer.decode`` of one sequence (typed ``str | list[str]``: a list only for a batch)."""
    if not isinstance(decoded, str):
        raise TypeError(f"decode of one sequence gave {type(decoded).__name__}, not text")
    return decoded


class Service:
    """Chat and text completions of one server, against one engine."""

    def __init__(self, engine: Engine, settings: ServingConfig, model_name: str) -> None:
        self.engine, self.settings, self.model_name = engine, settings, model_name
        self.parse, self.tool_open = PARSERS[settings.tool_parser]
        self.in_flight = 0
        self.served = 0

    # ------------------------------------------------------------------------------------- validation
    def check_request(self, model: str, n: int, max_tokens: int | None) -> None:
        if model != self.model_name:
            raise NotFound(
                f"model {model!r} does not exist here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if n > self.settings.max_n:
            raise BadRequest(f"n={n} is above this server's limit of {self.settings.max_n}", param="n")
        if max_tokens is not None and max_tokens > self.settings.max_tokens:
            raise BadRequest(
                f"max_tokens={max_tokens} is above this server's limit of {self.settings.max_tokens}",
                param="max_tokens",
            )

    def check_sizes(self, request: p.ChatCompletionRequest | p.CompletionRequest) -> None:
        """The per-request work limits: messages, tools, stop strings (count and length); 400 beyond."""
        limits = self.settings
        counted = [("stop", len(request.stop_list()), limits.max_stop, "max_stop")]
        if isinstance(request, p.ChatCompletionRequest):
            counted.append(("messages", len(request.messages), limits.max_messages, "max_messages"))
            counted.append(("tools", len(request.tools or ()), limits.max_tools, "max_tools"))
        for param, count, limit, name in counted:
            if count > limit:
                raise BadRequest(
                    f"{param} has {count} entries; this server's limit is {limit} (serving.{name})",
                    param=param,
                    code="limit_exceeded",
                )
        if any(not stop for stop in request.stop_list()):  # the engine refuses one (a 500 if it got there)
            raise BadRequest("stop holds an empty string; give non-empty stop strings", param="stop")
        longest = max((len(stop) for stop in request.stop_list()), default=0)
        if longest > limits.max_stop_chars:
            raise BadRequest(
                f"a stop string has {longest} characters; this server's limit is {limits.max_stop_chars} "
                "(serving.max_stop_chars)",
                param="stop",
                code="limit_exceeded",
            )

    async def chat_plan(self, request: p.ChatCompletionRequest, episode: Episode) -> PromptPlan:
        self.check_request(request.model, request.n, request.requested_max_tokens())
        self.check_sizes(request)
        messages = [message.for_template() for message in request.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        try:
            if _heavy(messages, tools):  # off the event loop: /health and other calls go on meanwhile
                plan = await asyncio.to_thread(episode.live_tracker.build_prompt, messages, tools)
            else:  # inline: for a small prompt a thread hop costs more than it saves (tools/bench/README.md)
                plan = episode.live_tracker.build_prompt(messages, tools)
        except (TemplateError, TypeError, ValueError) as exc:
            raise BadRequest(f"the model's chat template cannot render these messages: {exc}") from exc
        self._check_length(len(plan.prompt_ids))
        return plan

    def completion_plan(self, request: p.CompletionRequest) -> PromptPlan:
        self.check_request(request.model, request.n, request.max_tokens)
        self.check_sizes(request)
        tokenizer = self.engine.tokenizer
        if isinstance(request.prompt, str):
            ids = tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
            text = request.prompt
        else:
            vocab = len(tokenizer)
            if any(not 0 <= token < vocab for token in request.prompt):
                raise BadRequest(
                    f"prompt holds token ids outside the vocabulary (0..{vocab - 1})", param="prompt"
                )
            ids, text = list(request.prompt), _one_text(tokenizer.decode(request.prompt))
        self._check_length(len(ids))
        return PromptPlan(
            prompt_ids=ids,
            token_authors=[USER] * len(ids),
            reused_spans=[],
            drift=[],
            text=text,
            messages=[{"role": "user", "content": text}],
            tools=None,
            history_key="",
            created_at=time.time(),
        )

    def _check_length(self, prompt_len: int) -> None:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise BadRequest(
                f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens, which leaves "
                "no room for an answer",
                param="messages",
                code="context_length_exceeded",
            )

    def sampling(self, request: Any, prompt_len: int, index: int) -> SamplingParams:
        wanted = (
            request.requested_max_tokens() if hasattr(request, "requested_max_tokens") else request.max_tokens
        )
        room = self.engine.max_model_len - prompt_len
        seed = None if request.seed is None else request.seed + index
        return SamplingParams(
            max_tokens=max(1, min(wanted or self.settings.max_tokens, room)),
            temperature=request.temperature,
            top_p=request.top_p,
            seed=seed,
            stop=tuple(request.stop_list()),
        )

    # -------------------------------------------------------------------------------------- generation
    async def generate_all(self, plan: PromptPlan, request: Any, prefix: str) -> list[Answer]:
        """Every choice of a request, generated concurrently (the engine batches them)."""
        answers = [Answer(index) for index in range(request.n)]

        async def run(answer: Answer) -> None:
            params = self.sampling(request, len(plan.prompt_ids), answer.index)
            request_id = f"{prefix}-{answer.index}"
            async for chunk in self.engine.generate(plan.prompt_ids, params, request_id, stream=False):
                self._absorb(answer, chunk)

        await self._guarded(asyncio.gather(*(run(answer) for answer in answers)))
        return answers

    async def _guarded(self, awaitable: Any) -> Any:
        self.in_flight += 1
        try:
            return await awaitable
        except PromptTooLong as exc:
            raise BadRequest(str(exc), param="messages", code="context_length_exceeded") from exc
        except EngineNotRunning as exc:  # the server is going down (or not up): the client waits for it
            raise Unavailable(str(exc), code=ENGINE_NOT_RUNNING) from exc
        except EngineError as exc:
            raise BadRequest(str(exc)) from exc
        finally:
            self.in_flight -= 1

    @staticmethod
    def _absorb(answer: Answer, chunk: Chunk) -> None:
        answer.ids.extend(chunk.token_ids)
        answer.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            answer.finish = chunk.finish_reason
            answer.versions = chunk.versions

    def text_of(self, answer: Answer, stops: list[str]) -> tuple[str, bool]:
        """The answer's text without special tokens, cut before the first stop string (and whether cut)."""
        text = _one_text(self.engine.tokenizer.decode(answer.ids, skip_special_tokens=True))
        cuts = [text.find(stop) for stop in stops if stop in text]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def finish(self, answer: Answer, stops: list[str], tools_allowed: bool) -> Finished:
        text, cut = self.text_of(answer, stops)
        reason: FinishReason = "stop" if cut or answer.finish in ("stop", "abort") else "length"
        if not tools_allowed:
            return Finished(text, [], reason)
        parsed = self.parse(text)
        if parsed.tool_calls and reason == "stop":
            reason = "tool_calls"
        return Finished(parsed.content, parsed.tool_calls, reason)

    def record(
        self, episode: Episode, plan: PromptPlan, answer: Answer, done: Finished, version: int
    ) -> None:
        if episode.state != OPEN:  # aborted while the call ran: the closed record stays as it was
            log.info("episode %s closed during a call; its answer is not recorded", episode.episode_id)
            return
        reply: dict[str, Any] = {"role": "assistant", "content": done.content}
        if done.tool_calls:
            reply["tool_calls"] = [call.model_dump() for call in done.tool_calls]
        spans = [(s.version, s.start, s.end) for s in answer.versions] if len(answer.versions) > 1 else []
        episode.live_tracker.record(
            plan,
            answer.ids,
            answer.logprobs,
            reply,
            done.finish_reason,
            answer.policy_version(version),
            version_spans=spans,
        )

    def logprobs_of(self, answer: Answer, start: int = 0, end: int | None = None) -> p.ChoiceLogprobs:
        tokenizer = self.engine.tokenizer
        ids, values = answer.ids[start:end], answer.logprobs[start:end]
        return p.ChoiceLogprobs(
            content=[
                p.TokenLogprob(token=_one_text(tokenizer.decode([t])), logprob=v)
                for t, v in zip(ids, values, strict=True)
            ]
        )

    # ------------------------------------------------------------------------------------------- chat
    async def chat(self, request: p.ChatCompletionRequest, episode: Episode) -> p.ChatCompletionResponse:
        plan = await self.chat_plan(request, episode)
        version = self.engine.policy_version
        answers = await self.generate_all(plan, request, f"chat-{uuid.uuid4().hex[:12]}")
        choices = []
        for answer in answers:
            done = self.finish(answer, request.stop_list(), bool(request.tools))
            self.record(episode, plan, answer, done, version)
            message = p.ResponseMessage(content=done.content, tool_calls=done.tool_calls or None)
            logprobs = self.logprobs_of(answer) if request.logprobs else None
            choices.append(
                p.ChatChoice(
                    index=answer.index, message=message, logprobs=logprobs, finish_reason=done.finish_reason
                )
            )
        self.served += 1
        return p.ChatCompletionResponse(
            model=self.model_name,
            choices=choices,
            usage=_usage(plan, answers),
            policy_version=min(answer.policy_version(version) for answer in answers),
        )

    async def chat_stream(
        self, request: p.ChatCompletionRequest, episode: Episode, plan: PromptPlan
    ) -> AsyncIterator[str]:
        """Server-sent events of a streamed chat completion, as the openai client reads them."""
        head = p.ChatCompletionChunk(
            id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
            created=int(time.time()),
            model=self.model_name,
            choices=[],
        )
        version = self.engine.policy_version
        stops, tools_allowed = request.stop_list(), bool(request.tools)
        answers = [Answer(index) for index in range(request.n)]
        for answer in answers:
            yield _sse(head, [p.ChunkChoice(index=answer.index, delta=p.Delta(role="assistant", content=""))])
        queue: asyncio.Queue[tuple[Answer, Chunk | BaseException | None]] = asyncio.Queue()

        async def run(answer: Answer) -> None:
            params = self.sampling(request, len(plan.prompt_ids), answer.index)
            try:
                async for chunk in self.engine.generate(plan.prompt_ids, params, f"{head.id}-{answer.index}"):
                    await queue.put((answer, chunk))
            except BaseException as exc:  # handed to the consumer, which re-raises it
                await queue.put((answer, exc))
            await queue.put((answer, None))

        self.in_flight += 1
        tasks = [asyncio.create_task(run(answer)) for answer in answers]
        try:
            running = len(tasks)
            while running:
                answer, item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                start = len(answer.ids)
                self._absorb(answer, item)
                delta = self._visible_delta(answer, stops, tools_allowed)
                if delta or request.logprobs:
                    logprobs = self.logprobs_of(answer, start) if request.logprobs else None
                    choice = p.ChunkChoice(
                        index=answer.index, delta=p.Delta(content=delta or ""), logprobs=logprobs
                    )
                    yield _sse(head, [choice])
            for answer in answers:
                done = self.finish(answer, stops, tools_allowed)
                self.record(episode, plan, answer, done, version)
                for choice in self._closing_choices(answer, done):
                    yield _sse(head, [choice])
            if request.stream_options and request.stream_options.include_usage:
                yield _sse(head, [], usage=_usage(plan, answers))
            self.served += 1
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            for task in tasks:
                if not task.done():
                    task.cancel()
                    await self.engine.abort(f"{head.id}-{answers[tasks.index(task)].index}")

    def _visible_delta(self, answer: Answer, stops: list[str], tools_allowed: bool) -> str:
        text, cut = self.text_of(answer, stops)
        markers = list(stops)
        if tools_allowed:
            if self.tool_open in text:
                text = text[: text.index(self.tool_open)]
                cut = True
            markers.append(self.tool_open)
        visible = text if cut or answer.finish else text[: len(text) - holdback(text, markers)]
        delta = visible[answer.streamed :] if len(visible) > answer.streamed else ""
        answer.streamed = max(answer.streamed, len(visible))
        return delta

    def _closing_choices(self, answer: Answer, done: Finished) -> list[p.ChunkChoice]:
        choices = []
        content = done.content or ""
        if len(content) > answer.streamed:  # text held back to the end (a tool call that did not parse)
            choices.append(
                p.ChunkChoice(index=answer.index, delta=p.Delta(content=content[answer.streamed :]))
            )
        if done.tool_calls:
            calls = [
                p.DeltaToolCall(index=i, id=call.id, type="function", function=call.function)
                for i, call in enumerate(done.tool_calls)
            ]
            choices.append(p.ChunkChoice(index=answer.index, delta=p.Delta(tool_calls=calls)))
        choices.append(p.ChunkChoice(index=answer.index, delta=p.Delta(), finish_reason=done.finish_reason))
        return choices

    # ------------------------------------------------------------------------------- text completions
    async def completion(self, request: p.CompletionRequest, episode: Episode) -> p.CompletionResponse:
        if len(request.prompt) > HEAVY_CHARS:  # tokenizing a long text: off the event loop
            plan = await asyncio.to_thread(self.completion_plan, request)
        else:
            plan = self.completion_plan(request)
        version = self.engine.policy_version
        answers = await self.generate_all(plan, request, f"cmpl-{uuid.uuid4().hex[:12]}")
        choices = []
        for answer in answers:
            done = self.finish(answer, request.stop_list(), tools_allowed=False)
            self.record(episode, plan, answer, done, version)
            choices.append(
                p.CompletionChoice(
                    index=answer.index,
                    text=done.content or "",
                    finish_reason="stop" if done.finish_reason == "stop" else "length",  # no tools here
                )
            )
        self.served += 1
        return p.CompletionResponse(model=self.model_name, choices=choices, usage=_usage(plan, answers))


HEAVY_MESSAGES = 32
HEAVY_CHARS = 64 * 1024


def _heavy(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether building this prompt may take long enough (milliseconds) to move it off the event loop."""
    if len(messages) > HEAVY_MESSAGES or len(tools or ()) > HEAVY_MESSAGES:
        return True
    size = 0
    for message in messages:
        size += len(message.get("content") or "")
        size += sum(len(call["function"]["arguments"]) for call in message.get("tool_calls") or ())
    return size > HEAVY_CHARS


def _usage(plan: PromptPlan, answers: list[Answer]) -> p.Usage:
    completion = sum(len(answer.ids) for answer in answers)
    prompt = len(plan.prompt_ids)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _sse(head: p.ChatCompletionChunk, choices: list[p.ChunkChoice], usage: p.Usage | None = None) -> str:
    chunk = head.model_copy(update={"choices": choices, "usage": usage})
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
