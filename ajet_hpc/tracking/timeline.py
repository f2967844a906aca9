"""A timeline: one model call as token ids, who wrote each token, and what the model sampled.

Authors are small ints, one per token:

- ``MODEL`` — a token the model sampled, exactly as recorded: this call's response, and earlier answers of the
  episode spliced back into the prompt (``reused_spans``). Only these may ever carry loss.
- ``USER`` / ``TOOL`` — the rendering of a user / tool message, its template markers included.
- ``SYSTEM`` — the rendering of a system message, and every other piece of context no party of the
  conversation wrote: the template's preamble (tool list, default system prompt, BOS), the scaffolding of
  assistant turns (role header, closing marker, separators), the generation prompt that opens this call's
  answer, and assistant-role text the model did not sample as recorded (edited or foreign answers).

So ``author == MODEL`` means "sampled by the model", and the assistant scaffolding is context, never trained.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SYSTEM, USER, TOOL, MODEL = 0, 1, 2, 3
AUTHOR_NAMES = {SYSTEM: "system", USER: "user", TOOL: "tool", MODEL: "model"}

# Kinds of DriftEvent.
RETOKENIZED_DIFFERENTLY = "retokenized_differently"
"""A recorded answer was found in the rendered prompt, but tokenizing that text gives other ids than the
model sampled; the recorded ids are used."""
ANSWER_NOT_FOUND = "answer_not_found"
"""An assistant message the server never produced (written or edited by the agent); the template's tokens
are used, as context."""
TEMPLATE_DROPPED_CONTENT = "template_dropped_content"
"""An assistant message matches a recorded answer, but the chat template renders it without the answer's
sampled text (reasoning stripped, arguments re-serialized...); the template's tokens are used, as context."""
CONTEXT_RETOKENIZED = "context_retokenized"
"""Tokenizing the context between spliced answers piece by piece gives other ids than tokenizing the whole
rendered text (a token merges across an answer's edge); the pieces' ids are used."""
HISTORY_KEPT = "history_kept"
"""``keep_history`` is on and the chat template renders an earlier answer otherwise than it was sampled: the
recorded answer's ids replace that rendering whole (not a fault; reported so the difference is visible)."""
TEMPLATE_NOT_INCREMENTAL = "template_not_incremental"
"""Rendering the first k messages is not a prefix of rendering them all; authors near that message are
approximate."""


@dataclass(frozen=True)
class DriftEvent:
    """Where the prompt differs from what a plain re-rendering would give, or could not be checked.

    ``message_index`` points into the request's messages; ``len(messages)`` means the generation prompt.
    """

    message_index: int
    kind: str
    detail: str


@dataclass
class Timeline:
    """One model call: the prompt exactly as fed to the engine and the response exactly as sampled."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    token_authors: list[int]  # one per token of prompt + response
    loss_mask: list[int]  # one per token of prompt + response; 1 only on this call's response
    messages: list[dict[str, Any]]  # the request's messages, then the reply message returned to the agent
    tools: list[dict[str, Any]] | None
    policy_version: int
    finish_reason: str
    drift: list[DriftEvent] = field(default_factory=list)
    reused_spans: list[tuple[int, int]] = field(default_factory=list)  # prompt positions [start, end)
    started_at: float = 0.0
    finished_at: float = 0.0
    # (policy version, start, end) over the response's tokens where the weights were swapped while the call
    # ran, so that more than one version sampled them (``policy_version`` is the first); empty otherwise
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        total = len(self.prompt_ids) + len(self.response_ids)
        if len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"{len(self.response_logprobs)} logprobs for {len(self.response_ids)} response tokens"
            )
        for name in ("token_authors", "loss_mask"):
            if len(getattr(self, name)) != total:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {total} tokens")

    @property
    def token_ids(self) -> list[int]:
        """Prompt then response."""
        return self.prompt_ids + self.response_ids

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (lists, str, numbers, None)."""
        data = asdict(self)
        data["reused_spans"] = [list(span) for span in self.reused_spans]
        data["version_spans"] = [list(span) for span in self.version_spans]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        fields = dict(data)
        fields["drift"] = [DriftEvent(**event) for event in data.get("drift", [])]
        fields["reused_spans"] = [(int(start), int(end)) for start, end in data.get("reused_spans", [])]
        fields["version_spans"] = [tuple(int(x) for x in span) for span in data.get("version_spans", [])]
        return cls(**fields)
