"""Token-in, token-out: the prompt of each call reuses the exact tokens the model sampled earlier.

An agent sends back the model's earlier answers as assistant messages (text), and the chat template renders
them again. Tokenizing that text need not give the ids the model sampled (a tool-call tag sampled as
characters, a space merged differently...); training on the re-tokenized ids would train on tokens the model
never produced. ``ContextTracker.build_prompt`` therefore splices the recorded ids back in:

1. Render the conversation (``apply_chat_template``, generation prompt on) and find each message's place in
   the text (``layout.TemplateLayout``: prefix renderings, no hard-coded markers).
2. For each assistant message, look up the answer this tracker recorded whose reply message has the same
   content and tool calls (arguments compared as JSON); among several, prefer the one with the same
   conversation before it, else the latest. No match: an ``answer_not_found`` drift event.
3. Find the recorded answer's decoded text (``decode(response_ids)``, stop token included) inside that
   message's rendering, first where the answer would start: after the longest common prefix of the message's
   rendering and this call's generation prompt (the template's header of an assistant turn). If the answer
   ended on a special token the template writes differently (e.g. ``<|endoftext|>`` where the template closes
   with ``<|im_end|>``), the text without that token is looked for too, and only those ids are reused. Not
   found: a ``template_dropped_content`` drift event, and the template's tokens stay.
4. Tokenize the text between found answers piece by piece and put the recorded ids in the answers' places.
   Then tokenize the whole text once and compare: an answer whose text tokenizes otherwise gives
   ``retokenized_differently`` (the recorded ids are kept); a context piece whose ids differ, or a token of
   the whole text that straddles an answer's edge, gives ``context_retokenized``.

Authors come from the offsets mapping of the fast tokenizer: a context token belongs to the message whose
rendering holds its first character (see ``timeline`` for who is which author); spliced ids are ``MODEL``.
"""

from __future__ import annotations

import bisect
import copy
import json
import pickle
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy

from ajet_hpc.tracking.layout import Layout, TemplateLayout, chain_key, common_prefix_length
from ajet_hpc.tracking.timeline import (
    ANSWER_NOT_FOUND,
    CONTEXT_RETOKENIZED,
    HISTORY_KEPT,
    MODEL,
    RETOKENIZED_DIFFERENTLY,
    SYSTEM,
    TEMPLATE_DROPPED_CONTENT,
    TOOL,
    USER,
    DriftEvent,
    Timeline,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLE_AUTHORS = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "tool": TOOL, "function": TOOL}
ROLE_AUTHORS |= {"ipython": TOOL, "assistant": SYSTEM}  # assistant text that is not a recorded sample
"""Author of the context tokens of a message, by role; other roles count as USER."""


