"""A tiny environment written for ``verifiers`` (v1 API): reverse a word. Its tasks are built in code and its
reward is its own ``@vf.reward`` method, so nothing is downloaded. Used by ``configs/verifiers.yaml``
through the adapter ``ajet_hpc.environments.verifiers.adapter``, which loads it by its verifiers taskset id
(this module).
"""

from __future__ import annotations

from collections.abc import Iterator
from difflib import SequenceMatcher

import verifiers.v1 as vf

WORDS = (
    "cat", "dog", "sun", "map", "pen", "cup", "box", "hat", "red", "top",
    "bird", "fish", "tree", "lamp", "door", "moon", "star", "rain", "snow", "milk",
    "apple", "house", "water", "light", "stone", "river", "cloud", "green", "bread", "chair",
)  # fmt: skip
PROMPT = "Write the word {word!r} backwards. Reply with the reversed word only."


def similarity(reply: str, word: str) -> float:
    """How close ``reply`` is to ``word`` reversed, in [0, 1] (1: exactly it): partial credit, so that a
    small model's near misses still rank above its unrelated replies."""
    return SequenceMatcher(None, reply.strip().strip(".'\"").lower(), word[::-1]).ratio()


class ReverseData(vf.TaskData):
    word: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def reversed_word(self, trace: vf.Trace) -> float:
        return similarity(trace.last_reply, self.data.word)


class ReverseConfig(vf.TasksetConfig):
    repeat: int = 1
    """How many passes over ``WORDS`` ``load()`` yields."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> Iterator[ReverseTask]:
        for n in range(self.config.repeat * len(WORDS)):
            word = WORDS[n % len(WORDS)]
            data = ReverseData(id=f"reverse-{n}", prompt=PROMPT.format(word=word), word=word)
            yield ReverseTask(data, self.config.task)


__all__ = ["ReverseTaskset"]
