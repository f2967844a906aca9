"""Wire schemas of the server: OpenAI's chat/completions (in OpenAI's field order) and the episode API.

Our own schemas, nothing imported from vLLM. They parse leniently (extra fields are kept); which fields
a call may carry, and the 400 naming any other, is ``request_policy``'s. Extensions beyond OpenAI are
marked "(ajet extension)".
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ajet_hpc.tracking.episode import EpisodeState

MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON a request may carry (metadata, tool-call arguments): deeper input would hit
Python's recursion limit when stored, rendered or parsed again (a 500 instead of a 400)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str) -> None:
    """Refuse a string with a lone surrogate (JSON allows ``"\\ud800"``; UTF-8, and so the stores, do not)."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"{where}: text holds a lone surrogate (U+{ord(found.group()):04X} at character "
            f"{found.start()}), which is not valid Unicode and cannot be stored; send valid UTF-8 text"
        )


def check_json(value: Any, where: str) -> None:
    """Refuse JSON nested deeper than ``MAX_JSON_DEPTH`` or holding lone surrogates (keys and strings)."""
    stack = [(value, 0, where)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    check_text(key, f"{path} (a key)")
                child_path = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
                stack.append((child, depth + 1, child_path))


def check_arguments(arguments: str, where: str) -> None:
    """Tool-call arguments: any text, but when it is JSON, not nested deeper than ``MAX_JSON_DEPTH``."""
    try:
        parsed = json.loads(arguments)
    except RecursionError:
        raise ValueError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        return  # not JSON: the model's text as it was (the tracker compares it as text)
    check_json(parsed, where)


# --------------------------------------------------------------------------------------------- requests


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments, as OpenAI sends it.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    @model_validator(mode="after")
    def _tool_call_arguments(self) -> ChatMessage:
        for index, call in enumerate(self.tool_calls or ()):
            check_arguments(call.function.arguments, f"tool_calls[{index}].function.arguments")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: plain string content, tool calls as dicts."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    frequency_penalty: float | None = None  # 0 only (request_policy)
    logprobs: bool = False
    top_logprobs: int | None = None  # 0 only: the sampled token's logprob is returned (request_policy)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = None  # 0 only (request_policy)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "auto" only: the model decides (request_policy)
    user: str | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Lenient):
    model: str
    prompt: str | list[int] = Field(description="Text, or token ids (fed to the engine as they are).")
    logprobs: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    user: str | None = None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("prompt")
    @classmethod
    def _prompt_is_unicode(cls, prompt: str | list[int]) -> str | list[int]:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")  # the tokenizer raises TypeError on lone surrogates (a 500)
        return prompt


# -------------------------------------------------------------------------------------------- responses


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[Any] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _completion_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    policy_version: int = Field(description="(ajet extension) policy version that produced the answer.")


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: Literal["stop", "length"] | None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _completion_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ajet_hpc"
    policy_version: int = Field(description="(ajet extension) current policy version.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ----------------------------------------------------------------------------------------- episode API


class _EpisodeBody(BaseModel):
    """A body of the episode API: what it carries is stored, so every string must be valid Unicode and
    JSON no deeper than ``MAX_JSON_DEPTH``."""

    @model_validator(mode="after")
    def _storable(self) -> _EpisodeBody:
        for name in type(self).model_fields:
            check_json(getattr(self, name), name)
        return self


class BeginEpisodeRequest(_EpisodeBody):
    model_config = ConfigDict(extra="forbid")

    task_id: str | None = Field(default=None, description="Stable id of the task this episode runs.")
    group: str | None = Field(default=None, description="Client group that runs it.")
    repeat: int | None = Field(
        default=None,
        ge=0,
        description="Which run of the task this is. With task_id and group it makes the episode's key: the "
        "server trains one episode per key (a second end of a key answers with the first one's result).",
    )
    metadata: dict[str, Any] = Field(default_factory=dict, description="Free JSON kept with the episode.")


class BeginEpisodeResponse(BaseModel):
    episode_id: str
    base_url: str = Field(
        description="OpenAI base_url for the agent; chat calls there belong to the episode."
    )
    api_key: str = Field(description="Episode token: the agent's api_key, valid for this episode only.")
    model: str
    policy_version: int
    expires_at: float


class EndEpisodeRequest(_EpisodeBody):
    """Rewards must be finite (checked here) and within ``±serving.max_abs_reward`` (``beyond_limit``, which
    the route checks against the server's setting): a bad value is refused before anything is recorded."""

    model_config = ConfigDict(extra="forbid")

    reward: float
    task_id: str | None = None
    group: str | None = Field(default=None, description="When given, must be the group given at begin.")
    repeat: int | None = Field(
        default=None, ge=0, description="When given, must be the repeat given at begin."
    )
    turn_rewards: list[float] | None = Field(
        default=None, description="One reward per model call of the episode, in call order."
    )
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"reward is {value}: rewards must be finite numbers")
        return value

    @field_validator("turn_rewards")
    @classmethod
    def _finite_turn_rewards(cls, values: list[float] | None) -> list[float] | None:
        for index, value in enumerate(values or ()):
            if not math.isfinite(value):
                raise ValueError(f"turn_rewards[{index}] is {value}: rewards must be finite numbers")
        return values

    def beyond_limit(self, limit: float) -> tuple[str, str] | None:
        """The first reward whose magnitude exceeds ``limit`` (``serving.max_abs_reward``), as (field,
        message); None when every reward is within it."""
        named = [("reward", self.reward)] + [
            (f"turn_rewards[{i}]", r) for i, r in enumerate(self.turn_rewards or ())
        ]
        for name, value in named:
            if abs(value) > limit:
                return name, (
                    f"{name} is {value:g}, beyond this server's limit of ±{limit:g} "
                    "(serving.max_abs_reward); nothing was recorded and the episode is still open"
                )
        return None


class AbortEpisodeRequest(_EpisodeBody):
    model_config = ConfigDict(extra="forbid")

    reason: str = "aborted by client"


class EpisodeSummary(BaseModel):
    episode_id: str
    state: EpisodeState
    task_id: str | None
    group: str | None
    repeat: int | None = None
    reward: float | None
    turn_rewards: list[float] | None
    calls: int
    policy_versions: list[int]
    drift: int
    reason: str | None = None
    started_at: float
    ended_at: float | None
    duplicate: bool = Field(
        default=False,
        description="On an end: this answer is the result recorded earlier for the episode's key (a repeated "
        "end); the episode named here is the one that is trained.",
    )


class EndedEpisode(BaseModel):
    """An episode key this server has ended, with the result it recorded (``GET /v1/episodes/ended``)."""

    task_id: str
    repeat: int
    episode_id: str
    reward: float | None
    ended_at: float


class EndedEpisodes(BaseModel):
    group: str
    ended: list[EndedEpisode]


class EvalRound(BaseModel):
    """The answer to ``GET /v1/eval/round``: the round an eval array task has to run, if any."""

    group: str
    step: int | None = Field(description="The step whose policy the open round evaluates; None: none open.")
    finished: bool = Field(description="Training is over: no round will open; the eval task may stop.")


class EvalDoneRequest(_EpisodeBody):
    model_config = ConfigDict(extra="forbid")

    group: str = Field(description="The eval group.")
    index: int = Field(ge=0, description="The eval array task that ran its share of the round.")
    step: int = Field(ge=0, description="The round's step.")
    episodes: int = Field(ge=0, description="Episodes of its share that ended (run now, or before).")


class EvalDone(BaseModel):
    accepted: bool = Field(description="False when that round is not open (closed meanwhile): no change.")


class ServerStatus(BaseModel):
    server: str
    model: str
    engine: str
    state: str = Field(description="serving, training, trained, finished or failed (docs/reliability.md).")
    reason: str | None = Field(default=None, description="Why the server finished early or failed.")
    step: int = Field(default=0, description="The last trained step.")
    last_step_at: float | None = Field(default=None, description="When that step was recorded (Unix time).")
    policy_version: int
    episodes_open: int
    episodes_finished: int
    episodes_aborted: int
    episodes_dropped: int
    requests_in_flight: int
    requests_served: int
    dropped_recent: list[EpisodeSummary] = Field(description="Recently dropped episodes (their tasks rerun).")
