"""A trainer's settings with what its algorithm and its server fill in where the topology leaves them unset.

``trainer.token_sum_norm`` and ``trainer.overlong.max_tokens`` default to the server's
``serving.max_tokens`` (the generation budget); ``clip_eps`` / ``clip_eps_high`` default to the algorithm's
own range where it has one (GSPO's, ``ajet_hpc.algo.gspo``). A field the topology sets is kept as it is.
"""

from __future__ import annotations

from ajet_hpc.config import TrainerConfig
from ajet_hpc.config.algorithms import algorithm
from ajet_hpc.config.topology import ServingConfig


def resolve(trainer: TrainerConfig, serving: ServingConfig) -> TrainerConfig:
    """``trainer`` with the defaults of its algorithm and of ``serving`` filled in (see the module doc)."""
    update: dict[str, object] = {}
    spec = algorithm(trainer.algorithm)
    if spec.clip is not None:
        low, high = spec.clip
        if "clip_eps" not in trainer.model_fields_set:
            update["clip_eps"] = low
        if "clip_eps_high" not in trainer.model_fields_set:
            update["clip_eps_high"] = high
    if trainer.token_sum_norm is None:
        update["token_sum_norm"] = serving.max_tokens
    if trainer.overlong is not None and trainer.overlong.max_tokens is None:
        update["overlong"] = trainer.overlong.model_copy(update={"max_tokens": serving.max_tokens})
    return trainer.model_copy(update=update) if update else trainer
