"""Token ids to text for text-level merging: the trainer's decode, faster, and where a decode may be split.

Text-level merging (``algo/merge.py``) asks whether one call's text is a prefix of a longer call's text and
where it ends there. Decoding both calls whole costs most of a step's merging at real lengths (0.7M tokens
per task group of 8 episodes at 50 calls). `TokenText` gives two things:

- ``decode(ids)``: exactly ``tokenizer.decode(ids, skip_special_tokens=False,
  clean_up_tokenization_spaces=False)``. When the tokenizer is a transformers fast tokenizer whose
  ``decode`` and ``_decode`` are transformers' own, that call is the backend's
  ``decode(ids, skip_special_tokens=False)`` and nothing else: the backend is called directly, without
  transformers' per-token input conversion (half of the time). Any other tokenizer goes through its
  ``decode``.
- ``joins_before(token)``: True only if ``decode(a + b) == decode(a) + decode(b)`` for every ``a`` and every
  ``b`` that starts with ``token``. Merging then compares only the tokens after two calls' common token
  prefix. It is known for two decoders, read from the backend's own description (``tokenizer.json``):

  - ``Fuse`` (characters or words joined as they are): every token.
  - ``ByteLevel`` (GPT-2, Qwen, Llama 3): the text is the tokens' bytes, joined, read as UTF-8 with a
    replacement character for each maximal invalid sequence (added tokens as their content). A token whose
    first byte is not a UTF-8 continuation byte (0x80-0xBF) starts a character or is invalid on its own
    whatever came before, so the bytes before it read the same alone: it joins. A token that continues a
    character (a byte token of a split emoji) does not.

  Any other decoder (SentencePiece's metaspace, WordPiece's ``##``, byte fallback, sequences of decoders)
  and any tokenizer that is not a transformers fast tokenizer: no token joins (``joins`` is None), and
  merging decodes whole calls as before.

``tests/unit/test_detokenize.py`` checks both claims on random ids of the built-in tokenizers (special and
added tokens, characters split over byte tokens).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

_CONTINUATION = range(0x80, 0xC0)


class TokenText:
    """``tokenizer``'s decode (special tokens kept, no cleanup) and the tokens before which it splits."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = _plain_backend(tokenizer)

    @functools.cached_property
    def joins(self) -> bytes | None:
        """Per token id, 1 where the decode splits before it (`joins_before`); None: nowhere known. Read
        from the vocabulary on first use (0.8 s for Qwen's 151k tokens; token-level merging never asks)."""
        return _joins(self._backend) if self._backend is not None else None

    def __call__(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def joins_before(self, token: int) -> bool:
        joins = self.joins
        return joins is not None and 0 <= token < len(joins) and joins[token] == 1


def _plain_backend(tokenizer: Any) -> Any:
    """The backend tokenizer whose ``decode`` is the tokenizer's, or None: a transformers fast tokenizer
    that overrides neither ``decode`` nor ``_decode`` (``_decode`` then calls the backend and cleans up
    spaces only when asked)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    if kind.decode is not PreTrainedTokenizerBase.decode or kind._decode is not TokenizersBackend._decode:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if backend is not None and backend.decode([]) == "" else None


def _joins(backend: Any) -> bytes | None:
    """Per token id (added tokens included), 1 where the backend's decode splits before the token."""
    decoder = (json.loads(backend.to_str()).get("decoder") or {}).get("type")
    size = backend.get_vocab_size(with_added_tokens=True)
    if decoder == "Fuse":
        return b"\x01" * size
    if decoder != "ByteLevel":
        return None
    byte_of = {char: byte for byte, char in _byte_characters().items()}
    added = {index: token.content for index, token in backend.get_added_tokens_decoder().items()}
    joins = bytearray(size)
    for index in range(size):
        if index in added:  # its content, as it is (or, in older backends, through the byte map)
            content = added[index]
            joins[index] = bool(content) and content[0] < "\x80"
            continue
        token = backend.id_to_token(index)
        if not token:
            continue
        mapped = all(char in byte_of for char in token)  # else the decoder reads the token's UTF-8 bytes
        first = byte_of[token[0]] if mapped else token.encode()[0]
        joins[index] = first not in _CONTINUATION
    return bytes(joins)


def _byte_characters() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in the vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars
