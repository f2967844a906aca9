"""One episode as text: each model call's new messages, its tokens by author and loss mask, rewards, drift.

Everything the run recorded (model text, messages, task ids, reasons) is printed with control characters
escaped (``views.printable``): the ESC of a terminal escape sequence shows as ``\\x1b``.

Tokens are shown in spans of one author and one loss mask. Without colour each span is tagged
``[author]…[/author]``; the model's tokens are expected to be trained (mask 1) and everybody else's not, so
only the exceptions carry the mask: ``[model mask=0]`` (a sampled answer reused as context) or
``[user mask=1]``. With colour (a terminal) the author is the colour and the tags are dropped.

A call whose prompt extends the previous call (prompt + response) token for token shows only its new
tokens and messages, so a conversation reads once from top to bottom; ``full=True`` shows everything.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ajet_hpc.offline.run import InspectError
from ajet_hpc.offline.views import fmt, fmt_time, fmt_versions, printable, table
from ajet_hpc.storage.records import EpisodeRecord
from ajet_hpc.tracking.timeline import AUTHOR_NAMES, MODEL, Timeline

RESET = "\033[0m"
COLORS = {0: "\033[2m", 1: "\033[36m", 2: "\033[33m", MODEL: "\033[1;32m"}
REUSED_COLOR = "\033[4;32m"  # model tokens with mask 0: sampled earlier, context now
ANOMALY_COLOR = "\033[41m"  # a non-model token with mask 1 (never expected)


@dataclass(frozen=True)
class ShowOptions:
    tokens: bool = False  # a table of every token shown
    turn: int | None = None  # only this call (1-based)
    full: bool = False  # whole prompts and all messages, not only what is new since the previous call
    color: bool = False  # ANSI colours instead of tags


class Decoder:
    """Token ids to text with the model's tokenizer, or the ids themselves without one."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def text(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids) + " "
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return repr(self.tokenizer.decode([token_id], skip_special_tokens=False))


def show_text(model: str, record: EpisodeRecord, tokenizer: Any | None, options: ShowOptions) -> str:
    timelines = record.timelines
    turns = range(len(timelines))
    if options.turn is not None:
        if not 1 <= options.turn <= len(timelines):
            raise InspectError(
                f"--turn {options.turn}: episode {record.episode_id} has {len(timelines)} calls"
            )
        turns = range(options.turn - 1, options.turn)
    decoder = Decoder(tokenizer)
    blocks = [_header(model, record, tokenizer is not None, options)]
    for index in turns:
        previous = timelines[index - 1] if index > 0 and not options.full else None
        blocks.append(_turn(record, index, previous, decoder, options))
    if not timelines:
        blocks.append("(no model calls recorded)")
    return "\n\n".join(blocks)


def _header(model: str, record: EpisodeRecord, decoded: bool, options: ShowOptions) -> str:
    timelines = record.timelines
    duration = (record.ended_at - record.started_at) if record.ended_at and record.started_at else None
    versions = fmt_versions([t.policy_version for t in timelines])
    lines = [
        f"episode {fmt(record.episode_id)}  (model {fmt(model)})",
        f"  task {fmt(record.task_id)}  group {fmt(record.group)}  state {fmt(record.state)}  "
        f"reward {fmt(record.reward)}" + (f"  reason: {printable(record.reason)}" if record.reason else ""),
        f"  started {fmt_time(record.started_at)}  ended {fmt_time(record.ended_at)}"
        + (f"  ({duration:.2f} s)" if duration is not None else "")
        + f"  calls {len(timelines)}  policy versions {versions}",
    ]
    if record.turn_rewards is not None:
        lines.append("  turn rewards " + " ".join(fmt(r) for r in record.turn_rewards))
    if record.metadata:
        lines.append(f"  metadata {printable(json.dumps(record.metadata, sort_keys=True, default=str))}")
    if options.color:
        legend = " ".join(f"{COLORS[a]}{name}{RESET}" for a, name in AUTHOR_NAMES.items())
        lines.append(f"  tokens: {legend}  {REUSED_COLOR}model, mask 0{RESET}")
    else:
        lines.append("  tokens: [author]...[/author]; model tokens are trained (mask 1) unless tagged mask=0")
    if not decoded:
        lines.append("  (no tokenizer: tokens shown as ids)")
    return "\n".join(lines)


def _turn(
    record: EpisodeRecord, index: int, previous: Timeline | None, decoder: Decoder, options: ShowOptions
) -> str:
    timeline = record.timelines[index]
    start, messages_from = _new_part(timeline, previous)
    lines = [_turn_title(record, index, timeline, previous)]
    request, reply = timeline.messages[:-1], timeline.messages[-1:]
    if messages_from:
        lines.append(f"  ({messages_from} earlier messages, {start} earlier tokens: see turn {index})")
    lines += [_message(m) for m in request[messages_from:]]
    lines += [_message(m, reply=True) for m in reply]
    lines.append("tokens:")
    lines.append(_spans(timeline, start, decoder, options.color))
    trained = sum(timeline.loss_mask)
    lines.append(f"loss-masked tokens: {trained} of {len(timeline.token_ids)} (mask 1 = trained)")
    for event in timeline.drift:
        detail = printable(str(event.detail))
        lines.append(f"drift: message {event.message_index} {fmt(event.kind)}: {detail}")
    if options.tokens:
        lines.append(_token_table(timeline, start, decoder))
    return "\n".join(lines)


def _new_part(timeline: Timeline, previous: Timeline | None) -> tuple[int, int]:
    """Where the new tokens and request messages of this call start; (0, 0) if it does not extend it."""
    if previous is None:
        return 0, 0
    before = previous.token_ids
    if timeline.prompt_ids[: len(before)] != before:
        return 0, 0
    request = timeline.messages[:-1]
    shared = len(previous.messages)
    return len(before), shared if request[:shared] == previous.messages else 0


def _turn_title(record: EpisodeRecord, index: int, timeline: Timeline, previous: Timeline | None) -> str:
    parts = [f"v{timeline.policy_version}", f"finish {fmt(timeline.finish_reason)}"]
    if timeline.finished_at and timeline.started_at:
        parts.append(f"{timeline.finished_at - timeline.started_at:.2f} s")
    prior = record.timelines[index - 1] if index > 0 else None
    if prior is not None and prior.finished_at and timeline.started_at:
        parts.append(f"+{timeline.started_at - prior.finished_at:.2f} s after turn {index}")
    parts.append(f"{len(timeline.prompt_ids)} prompt + {len(timeline.response_ids)} response tokens")
    if record.turn_rewards is not None and index < len(record.turn_rewards):
        parts.append(f"turn reward {fmt(record.turn_rewards[index])}")
    if previous is not None and _new_part(timeline, previous) == (0, 0):
        parts.append("does not extend the previous call")
    return f"── turn {index + 1}/{len(record.timelines)} ── " + " · ".join(parts)


def _message(message: dict[str, Any], reply: bool = False) -> str:
    role = message.get("role", "assistant")
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    text = content or ""
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        text += f"\n-> {function.get('name')}({function.get('arguments')})"
    if message.get("tool_call_id"):
        role = f"{role} [{message['tool_call_id']}]"
    label = f"{'reply ' if reply else ''}{fmt(role)}:"
    body = printable(str(text)).strip("\n").replace("\n", "\n" + " " * 4)
    return f"  {label} {body}" if "\n" not in body else f"  {label}\n    {body}"


def _spans(timeline: Timeline, start: int, decoder: Decoder, color: bool) -> str:
    ids, authors, mask = timeline.token_ids, timeline.token_authors, timeline.loss_mask
    out = []
    position = start
    while position < len(ids):
        end = position
        key = (authors[position], mask[position])
        while end < len(ids) and (authors[end], mask[end]) == key:
            end += 1
        out.append(_span(key[0], key[1], printable(decoder.text(ids[position:end])), color))
        position = end
    return "".join(out)


def _span(author: int, mask: int, text: str, color: bool) -> str:
    expected = 1 if author == MODEL else 0
    if color:
        code = COLORS.get(author, "")
        if mask != expected:
            code = REUSED_COLOR if author == MODEL else ANOMALY_COLOR
        return f"{code}{text}{RESET}"
    name = AUTHOR_NAMES.get(author, str(author))
    tag = name if mask == expected else f"{name} mask={mask}"
    return f"[{tag}]{text}[/{name}]"


def _token_table(timeline: Timeline, start: int, decoder: Decoder) -> str:
    n_prompt = len(timeline.prompt_ids)
    rows = []
    for position in range(start, len(timeline.token_ids)):
        token_id = timeline.token_ids[position]
        logprob = timeline.response_logprobs[position - n_prompt] if position >= n_prompt else None
        author = timeline.token_authors[position]
        rows.append(
            [
                position,
                token_id,
                decoder.token(token_id),
                AUTHOR_NAMES.get(author, str(author)),
                timeline.loss_mask[position],
                logprob,
            ]
        )
    headers = ("pos", "id", "text", "author", "mask", "logprob")
    return table(headers, rows, right=("pos", "id", "mask", "logprob"))
