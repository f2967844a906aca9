"""Where each message of a conversation lies in the text its chat template renders.

Generic over templates: nothing here knows a marker. Message boundaries come from rendering prefixes of
the conversation — the end of ``render(messages[:k])`` is where message ``k`` starts — and the generation
prompt is what ``add_generation_prompt=True`` appends. The template's preamble (tool list, default system
prompt, BOS) is told apart from the first message by rendering that message once and twice: the second copy
is the message without the preamble.

Limits: a template whose prefix renderings are not prefixes of the full rendering (one that rewrites earlier
turns depending on later ones, e.g. stripping reasoning before the last user turn) gets approximate
boundaries there — the common prefix — and a ``template_not_incremental`` drift event. Renderings of
prefixes are cached per tracker, keyed by the exact messages, so a call re-renders only its new turns.

Cost: rendering every prefix of an n-message conversation renders O(n²) messages (800 short messages took
8 s). So boundaries are first found from windows of two messages: what rendering ``[m[k-1], m[k]]`` adds to
rendering ``[m[k-1]]`` past their common prefix is message k's piece, and the pieces must follow each other
in the full text and end exactly where the rendering of the whole conversation (no generation prompt) ends.
A template that merges turns takes back the end of the previous piece (Qwen2.5 puts consecutive tool
results in one turn: the next result replaces the ``<|im_end|>`` of the one before); the previous piece is
then checked without that end, and the message gets the same drift event as its prefix rendering would.
For the usual templates (each turn rendered from itself and its predecessor) this gives the prefix
boundaries with O(n) messages rendered; when any piece does not fit, the prefix renderings above are used.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ajet_hpc.tracking.timeline import TEMPLATE_NOT_INCREMENTAL, DriftEvent

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_LIMIT = 4096
_UNSEEN = object()


@dataclass(frozen=True)
class Layout:
    """A conversation rendered with its generation prompt, and where each message lies in that text."""

    text: str
    bounds: list[int]  # bounds[i]: start of message i; bounds[-1]: start of the generation prompt
    drift: list[DriftEvent]

    @property
    def generation_prompt(self) -> str:
        return self.text[self.bounds[-1] :]

    def message_at(self, position: int) -> int:
        """Index of the message whose rendering holds ``position``; ``len(messages)`` for the generation
        prompt, 0 for the preamble."""
        index = bisect.bisect_right(self.bounds, position) - 1
        return min(max(index, 0), len(self.bounds) - 1)


def exact_key(value: Any) -> str:
    """A string equal for equal JSON values (what the template sees)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def chain_key(previous: str, item: str) -> str:
    """A short digest of ``previous`` followed by ``item`` (keys of conversation prefixes)."""
    return hashlib.blake2b(f"{previous}\x00{item}".encode(), digest_size=16).hexdigest()


def common_prefix_length(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True)
class _Piece:
    """What rendering a message after its predecessor adds: ``length`` characters hashing to ``digest``,
    after taking back the last ``cut`` characters (``tail``) of the predecessor's rendering alone (0 and ""
    for templates that render each turn from itself; Qwen2.5 takes back ``<|im_end|>`` to put consecutive
    tool results in one turn)."""

    length: int
    digest: int
    cut: int
    tail: str


def _fits(text: str, start: int, piece: tuple[int, int], cut: int, tail: str) -> bool:
    """Whether a rendering piece of (length, hash) ``piece`` lies at ``text[start:]``, but for its last
    ``cut`` characters, ``tail``, which the next message's rendering takes back."""
    length, digest = piece
    kept = length - cut
    if kept < 0 or start + kept > len(text):
        return False
    return hash(text[start : start + kept] + tail) == digest


def _not_incremental(index: int) -> DriftEvent:
    return DriftEvent(
        index,
        TEMPLATE_NOT_INCREMENTAL,
        f"rendering messages[:{index + 1}] is not a prefix of the full rendering; "
        "author boundaries near this message are approximate",
    )


