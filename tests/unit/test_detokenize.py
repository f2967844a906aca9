"""`ajet_hpc.algo.detokenize.TokenText`: its decode is the trainer's (``tokenizer.decode`` with special tokens
kept and no cleanup), and wherever it says the decode splits before a token, it does. Random ids of both
built-in tokenizers, weighted towards what breaks a naive split: byte tokens that continue a character,
special and added tokens, ids past the vocabulary."""

from __future__ import annotations

import random
from typing import Any

import pytest

from ajet_hpc.algo.detokenize import TokenText
from ajet_hpc.engine import tiny, tiny_qwen


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen"])
def tokenizer(request):
    return tiny.build_tokenizer() if request.param == "tiny" else tiny_qwen.build_tokenizer()


def trainer_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def random_ids(rng: random.Random, text: TokenText, size: int) -> list[int]:
    joins = text.joins or b""
    parts = [i for i in range(min(len(joins), 2000)) if not joins[i]] or [0]  # continuation bytes (Qwen)
    added = sorted(text.tokenizer.added_tokens_decoder)
    pools = [range(size), parts, added, range(256), range(size, size + 3)]
    return [rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 14))]


def test_decode_and_splits_are_the_trainers(tokenizer) -> None:
    text = TokenText(tokenizer)
    assert text.joins is not None and text._backend is not None  # the fast path is what these test
    size = len(tokenizer)
    rng = random.Random(0)
    splits = refused = 0
    for _ in range(3000):
        ids = random_ids(rng, text, size)
        whole = trainer_decode(tokenizer, ids)
        assert text(ids) == whole, ids
        for k in range(1, len(ids)):
            if text.joins_before(ids[k]):
                assert text(ids[:k]) + text(ids[k:]) == whole, (ids, k)
                splits += 1
            else:
                refused += 1
    assert splits > 5000
    if tokenizer.backend_tokenizer.decoder.__class__.__name__ == "ByteLevel":
        assert refused > 1000  # byte tokens that continue a character are never split before


def test_a_tokenizer_that_decodes_its_own_way_is_called_as_the_trainer_calls_it() -> None:
    fast_tokenizer: Any = type(tiny.build_tokenizer())  # the built-in tokenizer's class, whatever it is

    class Shouting(fast_tokenizer):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    base = tiny.build_tokenizer()
    shouting = Shouting(tokenizer_object=base.backend_tokenizer, clean_up_tokenization_spaces=True)
    text = TokenText(shouting)
    assert text.joins is None and not text.joins_before(5)  # nothing known: merging decodes whole calls
    ids = base("hello <|im_end|> x", add_special_tokens=False)["input_ids"]
    assert text(ids) == trainer_decode(shouting, ids) == trainer_decode(base, ids).upper()


def test_cleanup_set_on_the_tokenizer_does_not_change_the_trainers_decode() -> None:
    tokenizer = tiny.build_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("a , b . c 's", add_special_tokens=False)["input_ids"]
    assert TokenText(tokenizer)(ids) == trainer_decode(tokenizer, ids) == "a , b . c 's"
