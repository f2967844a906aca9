"""How a server commits closed episodes to its store (``StoreConfig``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ajet_hpc.config.fields import MODEL_CONFIG


class StoreConfig(BaseModel):
    """How the server commits closed episodes to its store (``RUN/data/<model>.h5``, docs/storage.md)."""

    model_config = MODEL_CONFIG

    commit_interval_ms: float = Field(
        default=5.0,
        ge=0,
        le=10_000,
        allow_inf_nan=False,
        description="Longest a commit group waits for more episodes after its first one, while more keep "
        "arriving (a lone episode is committed at once); episodes of one group share one fsync. 0: never "
        "wait, group only what is already queued.",
    )
    commit_max_episodes: int = Field(
        default=64,
        ge=1,
        le=65_536,
        description="Most records (episodes, training steps) committed as one group.",
    )