class TemplateLayout:
    """Renders conversations with a tokenizer's chat template and finds message boundaries."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._prefix_cache: dict[str, tuple[int, int]] = {}  # key -> (length, hash) of a prefix rendering
        self._preamble_cache: dict[str, tuple[int, int]] = {}  # key -> (length, hash)
        self._window_cache: dict[str, _Piece | None] = {}  # two messages -> what the second adds

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        generation_prompt: bool,
    ) -> str:
        # transformers types the tools as dicts or functions, in an invariant list
        tool_list: list[dict[Any, Any] | Callable[..., Any]] | None = None if tools is None else [*tools]
        text = self.tokenizer.apply_chat_template(
            list(messages),
            tools=tool_list,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **template_kwargs,
        )
        if not isinstance(text, str):  # ids or an encoding only when tokenizing, which this call does not
            raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
        return text

    def layout(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> Layout:
        if not messages:
            raise ValueError("a conversation needs at least one message")
        text = self.render(messages, tools, template_kwargs, generation_prompt=True)
        context = exact_key([tools, template_kwargs])
        first = self._first_message_start(messages[0], tools, template_kwargs, context, text)
        items = [exact_key(message) for message in messages]
        keys = [context]
        for item in items:
            keys.append(chain_key(keys[-1], item))
        fast = self._window_bounds(messages, items, keys, tools, template_kwargs, text, first)
        if fast is not None:
            return Layout(text=text, bounds=fast[0], drift=fast[1])
        bounds = [first]
        drift: list[DriftEvent] = []
        for k in range(1, len(messages) + 1):
            end, exact = self._prefix_end(keys[k], messages[:k], tools, template_kwargs, text)
            if not exact or end < bounds[-1]:
                end = max(bounds[-1], end)
                drift.append(_not_incremental(k - 1))
            bounds.append(end)
        return Layout(text=text, bounds=bounds, drift=drift)

    def _window_bounds(self, messages, items, keys, tools, template_kwargs, text: str, first: int):
        """The prefix layout from two-message windows (module docstring): (bounds, drift), or None when a
        piece does not fit the full text (then the prefix renderings decide)."""
        pieces: list[_Piece] = []
        for k in range(1, len(messages)):
            pair_key = chain_key(keys[0], f"{items[k - 1]}\x00{items[k]}")
            piece = self._window_piece(pair_key, messages[k - 1], messages[k], tools, template_kwargs)
            if piece is None:
                return None
            pieces.append(piece)
        # what the next message's rendering takes back of each one's (a template that merges them)
        cuts = [(p.cut, p.tail) for p in pieces] + [(0, "")]
        alone = self._rendering(keys[1], messages[:1], tools, template_kwargs)
        if alone is None or not _fits(text, 0, alone, *cuts[0]):
            return None
        end = alone[0] - cuts[0][0]
        if end < first:
            return None
        bounds = [first, end]
        for k, piece in enumerate(pieces, start=1):
            if not _fits(text, end, (piece.length, piece.digest), *cuts[k]):
                return None
            end += piece.length - cuts[k][0]
            bounds.append(end)
        if len(messages) > 1:  # the pieces must end where the whole conversation's rendering ends
            whole, exact = self._prefix_end(keys[-1], messages, tools, template_kwargs, text)
            if not exact or whole != end:
                return None
        drift = [_not_incremental(k) for k, (cut, _) in enumerate(cuts) if cut]
        return bounds, drift

    def _window_piece(self, cache_key: str, previous, message, tools, template_kwargs) -> _Piece | None:
        """What rendering ``[previous, message]`` adds to rendering ``previous`` alone, past their common
        prefix, or None when the pair renders nothing more. Cached per tracker."""
        cached = self._window_cache.get(cache_key, _UNSEEN)  # one lookup: another thread may clear it
        if cached is not _UNSEEN:
            return cached  # type: ignore[return-value]
        alone = self._render_or_empty([previous], tools, template_kwargs)
        pair = self._render_or_empty([previous, message], tools, template_kwargs)
        piece = None
        shared = common_prefix_length(alone, pair)
        if alone and len(pair) > shared:
            added = pair[shared:]
            piece = _Piece(len(added), hash(added), len(alone) - shared, alone[shared:])
        if len(self._window_cache) >= CACHE_LIMIT:
            self._window_cache.clear()
        self._window_cache[cache_key] = piece
        return piece

    def _rendering(self, key, messages, tools, template_kwargs) -> tuple[int, int] | None:
        """(length, hash) of the rendering of ``messages`` (no generation prompt), cached; None when the
        template refuses them."""
        cached = self._prefix_cache.get(key)
        if cached is not None:
            return cached
        rendered = self._render_or_empty(messages, tools, template_kwargs)
        if not rendered:
            return None
        if len(self._prefix_cache) >= CACHE_LIMIT:
            self._prefix_cache.clear()
        self._prefix_cache[key] = (len(rendered), hash(rendered))
        return self._prefix_cache[key]

    def _render_or_empty(self, messages, tools, template_kwargs) -> str:
        try:
            return self.render(messages, tools, template_kwargs, generation_prompt=False)
        except Exception:  # a template may refuse a prefix (roles must alternate...)
            return ""

    def _prefix_end(self, key, messages, tools, template_kwargs, text: str) -> tuple[int, bool]:
        """Where the rendering of ``messages`` (no generation prompt) ends in ``text``, and whether it is
        exactly a prefix of ``text`` (else: the length of their common prefix). A cached length that no longer
        fits (a template that renders today's date...) is rendered again."""
        cached = self._prefix_cache.get(key)
        if cached is not None and hash(text[: cached[0]]) == cached[1]:
            return cached[0], True
        rendered = self._render_or_empty(messages, tools, template_kwargs)
        if rendered:
            if len(self._prefix_cache) >= CACHE_LIMIT:
                self._prefix_cache.clear()
            self._prefix_cache[key] = (len(rendered), hash(rendered))
        if rendered and text.startswith(rendered):
            return len(rendered), True
        return common_prefix_length(rendered, text), False

    def _first_message_start(self, first, tools, template_kwargs, context: str, text: str) -> int:
        """End of the template's preamble: rendering the first message twice shows the message alone."""
        key = chain_key(context, exact_key(first))
        cached = self._preamble_cache.get(key)
        if cached is None:
            start = 0
            once = self._render_or_empty([first], tools, template_kwargs)
            twice = self._render_or_empty([first, first], tools, template_kwargs)
            alone = twice[len(once) :]
            if once and alone and twice.startswith(once) and once.endswith(alone):
                start = len(once) - len(alone)
            cached = (start, hash(once[:start]))
            if len(self._preamble_cache) >= CACHE_LIMIT:
                self._preamble_cache.clear()
            self._preamble_cache[key] = cached
        start, digest = cached
        return start if hash(text[:start]) == digest else 0