def owned_copy(value: Any) -> Any:
    """A deep copy of ``value`` (a request's messages or tools: parsed JSON), through a pickle round trip:
    the same result as ``copy.deepcopy`` for plain data (shared parts stay shared) at a fifth of its cost
    (75 against 16 us for a 10-message conversation; every chat call copies its messages). A value that
    does not pickle is deep-copied."""
    try:
        return pickle.loads(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
    except Exception:
        return copy.deepcopy(value)


@dataclass
class PromptPlan:
    """The prompt of one call, ready for the engine; ``ContextTracker.record`` turns it into a Timeline."""

    prompt_ids: list[int]
    token_authors: list[int]
    reused_spans: list[tuple[int, int]]  # prompt positions [start, end) holding recorded answers
    drift: list[DriftEvent]
    text: str  # the rendered conversation the ids stand for
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    history_key: str  # identifies the conversation so far (for matching the reply in later calls)
    created_at: float


@dataclass(frozen=True)
class _Answer:
    history_key: str
    variants: tuple[tuple[tuple[int, ...], str], ...]  # (ids, decoded text): full, then without stop token


@dataclass(frozen=True)
class _Span:
    start: int  # characters of the rendered text
    end: int
    ids: tuple[int, ...]
    message_index: int
    kept: bool = False  # keep_history: the recorded answer replaces a different rendering of it


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return json.dumps(content, sort_keys=True)


def _arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _tool_calls(message: dict[str, Any]) -> list[list[str]]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        calls.append([str(function.get("name", "")), _arguments(function.get("arguments", ""))])
    return calls


def answer_key(message: dict[str, Any]) -> str:
    """What identifies a reply the agent sends back: content and tool calls (names, JSON arguments)."""
    return json.dumps([_content_text(message.get("content")), _tool_calls(message)], ensure_ascii=False)


def _turn_key(message: dict[str, Any]) -> str:
    return json.dumps([message.get("role"), answer_key(message), message.get("name")], ensure_ascii=False)


class ContextTracker:
    """The timelines of one episode and the answers its later prompts reuse. Thread-safe."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, keep_history: bool = False) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("ContextTracker needs a fast tokenizer (it uses the offsets mapping)")
        self.tokenizer = tokenizer
        self._layout = TemplateLayout(tokenizer)
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self._backend = _direct_backend(tokenizer)
        self.keep_history = keep_history
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        specials = {token.content for token in added.values() if getattr(token, "special", False)}
        self._special_texts = sorted(specials | set(tokenizer.all_special_tokens), key=len, reverse=True)
        self._answers: dict[str, list[_Answer]] = {}
        self._timelines: list[Timeline] = []
        self._lock = threading.Lock()

    @property
    def timelines(self) -> list[Timeline]:
        with self._lock:
            return list(self._timelines)

    def drift_counts(self) -> dict[str, int]:
        """How many drift events of each kind the recorded timelines carry."""
        return dict(Counter(event.kind for timeline in self.timelines for event in timeline.drift))

    def build_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        template_kwargs: dict[str, Any] | None = None,
    ) -> PromptPlan:
        """The prompt ids for ``messages``, with the recorded ids of earlier answers spliced in."""
        created_at = time.time()
        owned = owned_copy(list(messages))  # the plan's own copy, shared by its timelines
        tools = owned_copy(tools)
        layout = self._layout.layout(owned, tools, dict(template_kwargs or {}))
        histories = [""]
        for message in owned:
            histories.append(chain_key(histories[-1], _turn_key(message)))
        drift = list(layout.drift)
        spans = self._find_answers(owned, layout, histories, drift)
        prompt_ids, authors, reused, pieces = self._splice(owned, layout, spans)
        if spans:
            drift.extend(self._verify(layout, spans, pieces))
        drift.sort(key=lambda event: event.message_index)
        return PromptPlan(
            prompt_ids=prompt_ids,
            token_authors=authors,
            reused_spans=reused,
            drift=drift,
            text=layout.text,
            messages=owned,
            tools=tools,
            history_key=histories[-1],
            created_at=created_at,
        )

    def record(
        self,
        plan: PromptPlan,
        response_ids: Sequence[int],
        response_logprobs: Sequence[float],
        reply_message: dict[str, Any],
        finish_reason: str,
        policy_version: int,
        *,
        started_at: float | None = None,
        finished_at: float | None = None,
        version_spans: Sequence[tuple[int, int, int]] = (),
    ) -> Timeline:
        """Add the call's timeline to the episode and remember its answer for the prompts that follow."""
        response = [int(token) for token in response_ids]
        timeline = Timeline(
            prompt_ids=list(plan.prompt_ids),
            response_ids=response,
            response_logprobs=[float(value) for value in response_logprobs],
            token_authors=list(plan.token_authors) + [MODEL] * len(response),
            loss_mask=[0] * len(plan.prompt_ids) + [1] * len(response),
            # the plan's messages and tools are its own copies (build_prompt), shared read-only by the
            # timelines of its answers: not copied again
            messages=[*plan.messages, owned_copy(reply_message)],
            tools=plan.tools,
            policy_version=policy_version,
            finish_reason=finish_reason,
            drift=list(plan.drift),
            reused_spans=list(plan.reused_spans),
            started_at=plan.created_at if started_at is None else started_at,
            finished_at=time.time() if finished_at is None else finished_at,
            version_spans=[(int(v), int(a), int(b)) for v, a, b in version_spans],
        )
        answer = _Answer(plan.history_key, self._variants(response))
        with self._lock:
            self._timelines.append(timeline)
            self._answers.setdefault(answer_key(reply_message), []).append(answer)
        return timeline

    def _decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not isinstance(text, str):  # a list only for a batch of sequences
            raise TypeError(f"decoding one sequence gave a {type(text).__name__}, not text")
        return text

    def _variants(self, ids: list[int]) -> tuple[tuple[tuple[int, ...], str], ...]:
        variants = [(tuple(ids), self._decode(ids))]
        if len(ids) > 1 and ids[-1] in self._special_ids:
            variants.append((tuple(ids[:-1]), self._decode(ids[:-1])))
        return tuple((ids, text) for ids, text in variants if text)

    def _find_answers(
        self, messages: list[dict[str, Any]], layout: Layout, histories: list[str], drift: list[DriftEvent]
    ) -> list[_Span]:
        spans = []
        header = layout.generation_prompt
        for index, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            with self._lock:
                candidates = list(self._answers.get(answer_key(message), ()))
            if not candidates:
                detail = "an assistant message the server did not produce (or an edited one); used as context"
                drift.append(DriftEvent(index, ANSWER_NOT_FOUND, detail))
                continue
            same_history = [answer for answer in candidates if answer.history_key == histories[index]]
            answer = (same_history or candidates)[-1]
            start, end = layout.bounds[index], layout.bounds[index + 1]
            expected = start + common_prefix_length(layout.text[start:end], header)
            span = None
            for variant, (ids, text) in enumerate(answer.variants):
                found = _locate(layout.text, text, expected, end)
                if found is not None:
                    span = _Span(found, found + len(text), ids, index)
                    if variant and self.keep_history:  # sampled another stop token than the template writes
                        span = self._with_own_stop(layout.text, span, answer.variants[0][0])
                        if span.kept:
                            detail = "the answer's own stop token replaces the template's closing marker"
                            drift.append(DriftEvent(index, HISTORY_KEPT, detail))
                    break
            if span is None and self.keep_history:
                span = self._kept_span(layout.text, answer, expected, index)
                if span is not None:
                    detail = "the template renders this answer otherwise; the recorded answer is used whole"
                    drift.append(DriftEvent(index, HISTORY_KEPT, detail))
            if span is None:
                if answer.variants:
                    detail = "the rendered message lacks the recorded answer's text; template tokens used"
                    drift.append(DriftEvent(index, TEMPLATE_DROPPED_CONTENT, detail))
                continue
            spans.append(span)
        return spans

    def _with_own_stop(self, text: str, span: _Span, full_ids: tuple[int, ...]) -> _Span:
        """keep_history, for an answer found without its stop token: when a special token (the template's
        closing marker) follows it in the text, the sampled stop token takes its place."""
        for special in self._special_texts:
            if text.startswith(special, span.end):
                return _Span(span.start, span.end + len(special), full_ids, span.message_index, kept=True)
        return span

    def _kept_span(self, text: str, answer: _Answer, expected: int, index: int) -> _Span | None:
        """keep_history: the part of the rendered message that the recorded answer replaces: from the end of
        the assistant header through the template's closing marker (the first special token after the
        header) when the answer ended with a stop token of its own, else up to that marker."""
        if not answer.variants:
            return None
        ids = answer.variants[0][0]
        found = [(text.find(special, expected), special) for special in self._special_texts]
        found = [(at, special) for at, special in found if at >= 0]
        if not found:
            return None
        at, marker = min(found)
        stopped = bool(ids) and ids[-1] in self._special_ids
        return _Span(expected, at + len(marker) if stopped else at, ids, index, kept=True)

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if not text:
            return [], []
        if self._backend is not None:  # the Rust tokenizer directly: same ids, ~40 % less CPU
            encoding = self._backend.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [tuple(offset) for offset in encoding["offset_mapping"]]

    def _splice(self, messages: list[dict[str, Any]], layout: Layout, spans: list[_Span]):
        starts = layout.bounds
        roles = [SYSTEM, *(ROLE_AUTHORS.get(str(m.get("role")), USER) for m in messages), SYSTEM]
        # segment i+1 starts at bounds[i]; segment 0 is the preamble, the last one the generation prompt
        segment_starts = [0, *starts]
        prompt_ids: list[int] = []
        authors: list[int] = []
        reused: list[tuple[int, int]] = []
        pieces: list[tuple[int, int, list[int]]] = []

        boundaries = numpy.asarray(segment_starts)
        role_of_segment = numpy.asarray(roles)

        def emit(low: int, high: int) -> None:
            ids, offsets = self._tokenize(layout.text[low:high])
            pieces.append((low, high, ids))
            prompt_ids.extend(ids)
            if ids:
                firsts = numpy.fromiter((first for first, _ in offsets), numpy.int64, len(offsets)) + low
                segment = numpy.searchsorted(boundaries, firsts, side="right") - 1
                authors.extend(role_of_segment[segment].tolist())

        position = 0
        for span in spans:
            emit(position, span.start)
            reused.append((len(prompt_ids), len(prompt_ids) + len(span.ids)))
            prompt_ids.extend(span.ids)
            authors.extend([MODEL] * len(span.ids))
            position = span.end
        emit(position, len(layout.text))
        return prompt_ids, authors, reused, pieces

    def _verify(
        self, layout: Layout, spans: list[_Span], pieces: list[tuple[int, int, list[int]]]
    ) -> list[DriftEvent]:
        """Compare the spliced prompt with tokenizing the whole rendered text."""
        ids, offsets = self._tokenize(layout.text)
        starts = [start for start, _ in offsets]

        def whole(low: int, high: int) -> list[int]:
            return ids[bisect.bisect_left(starts, low) : bisect.bisect_left(starts, high)]

        def clean_cut(position: int) -> bool:
            before = bisect.bisect_left(starts, position) - 1
            return before < 0 or offsets[before][1] <= position

        drift = []
        for span in spans:
            if span.kept:  # knowingly not the template's rendering (reported as history_kept)
                continue
            retokenized = whole(span.start, span.end)
            if list(span.ids) != retokenized or not (clean_cut(span.start) and clean_cut(span.end)):
                detail = (
                    f"sampled {len(span.ids)} tokens whose text re-tokenizes to {len(retokenized)} "
                    "other tokens; the sampled ids are used"
                )
                drift.append(DriftEvent(span.message_index, RETOKENIZED_DIFFERENTLY, detail))
        for low, high, piece_ids in pieces:
            if low < high and (piece_ids != whole(low, high) or not (clean_cut(low) and clean_cut(high))):
                detail = (
                    f"context at characters {low}..{high} tokenizes otherwise next to a spliced answer; "
                    "the piece's own tokens are used"
                )
                drift.append(DriftEvent(layout.message_at(low), CONTEXT_RETOKENIZED, detail))
        return drift


_BACKEND_PROBE = "Hi <|im_start|>user\n  a  b\t\u00e9\u4e2d <|im_end|>\n1+2=3."
_backend_ok: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _direct_backend(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The tokenizer's Rust backend when it gives exactly the wrapper's ids and offsets, else None.

    Checked once per tokenizer object on a probe text with special tokens, spaces and non-ASCII.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    key = tokenizer
    if key not in _backend_ok:
        wrapped = tokenizer(_BACKEND_PROBE, add_special_tokens=False, return_offsets_mapping=True)
        direct = backend.encode(_BACKEND_PROBE, add_special_tokens=False)
        _backend_ok[key] = list(wrapped["input_ids"]) == direct.ids and [
            tuple(offset) for offset in wrapped["offset_mapping"]
        ] == list(direct.offsets)
    return backend if _backend_ok[key] else None


def _locate(text: str, answer: str, expected: int, end: int) -> int | None:
    """Where ``answer`` lies in ``text[expected:end]``: at ``expected`` if it is there, else its first
    occurrence after it. Never before ``expected``: the model sampled the answer after the assistant's
    header, and an answer made of special tokens (``<|im_start|><|im_end|>``, whose text without the stop
    token is the header's own first marker) would otherwise be "found" in the header."""
    if text.startswith(answer, expected) and expected + len(answer) <= end:
        return expected
    found = text.find(answer, expected, end)
    return found if found >= 0 else None
