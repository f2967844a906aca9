"""A model's trainer (``trainer:``): the algorithm's settings, off-policy correction, overlong shaping,
timeline merging, and the trainer's own resources and schedule.

``TrainerConfig.spec`` is the algorithm (``config.algorithms``); ``TrainerConfig.resolved(serving)`` the
settings with what the algorithm and the server's ``serving`` fill in where the topology leaves them unset,
which is what the trainer runs with (``ajet_hpc.trainer.coordinator.host.TrainerSetup.trainer``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from ajet_hpc.config.algorithms import Algorithm, AlgorithmName, LossAgg, algorithm
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.fields import MODEL_CONFIG, NotBool
from ajet_hpc.config.lora import LoraConfig


class MergeConfig(BaseModel):
    """How an episode's model calls become training samples (docs/merging.md). The loss is the same."""

    model_config = MODEL_CONFIG

    mode: Literal["none", "linear", "tree"] = Field(
        default="linear",
        description="'none': one sample per call; 'linear': a call that is a prefix of a later call of its "
        "episode trains inside it; 'tree': linear, then the episode's forks packed into one prefix tree.",
    )
    level: Literal["token", "text"] = Field(
        default="token",
        description="Prefix test of linear merging: 'token' compares token ids (exact); 'text' compares the "
        "decoded text and reports each place where it trusted text over differing tokens.",
    )
    tree_scope: Literal["episode", "group"] = Field(
        default="episode",
        description="With mode 'tree': pack each episode, or each task group (one tree per task).",
    )
    tree_attention: Literal["dense", "flex"] = Field(
        default="dense",
        description="With mode 'tree', the attention mask: 'dense' ([B,1,T,T], SDPA; everywhere) or 'flex' "
        "(FlexAttention's block mask, linear in T; GPUs only, not yet run on one: docs/grpo.md).",
    )


class OffPolicyConfig(BaseModel):
    """Correction of the gap between the engine's sampling policy and the trained one (docs/algorithms.md).

    The weight of a trained token is ``w = exp(logp_trainer - logp_engine)`` (``level: token``), or for all
    tokens of a sequence the product over its tokens (``level: sequence``); both are constants in the loss.
    """

    model_config = MODEL_CONFIG

    mode: Literal["none", "tis", "mis"] = Field(
        default="none",
        description="'none': no correction; 'tis': truncated importance sampling, each loss term times "
        "min(w, cap); 'mis': masked importance sampling, times w inside [low, high] and 0 outside.",
    )
    level: Literal["token", "sequence"] = Field(
        default="token", description="Weigh each token by its own ratio, or each sequence by its product."
    )
    cap: float = Field(default=2.0, gt=0, allow_inf_nan=False, description="tis: the most a weight may be.")
    low: float = Field(default=0.5, ge=0, allow_inf_nan=False, description="mis: the least weight kept.")
    high: float = Field(default=2.0, gt=0, allow_inf_nan=False, description="mis: the largest weight kept.")

    @model_validator(mode="after")
    def _ordered(self) -> OffPolicyConfig:
        if self.low >= self.high:
            raise ValueError(f"low={self.low} must be below high={self.high}")
        return self


class OverlongConfig(BaseModel):
    """DAPO's overlong reward shaping: a penalty for answers that near or pass the length budget.

    With ``L = max_tokens`` and ``B = buffer_tokens``, an answer of ``n`` tokens gets
    ``0`` for ``n <= L - B``, ``penalty * (L - B - n) / B`` up to ``L``, and ``-penalty`` past it. An
    episode is shaped by its longest answer."""

    model_config = MODEL_CONFIG

    max_tokens: int | None = Field(
        default=None, ge=1, description="The length budget L; None: the server's serving.max_tokens."
    )
    buffer_tokens: int = Field(default=256, ge=1, description="The soft zone B before L.")
    penalty: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="The penalty at and past L (added as -penalty)."
    )


class TrainerConfig(BaseModel):
    """The trainer that runs next to a server's engine (GRPO on DeepSpeed ZeRO)."""

    model_config = MODEL_CONFIG

    algorithm: AlgorithmName = Field(
        default="grpo", description="Policy-optimisation algorithm (docs/algorithms.md)."
    )
    loss_agg: LossAgg | None = Field(
        default=None,
        description="How token loss terms add up: 'token_mean' (over the batch's trained tokens), "
        "'seq_mean_token_sum' (each sequence's token sum / token_sum_norm, mean over sequences), "
        "'seq_mean_token_mean' (each sequence's token mean, mean over sequences). None: the algorithm's "
        "(docs/algorithms.md).",
    )
    token_sum_norm: int | None = Field(
        default=None,
        ge=1,
        description="With loss_agg seq_mean_token_sum: the constant each sequence's token sum is divided by "
        "(Dr. GRPO's generation budget). None: the server's serving.max_tokens.",
    )
    off_policy: OffPolicyConfig = Field(
        default_factory=OffPolicyConfig,
        description="Importance-sampling correction of stale or mismatched engine samples; needs "
        "recompute_logprobs (docs/algorithms.md).",
    )
    overlong: OverlongConfig | None = Field(
        default=None, description="DAPO's overlong reward shaping; absent: off (docs/algorithms.md)."
    )
    zero_stage: Annotated[Literal[1, 2, 3], NotBool] = Field(default=2, description="DeepSpeed ZeRO stage.")
    ranks: int = Field(
        default=1,
        ge=1,
        description="Trainer processes (ranks) per node on a CPU server; on GPUs every trainer GPU runs one "
        "rank (see the server's placement) and this is not used.",
    )
    lr: float = Field(default=1e-5, gt=0, allow_inf_nan=False, description="Learning rate.")
    tasks_per_batch: int = Field(default=8, ge=1, description="Distinct tasks in one training batch.")
    repeats: int = Field(default=4, ge=1, description="Episodes per task in a batch (the GRPO group size).")
    max_staleness: int = Field(
        default=1, ge=0, description="Most policy versions a sample may lag behind the trained policy."
    )
    batch_policy: Literal["tasks", "episodes"] = Field(
        default="tasks",
        description="When a batch is ready: 'tasks' = tasks_per_batch tasks each with `repeats` finished "
        "episodes; 'episodes' = tasks_per_batch * repeats finished episodes of any tasks.",
    )
    skip_equal_groups: bool = Field(
        default=True, description="Drop task groups whose rewards are all equal (their advantages are zero)."
    )
    clip_eps: float = Field(default=0.2, gt=0, le=1, description="PPO clip range below 1 (ratio >= 1 - eps).")
    clip_eps_high: float = Field(
        default=0.28, gt=0, le=10, description="PPO clip range above 1 (ratio <= 1 + eps_high)."
    )
    kl_coef: float = Field(
        default=0.0, ge=0, description="Weight of the KL penalty to the initial model; 0 is off."
    )
    recompute_logprobs: bool = Field(
        default=False,
        description="Recompute the old log-probabilities with the trainer's model instead of the engine's.",
    )
    micro_batch_tokens: int = Field(
        default=8192, ge=16, description="Token budget of one micro-batch (forward/backward) per rank."
    )
    logits_chunk_tokens: int = Field(
        default=256,
        ge=1,
        description="Rows the output layer (logits, log-softmax) runs on at once, only at the positions that "
        "predict a trained token; the peak of the logits is one such chunk (docs/grpo.md). Not used under "
        "ZeRO-3, where the output layer runs once per micro-batch on all its trained rows.",
    )
    turn_gamma: float = Field(
        default=1.0, ge=0, le=1, description="Discount of later per-turn rewards in a turn's return."
    )
    mix_wait_s: float = Field(
        default=300.0,
        gt=0,
        allow_inf_nan=False,
        description="With client-group ratios: how long a batch waits for a slow group's share once the "
        "other groups' shares are there; then it trains without the missing tasks and reports the shortfall.",
    )
    merge: MergeConfig = Field(default_factory=MergeConfig, description="Timeline merging (docs/merging.md).")
    loss_weighting: Literal["token", "episode"] = Field(
        default="token",
        description="'token': every trained token weighs the same; 'episode': every episode of a batch "
        "weighs the same, however many tokens (or samples, merged or not) it has.",
    )
    weight_sync: Literal["memory", "disk"] = Field(
        default="memory",
        description="How new weights reach the engine after each step: 'memory' sends them from the ranks "
        "straight into the running vLLM engine (vLLM's weight-transfer API: NCCL between GPUs, CUDA IPC when "
        "colocated, gloo on CPUs); 'disk' exports them to node-local storage and reloads them (also the "
        "fallback for the transformers engine). docs/weight_sync.md.",
    )
    start_with_engine: bool = Field(
        default=True,
        description="Start the ranks while the engine loads (the first step comes sooner, at every start "
        "and requeue); false: after it, which lowers the node's peak memory while both load a large model. "
        "Ignored under placement colocate (always after). docs/architecture.md.",
    )
    weight_sync_timeout_s: float = Field(
        default=300.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest a weight transfer may take; a side that stops mid-transfer fails the step "
        "with an error naming it instead of hanging the allocation.",
    )
    weight_sync_bucket_mb: int = Field(
        default=256, ge=1, description="Size of the buffers weights travel in during a memory sync, in MiB."
    )
    total_steps: int = Field(default=100, ge=1, description="Training steps after which the run is done.")
    save_every: int = Field(default=10, ge=1, description="Checkpoint every this many steps.")
    seed: int = Field(default=0, ge=0, description="Random seed of the trainer.")
    lora: LoraConfig | None = Field(
        default=None,
        description="Train a LoRA adapter on the frozen model instead of all its weights; absent: full "
        "fine-tuning. docs/lora.md.",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Restarts of failed trainer ranks (from their last checkpoint) in a row, without a "
        "trained step between them, after which the server goes to state 'failed' and its job ends with an "
        "error instead of serving an untrained model (docs/reliability.md, Watchdog).",
    )

    @property
    def spec(self) -> Algorithm:
        """The algorithm of ``algorithm``: its settings, defaults and checks."""
        return algorithm(self.algorithm)

    def resolved(self, serving: ServingConfig) -> TrainerConfig:
        """These settings with the defaults of the algorithm (``Algorithm.defaults``: its clip range and
        ``loss_agg``) and of the server's ``serving`` filled in: ``token_sum_norm`` and
        ``overlong.max_tokens`` default to ``serving.max_tokens`` (the generation budget). A field the
        topology sets is kept as it is."""
        update = self.spec.defaults(self)
        if self.token_sum_norm is None:
            update["token_sum_norm"] = serving.max_tokens
        if self.overlong is not None and self.overlong.max_tokens is None:
            update["overlong"] = self.overlong.model_copy(update={"max_tokens": serving.max_tokens})
        return self.model_copy(update=update) if update else self
