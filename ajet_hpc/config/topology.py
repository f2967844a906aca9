"""The topology: one typed description of a run's servers (trainable models) and clients (agent job arrays).

Every model is frozen, rejects unknown keys, and validates strictly (an int is not ``"3"`` nor ``true``).
Each component later receives only its own block: the launcher ``cluster``, a server job its ``ServerConfig``,
the trainer ``server.trainer``, a client array its ``ClientGroupConfig``.

Constructing a :class:`Topology` raises ``pydantic.ValidationError`` for malformed fields and ``ConfigError``
for inconsistent ones (duplicate names, unknown server references, see :func:`consistency_issues`); the
validation context ``{"envs_dir": path}`` also checks that client ``env`` files exist.
:func:`ajet_hpc.config.load.load_topology` reports both kinds as ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ajet_hpc.config.algorithms import algorithm
from ajet_hpc.config.errors import ConfigError, ConfigIssue
from ajet_hpc.config.evaluation import EvalConfig, eval_group, eval_issues
from ajet_hpc.config.fields import (
    EntryPoint,
    EnvFile,
    ModelSource,
    Name,
    NotBool,
    Partition,
    SbatchOptions,
    SlurmMemory,
    SlurmTime,
    slurm_time_minutes,
)
from ajet_hpc.config.placement import Placement, PlacementError, plan_placement

_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)
# an account or qos name goes into an #SBATCH line: one word, no whitespace, quotes or shell characters
_SLURM_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.+@-]*$"


TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


def _jsonl_only() -> list[TrackerName]:
    return ["jsonl"]


class RunConfig(BaseModel):
    """Identity of the run and where its run directory lives."""

    model_config = _MODEL_CONFIG

    name: Name = Field(description="Run name; used in job names and as the default run directory name.")
    dir: str | None = Field(
        default=None,
        min_length=1,
        description="Run directory on shared storage; default runs/<name> relative to the working directory.",
    )
    trackers: list[TrackerName] = Field(
        default_factory=_jsonl_only,
        description="Where each server also logs its metrics rows: 'jsonl' (RUN/metrics.jsonl, always), "
        "'tensorboard' (RUN/tensorboard), 'wandb' (offline by default: RUN/wandb), 'mlflow' (file store "
        "RUN/mlruns). The libraries are extras: pip install 'ajet_hpc[wandb]'.",
    )

    @field_validator("trackers")
    @classmethod
    def _jsonl_always(cls, value: list[str]) -> list[str]:
        return ["jsonl", *(name for name in dict.fromkeys(value) if name != "jsonl")]

    def resolve_dir(self, cwd: Path | None = None) -> Path:
        """The absolute run directory; a relative one is taken from ``cwd`` (default: working directory)."""
        base = Path.cwd() if cwd is None else cwd
        path = Path(self.dir).expanduser() if self.dir is not None else Path("runs") / self.name
        return (base / path).absolute()


class ClusterConfig(BaseModel):
    """How jobs are submitted: backend, accounting, and options shared by every job."""

    model_config = _MODEL_CONFIG

    backend: Literal["auto", "slurm", "local"] = Field(
        default="auto",
        description="Where jobs run: 'slurm', 'local' processes, or 'auto' (Slurm when sbatch is available).",
    )
    account: str | None = Field(
        default=None,
        min_length=1,
        pattern=_SLURM_NAME,
        description="Slurm account (--account) for every job: letters, digits and _ . + - @ only.",
    )
    qos: str | None = Field(
        default=None,
        min_length=1,
        pattern=_SLURM_NAME,
        description="Slurm quality of service (--qos) for every job: letters, digits and _ . + - @ only.",
    )
    setup: list[str] = Field(
        default_factory=list, description="Shell lines run before each job starts, e.g. 'module load cuda'."
    )
    sbatch: SbatchOptions = Field(
        default_factory=dict,
        description="Extra sbatch options for every job, keys without dashes, e.g. {constraint: a100}.",
    )
    hetjob: bool = Field(
        default=False,
        description=(
            "Submit each server together with the client groups that use only that server "
            "as one heterogeneous Slurm job."
        ),
    )
    signal_delay_s: int = Field(
        default=120,
        ge=10,
        description="Seconds before the time limit at which Slurm sends the checkpoint signal.",
    )
    kill_wait_s: int = Field(
        default=30,
        ge=3,
        description="Seconds from Slurm's SIGTERM to its SIGKILL: the cluster's KillWait (scontrol show "
        "config), plus the partition's GraceTime where preemption sends SIGTERM. A server saves on SIGTERM "
        "within two thirds of it and stops in the rest.",
    )
    env_cache: str | None = Field(
        default=None,
        min_length=1,
        description="Folder on shared storage where client runtimes (a group's env file built into a venv "
        "or conda environment) are built once and reused by every run; default RUN/envs. A relative path is "
        "taken from the launch directory.",
    )
    share_group: str | None = Field(
        default=None,
        min_length=1,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
        description="Unix group that may read the run directory (created 0750 and owned by this group); "
        "default: the run directory is 0700, private to its owner.",
    )


class MergeConfig(BaseModel):
    """How an episode's model calls become training samples (docs/merging.md). The loss is the same."""

    model_config = _MODEL_CONFIG

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


AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"]  # config.algorithms
"""The policy-optimisation algorithms of ``trainer.algorithm`` (``ajet_hpc/algo/``, docs/algorithms.md)."""
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


class OffPolicyConfig(BaseModel):
    """Correction of the gap between the engine's sampling policy and the trained one (docs/algorithms.md).

    The weight of a trained token is ``w = exp(logp_trainer - logp_engine)`` (``level: token``), or for all
    tokens of a sequence the product over its tokens (``level: sequence``); both are constants in the loss.
    """

    model_config = _MODEL_CONFIG

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

    model_config = _MODEL_CONFIG

    max_tokens: int | None = Field(
        default=None, ge=1, description="The length budget L; None: the server's serving.max_tokens."
    )
    buffer_tokens: int = Field(default=256, ge=1, description="The soft zone B before L.")
    penalty: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="The penalty at and past L (added as -penalty)."
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's ``max_lora_rank`` takes (its LoRA kernels are built for these)."""

DEFAULT_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    """A LoRA adapter trained on a frozen base model (peft); docs/lora.md."""

    model_config = _MODEL_CONFIG

    rank: int = Field(default=16, ge=1, le=512, description="Rank r of the adapter's A and B matrices.")
    alpha: int = Field(default=32, gt=0, description="Scaling: the update is scaled by alpha / rank.")
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training. 0 (the default) keeps the trainer's "
        "log-probabilities those the engine samples with; above 0 the ratio of new to old policy is noisy.",
    )
    target_modules: tuple[str, ...] = Field(
        default=DEFAULT_LORA_MODULES,
        min_length=1,
        description="Names of the linear layers that get an adapter (the last part of the module name); "
        "each must exist in the model, checked before submitting.",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _listed(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value


class TrainerConfig(BaseModel):
    """The trainer that runs next to a server's engine (GRPO on DeepSpeed ZeRO)."""

    model_config = _MODEL_CONFIG

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


class ServingConfig(BaseModel):
    """How a server serves agents: context length, limits, episodes and tokens."""

    model_config = _MODEL_CONFIG

    max_model_len: int = Field(default=2048, ge=16, description="Context length (prompt + answer) in tokens.")
    max_tokens: int = Field(
        default=1024, ge=1, description="Largest max_tokens a request may ask for (and the default)."
    )
    max_n: int = Field(default=8, ge=1, description="Largest n (answers per request) a request may ask for.")
    keep_history: bool = Field(
        default=False,
        description="Where the chat template renders an earlier answer otherwise than it was sampled "
        "(reasoning dropped, tool calls re-serialized), put the recorded answer in the prompt whole: the "
        "model sees what it wrote, and the episode's calls stay prefixes of each other, so they merge "
        "(docs/merging.md).",
    )
    episode_timeout_s: float = Field(
        default=600.0,
        gt=0,
        allow_inf_nan=False,
        description="An episode with no call for this long is dropped and reported, so its task runs again.",
    )
    token_ttl_s: float = Field(
        default=86400.0, gt=0, allow_inf_nan=False, description="Lifetime of an episode token in seconds."
    )
    tool_parser: Literal["hermes"] = Field(
        default="hermes",
        description="How tool calls are read from the answers ('hermes': <tool_call>{json}</tool_call>)",
    )
    max_request_bytes: int = Field(
        default=16 * 2**20,
        ge=1024,
        description="Largest request body in bytes (413 beyond it); the token is checked before the body is "
        "read.",
    )
    max_messages: int = Field(
        default=1024, ge=1, description="Most messages in one chat request (400 beyond it)."
    )
    max_tools: int = Field(default=128, ge=0, description="Most tools in one chat request (400 beyond it).")
    max_stop: int = Field(default=16, ge=0, description="Most stop strings in one request (400 beyond it).")
    max_stop_chars: int = Field(
        default=256, ge=1, description="Longest stop string in characters (400 beyond it)."
    )
    max_abs_reward: float = Field(
        default=1e6,
        gt=0,
        allow_inf_nan=False,
        description="Largest |reward| and |turn reward| an episode may end with (400 beyond it); "
        "rewards must be finite.",
    )
    tls_certfile: str | None = Field(
        default=None,
        min_length=1,
        description="PEM certificate: the server speaks HTTPS (uvicorn's ssl_certfile); clients then need "
        "the CA that signed it (SSL_CERT_FILE). docs/security.md.",
    )
    tls_keyfile: str | None = Field(
        default=None, min_length=1, description="PEM private key of tls_certfile (uvicorn's ssl_keyfile)."
    )
    keep_alive_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="How long the server keeps an idle client connection open (uvicorn's "
        "timeout_keep_alive). Longer than the clients' own keep-alive (httpx: 5 s), so that the client, not "
        "the server, closes an idle connection: a server that closes one as a request arrives on it leaves "
        "that request unanswered.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="How long a connection may take to send a request's headers, from when it opens or the "
        "request begins; a silent connection is closed then (docs/security.md).",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        allow_inf_nan=False,
        description="How long a request may take to send its whole body once its headers are in; a trickled "
        "body is cut off then.",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="Most open client connections; past it the longest-silent connection is closed first. "
        "None: the open-file limit (raised to its hard limit at start) less 256 for the server's own files.",
    )


class VllmConfig(BaseModel):
    """Settings of the vLLM engine a GPU user tunes (ignored by the transformers engine)."""

    model_config = _MODEL_CONFIG

    gpu_memory_utilization: float = Field(
        default=0.85,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Share of each engine GPU's memory vLLM takes for weights and KV cache. With placement "
        "colocate the trainer's ranks live beside it: the launcher checks that both fit.",
    )
    max_num_seqs: int = Field(default=256, ge=1, description="Most requests vLLM batches in one step.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="Engine weights' dtype; 'auto': bfloat16 on GPUs, float32 on CPUs."
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV cache of shared prompt prefixes (reset at every weight sync)."
    )
    enforce_eager: bool | None = Field(
        default=None,
        description="No CUDA graphs; null: eager on CPUs, CUDA graphs on GPUs (faster, slower to start).",
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        description="With LoRA: adapters vLLM holds on the device at once; at least the server's LoRA models "
        "(its own trainer.lora and its adapters); null: exactly that many.",
    )
    max_lora_rank: Annotated[int, NotBool] | None = Field(
        default=None,
        description="With LoRA: the largest adapter rank vLLM serves, one of "
        f"{', '.join(map(str, VLLM_LORA_RANKS))}; null: the smallest that holds the server's largest rank.",
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _known_rank(cls, value: int | None) -> int | None:
        if value is not None and value not in VLLM_LORA_RANKS:
            raise ValueError(f"must be one of {', '.join(map(str, VLLM_LORA_RANKS))} (vLLM's LoRA ranks)")
        return value


class StoreConfig(BaseModel):
    """How the server commits closed episodes to its store (``RUN/data/<model>.h5``, docs/storage.md)."""

    model_config = _MODEL_CONFIG

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


class JobResources(BaseModel):
    """The Slurm resources of one job: its partition, CPUs per task, memory and time limit.

    The base of every model that becomes a job (a server job, each array task of a client group): what the
    launcher and the consistency checks ask of any job (``time_min`` included), typed once. Each subclass
    declares these fields itself, with its own default and help (a server job: partition gpu, 4 CPUs, 16G;
    an array task: cpu, 1, 2G), in its own place among its fields: pydantic puts a base's fields first,
    which would reorder the keys of the frozen ``RUN/topology.yaml`` (an existing run would then read as
    changed on resume) and the allowed keys an unknown-key error lists.
    """

    model_config = _MODEL_CONFIG

    if TYPE_CHECKING:  # declared by each subclass, see above
        partition: Partition
        cpus: int
        mem: SlurmMemory
        time: SlurmTime

    @property
    def time_min(self) -> int:
        """The time limit in whole minutes (seconds round up)."""
        return slurm_time_minutes(self.time)


class AdapterConfig(BaseModel):
    """One more model on a server's engine: a LoRA adapter of the server's base model with its own trainer,
    store, checkpoints and metrics, or (``trainer: null``) the bare base under this name. Clients name it
    as they name a server. docs/lora.md, "Several models on one server"."""

    model_config = _MODEL_CONFIG

    name: Name = Field(
        description="The model's name: clients refer to it, and it names its files in the run."
    )
    trainer: TrainerConfig | None = Field(
        default=TrainerConfig(lora=LoraConfig()),
        description="The adapter's trainer, with trainer.lora (default: a rank-16 adapter); null serves the "
        "model without training (a judge or an opponent that does not learn): the bare base, or `adapter`.",
    )
    adapter: str | None = Field(
        default=None,
        min_length=1,
        description="With trainer: null, a peft adapter folder of the base (adapter_config.json and "
        "adapter_model.safetensors, e.g. from `ajet-hpc export --adapter`) served frozen as this model; a "
        "relative path is taken from where the server runs, like `model`.",
    )
    store: StoreConfig = Field(
        default=StoreConfig(), description="Group commit of this model's store (RUN/data/<name>.h5)."
    )


class ServerConfig(JobResources):
    """One trainable model: an inference engine and its trainer in one GPU allocation."""

    model_config = _MODEL_CONFIG

    name: Name = Field(
        description="Server name; clients refer to it, and it names the model's files in the run."
    )
    model: ModelSource = Field(description="Model weights: 'builtin:tiny' or a local path.")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        default="auto", description="Inference engine; 'auto' picks vLLM when it is installed."
    )
    partition: Partition = Field(default="gpu", description="Slurm partition of the server job.")
    nodes: int = Field(default=1, ge=1, description="Nodes of the server job.")
    gpus_per_node: int = Field(
        default=2,
        ge=0,
        description="GPUs per node; 0 runs on CPUs (laptops, CI). The default 2 gives the engine one GPU and "
        "the trainer one (placement split).",
    )
    placement: Literal["split", "colocate"] = Field(
        default="split",
        description="'split': the engine takes the first engine_gpus GPUs of the first node, the trainer one "
        "rank on every other GPU; 'colocate': both share every GPU, the engine sleeping (vLLM sleep mode) "
        "while the ranks train (GPUs only). docs/placement.md.",
    )
    engine_gpus: int = Field(
        default=1, ge=1, description="GPUs of the vLLM engine on the first node (its tensor parallel size)."
    )
    gpu_memory_gib: float = Field(
        default=80.0,
        gt=0,
        allow_inf_nan=False,
        description="Memory of one GPU of the partition in GiB, for the launcher's check that the model "
        "fits.",
    )
    vllm: VllmConfig = Field(default=VllmConfig(), description="vLLM engine settings.")
    cpus: int = Field(default=4, ge=1, description="CPUs per task (--cpus-per-task).")
    mem: SlurmMemory = Field(
        default="16G",
        description="Memory per node: an integer with optional K/M/G/T suffix (MB without one).",
    )
    time: SlurmTime = Field(
        default="4:00:00", description="Time limit per job: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."
    )
    port: int = Field(default=0, ge=0, le=65535, description="HTTP port of the server; 0 picks a free port.")
    serving: ServingConfig = Field(default=ServingConfig(), description="Serving limits, episode settings.")
    store: StoreConfig = Field(
        default=StoreConfig(), description="Group commit of the server store (docs/storage.md)."
    )
    trainer: TrainerConfig | None = Field(
        default=TrainerConfig(),
        description="Trainer settings of this model; null serves it without training.",
    )
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        description="More models served by this server's one engine, each a LoRA adapter of its base model "
        "(or the bare base) with its own trainer; the server itself stays a model too (give it trainer.lora "
        "or trainer: null). docs/lora.md.",
    )

    def models(self) -> list[ServerConfig]:
        """The models this server job serves: itself, then each adapter as a model of its own (the server's
        fields with the adapter's name, trainer and store)."""
        hosted = [
            self.model_copy(update={"name": a.name, "trainer": a.trainer, "store": a.store, "adapters": []})
            for a in self.adapters
        ]
        return [self, *hosted]

    def lora_models(self) -> list[tuple[str, LoraConfig]]:
        """(name, adapter) of every model of this server that trains a LoRA adapter."""
        return [
            (m.name, m.trainer.lora)
            for m in self.models()
            if m.trainer is not None and m.trainer.lora is not None
        ]

    def frozen_adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of every adapter of this server served frozen from a folder (``adapter``)."""
        return [(a.name, a.adapter) for a in self.adapters if a.adapter is not None and a.trainer is None]


class ClientGroupConfig(JobResources):
    """One group of agents: a Slurm job array whose tasks run episodes against the named servers."""

    model_config = _MODEL_CONFIG

    name: Name = Field(description="Client group name; names the group's files in the run.")
    agent: EntryPoint = Field(description="The agent to run, as 'module.path:function'.")
    tasks: str = Field(
        description="Task source: 'builtin:<name>', a path ending in '.jsonl', or 'module.path:callable'."
    )
    servers: list[Name] = Field(min_length=1, description="Names of the servers this group's agents use.")
    partition: Partition = Field(default="cpu", description="Slurm partition of the client array.")
    array: int = Field(default=1, ge=1, description="Number of array tasks.")
    in_flight: int = Field(default=1, ge=1, description="Episodes in flight per array task.")
    max_tasks: int | None = Field(
        default=None,
        ge=1,
        description="Use only the first max_tasks tasks of the source (split over the array); None: all.",
    )
    repeats: int | None = Field(
        default=None,
        ge=1,
        description="Episodes per task; None: the first server's trainer.repeats (1 when it only serves).",
    )
    env: EnvFile | None = Field(
        default=None, description="Environment spec file under envs/ the agent runs in, e.g. agent-basic.txt."
    )
    ratio: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Share of each training batch's tasks that come from this group (mixed-task training). "
        "Set it on every group of a trainable server or on none; the shares of a server sum to 1.",
    )
    time: SlurmTime = Field(
        default="4:00:00",
        description="Time limit per array task: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.",
    )
    cpus: int = Field(default=1, ge=1, description="CPUs per array task (--cpus-per-task).")
    mem: SlurmMemory = Field(
        default="2G",
        description="Memory per array task: an integer with optional K/M/G/T suffix (MB without one).",
    )
    epochs: int = Field(
        default=1,
        ge=1,
        description="Passes over the task source; in pass e > 0 a task's id becomes '<id>@<e>', so every "
        "(group, task id, repeat) stays unique over the run.",
    )
    server_wait_s: float | None = Field(
        default=3600.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest an array task waits for an absent server (no fresh rendezvous, no answer) "
        "before it stops with an error and releases its allocation; None waits for ever (a requeued server "
        "may sit in the queue for hours).",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Restarts of an array task's runner that died without finishing (killed, crashed, out "
        "of memory), in its allocation; each resumes from the task's store. Then the array task fails.",
    )
    max_resubmits: int = Field(
        default=2,
        ge=0,
        description="Times an array task that died whole (a node failure, the OOM killer, kill -9 of all "
        "its processes: Slurm says NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL or FAILED by a signal) is submitted "
        "again, by the keeper of the group's first server (Slurm only); it resumes from its store. 0: never.",
    )
    eval: EvalConfig | None = Field(
        default=None,
        description="Held-out evaluation during training: an eval group '<name>-eval' runs this group's "
        "agent on eval.tasks every eval.every_steps steps (docs/evaluation.md).",
    )


class Topology(BaseModel):
    """A whole run: its identity, the cluster settings, the servers and the client groups."""

    model_config = _MODEL_CONFIG

    run: RunConfig = Field(description="Run name and directory.")
    cluster: ClusterConfig = Field(
        default=ClusterConfig(), description="Submission settings shared by all jobs."
    )
    servers: list[ServerConfig] = Field(min_length=1, description="Trainable models, one server job each.")
    clients: list[ClientGroupConfig] = Field(
        default_factory=list, description="Agent groups, one job array each."
    )

    @model_validator(mode="after")
    def _check_consistency(self, info: ValidationInfo) -> Topology:
        envs_dir = (info.context or {}).get("envs_dir")
        issues = consistency_issues(self, None if envs_dir is None else Path(envs_dir))
        if issues:
            raise ConfigError(issues)
        return self

    @property
    def models(self) -> list[ServerConfig]:
        """Every model of the run: each server, and after it the adapters it serves (`ServerConfig.models`).
        Clients, stores, rendezvous files, checkpoints and metrics are per model; jobs per server."""
        return [model for server in self.servers for model in server.models()]

    def server(self, name: str) -> ServerConfig:
        """The model called ``name`` (a server, or an adapter on one); ``KeyError`` naming them otherwise."""
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no server named {name!r}; servers are: {', '.join(m.name for m in self.models)}")

    def host_of(self, name: str) -> ServerConfig:
        """The server job that serves the model ``name`` (the model itself unless it is an adapter)."""
        for server in self.servers:
            if any(model.name == name for model in server.models()):
                return server
        raise KeyError(f"no server serves a model named {name!r}")

    def client(self, name: str) -> ClientGroupConfig:
        """The client group called ``name`` (an eval group too); ``KeyError`` naming the groups otherwise."""
        for client in [*self.clients, *self.eval_groups.values()]:
            if client.name == name:
                return client
        known = ", ".join([c.name for c in self.clients] + list(self.eval_groups)) or "(none)"
        raise KeyError(f"no client group named {name!r}; client groups are: {known}")

    @property
    def eval_groups(self) -> dict[str, ClientGroupConfig]:
        """Eval group name -> the eval group of every client group with an ``eval`` block
        (``config.evaluation``). They run as jobs of the run, but feed no trainer: ``clients`` does not
        list them."""
        return {g.name: g for g in (eval_group(c) for c in self.clients if c.eval is not None)}

    def evaluated_by(self, eval_group_name: str) -> ClientGroupConfig | None:
        """The client group whose eval group is ``eval_group_name``; None if it is not an eval group."""
        for client in self.clients:
            if client.eval is not None and eval_group(client).name == eval_group_name:
                return client
        return None


def consistency_issues(topology: Topology, envs_dir: Path | None = None) -> list[ConfigIssue]:
    """Problems that span fields, all of them, each with its path.

    Duplicate names, unknown or repeated server references, time limits not longer than the signal delay, and
    (when ``envs_dir`` is given) client ``env`` files missing from it.
    """
    issues = _duplicates_of_models(topology)
    issues += _duplicates("clients", [c.name for c in topology.clients])
    server_names = list(dict.fromkeys(m.name for m in topology.models))
    for i, client in enumerate(topology.clients):
        seen: set[str] = set()
        for j, ref in enumerate(client.servers):
            path = f"clients[{i}].servers[{j}]"
            if ref not in server_names:
                issues.append(
                    ConfigIssue(path, f"unknown server {ref!r}; servers are: {', '.join(server_names)}")
                )
            elif ref in seen:
                issues.append(ConfigIssue(path, f"server {ref!r} is listed twice"))
            seen.add(ref)
    delay = topology.cluster.signal_delay_s
    jobs: list[tuple[str, Sequence[JobResources]]] = [
        ("servers", topology.servers),
        ("clients", topology.clients),
    ]
    for section, members in jobs:
        for i, member in enumerate(members):
            if member.time_min * 60 <= delay:
                issues.append(
                    ConfigIssue(
                        f"{section}[{i}].time",
                        f"time limit {member.time!r} is not longer than cluster.signal_delay_s={delay}; "
                        "raise the time limit or lower the delay",
                    )
                )
    issues += _mix_issues(topology)
    issues += _placement_issues(topology)
    issues += _lora_issues(topology)
    issues += _algorithm_issues(topology)
    issues += eval_issues(topology)
    if envs_dir is not None:
        issues += _missing_envs(topology, envs_dir)
    return issues


def lora_rank_limit(server: ServerConfig, frozen_ranks: Sequence[int] = ()) -> int | None:
    """The ``max_lora_rank`` the server's vLLM engine is built with: the configured one, else the smallest
    of vLLM's ranks that holds the largest of its adapters' ranks (those it trains, and ``frozen_ranks``,
    read from the folders of its frozen adapters); None when no model of it is an adapter."""
    ranks = [lora.rank for _, lora in server.lora_models()] + list(frozen_ranks)
    if not ranks:
        return None
    if server.vllm.max_lora_rank is not None:
        return server.vllm.max_lora_rank
    return min((r for r in VLLM_LORA_RANKS if r >= max(ranks)), default=VLLM_LORA_RANKS[-1])


def lora_slots(server: ServerConfig) -> int:
    """The ``max_loras`` the server's vLLM engine is built with: the configured one, else one slot per
    LoRA model of the server (trained, or frozen from a folder)."""
    return server.vllm.max_loras or max(1, len(server.lora_models()) + len(server.frozen_adapters()))


def _lora_issues(topology: Topology) -> list[ConfigIssue]:
    """An adapter rank above the engine's ``max_lora_rank``; fewer LoRA slots than adapters; what a server
    with adapters cannot do (full fine-tuning of the shared base, the transformers engine, colocate)."""
    issues = []
    for i, server in enumerate(topology.servers):
        limit = lora_rank_limit(server)
        for j, model in enumerate(server.models()):
            lora = model.trainer.lora if model.trainer is not None else None
            where = f"servers[{i}]" if j == 0 else f"servers[{i}].adapters[{j - 1}]"
            if lora is not None and limit is not None and lora.rank > limit:
                issues.append(
                    ConfigIssue(
                        f"{where}.trainer.lora.rank",
                        f"rank {lora.rank} is above servers[{i}].vllm.max_lora_rank={limit}: vLLM would "
                        "refuse the adapter; raise max_lora_rank or lower the rank",
                    )
                )
        if server.adapters:
            issues += _adapter_issues(i, server)
    return issues


def _algorithm_issues(topology: Topology) -> list[ConfigIssue]:
    """Algorithm settings that cannot work together: a ``loss_agg`` the algorithm does not allow (GSPO's
    loss is a mean over sequences), off-policy correction without the trainer's own log-probabilities,
    DAPO without the dynamic sampling it is defined with (docs/algorithms.md)."""
    issues = []
    for i, server in enumerate(topology.servers):
        for j, model in enumerate(server.models()):
            if model.trainer is not None:
                where = f"servers[{i}]" if j == 0 else f"servers[{i}].adapters[{j - 1}]"
                issues += _trainer_algorithm_issues(f"{where}.trainer", model.trainer)
    return issues


def _trainer_algorithm_issues(where: str, trainer: TrainerConfig) -> list[ConfigIssue]:
    issues = []
    if trainer.off_policy.mode != "none" and not trainer.recompute_logprobs:
        issues.append(
            ConfigIssue(
                f"{where}.off_policy.mode",
                f"off_policy.mode {trainer.off_policy.mode!r} weighs each token by the ratio of the "
                "trained policy to the engine that sampled it, against the trainer's own log-probabilities; "
                f"without {where}.recompute_logprobs: true the clipped ratio is already taken against the "
                "engine's, and the correction would count the same ratio twice: set recompute_logprobs: "
                "true or off_policy.mode: none",
            )
        )
    spec = algorithm(trainer.algorithm)
    if trainer.loss_agg is not None and trainer.loss_agg not in spec.loss_aggs:
        issues.append(
            ConfigIssue(
                f"{where}.loss_agg",
                f"algorithm {trainer.algorithm!r} is defined with loss_agg {' or '.join(spec.loss_aggs)}, "
                f"not {trainer.loss_agg!r}: drop {where}.loss_agg or pick another algorithm",
            )
        )
    if spec.group_filter and not (trainer.skip_equal_groups and trainer.batch_policy == "tasks"):
        issues.append(
            ConfigIssue(
                f"{where}.skip_equal_groups",
                f"algorithm {trainer.algorithm!r} refills a batch with task groups whose rewards differ: it "
                f"needs {where}.skip_equal_groups: true and {where}.batch_policy: tasks",
            )
        )
    return issues


def _adapter_issues(i: int, server: ServerConfig) -> list[ConfigIssue]:
    issues = []
    if server.trainer is not None and server.trainer.lora is None:
        issues.append(
            ConfigIssue(
                f"servers[{i}].trainer",
                f"full fine-tuning would change the base model that the adapters of server {server.name!r} "
                "share: give the server trainer.lora, or trainer: null to serve the bare base",
            )
        )
    for j, adapter in enumerate(server.adapters):
        if adapter.trainer is not None and adapter.adapter is not None:
            issues.append(
                ConfigIssue(
                    f"servers[{i}].adapters[{j}].adapter",
                    f"adapter {adapter.name!r} trains from version 0 (B = 0, the base); a given folder is "
                    "served frozen: set trainer: null to serve it, or drop `adapter` to train",
                )
            )
        if adapter.trainer is not None and adapter.trainer.lora is None:
            issues.append(
                ConfigIssue(
                    f"servers[{i}].adapters[{j}].trainer.lora",
                    f"adapter {adapter.name!r} trains a LoRA adapter of the shared base: set trainer.lora "
                    "(or trainer: null to serve the bare base under this name)",
                )
            )
    if server.engine == "transformers":
        issues.append(
            ConfigIssue(
                f"servers[{i}].engine",
                "a server with adapters serves them all from one engine with multi-LoRA: use engine vllm",
            )
        )
    if server.placement == "colocate":
        issues.append(
            ConfigIssue(
                f"servers[{i}].placement",
                "a server with adapters runs its trainers beside the engine: use placement split "
                "(colocate, where the engine sleeps for one trainer's step, is not supported with several)",
            )
        )
    count = len(server.lora_models()) + len(server.frozen_adapters())
    if server.vllm.max_loras is not None and server.vllm.max_loras < count:
        issues.append(
            ConfigIssue(
                f"servers[{i}].vllm.max_loras",
                f"max_loras {server.vllm.max_loras} is below the {count} LoRA models of server "
                f"{server.name!r}: every adapter needs its slot; raise it or leave it null",
            )
        )
    return issues


def mix_of(topology: Topology, server: str) -> dict[str, float] | None:
    """The task shares (client group -> ratio) of a server's batches; None when its groups set none."""
    groups = [c for c in topology.clients if server in c.servers]
    if not any(c.ratio is not None for c in groups):
        return None
    return {c.name: c.ratio or 0.0 for c in groups}


def episode_repeats(topology: Topology, group: ClientGroupConfig) -> int:
    """Episodes a client group runs per task: its ``repeats``, else its first server's ``trainer.repeats``
    (1 when that server only serves)."""
    if group.repeats is not None:
        return group.repeats
    trainer = topology.server(group.servers[0]).trainer
    return trainer.repeats if trainer is not None else 1


def repeats_feeding(topology: Topology, server: str) -> dict[str, int]:
    """Client group -> episodes per task, for every group whose agents use ``server``."""
    return {c.name: episode_repeats(topology, c) for c in topology.clients if server in c.servers}


def co_trained(topology: Topology, server: str) -> list[str]:
    """The other trainable servers that share a client group with ``server`` (their agents use both)."""
    names: dict[str, None] = {}
    for client in topology.clients:
        if server in client.servers:
            for other in client.servers:
                if other != server and topology.server(other).trainer is not None:
                    names[other] = None
    return list(names)


def _mix_issues(topology: Topology) -> list[ConfigIssue]:
    issues = []
    index = {c.name: i for i, c in enumerate(topology.clients)}
    for server in topology.servers:
        groups = [c for c in topology.clients if server.name in c.servers]
        shares = mix_of(topology, server.name)
        if shares is None:
            continue
        unset = [c.name for c in groups if c.ratio is None]
        for name in unset:
            issues.append(
                ConfigIssue(
                    f"clients[{index[name]}].ratio",
                    f"server {server.name!r} mixes its groups' tasks by ratio, but group {name!r} has none: "
                    "give every group of the server a ratio, or none of them",
                )
            )
        total = sum(shares.values())
        if not unset and abs(total - 1.0) > 1e-6:
            parts = " + ".join(f"{name} {share:g}" for name, share in shares.items())
            issues.append(
                ConfigIssue(
                    f"clients[{index[groups[0].name]}].ratio",
                    f"the ratios of server {server.name!r}'s groups sum to {total:g} ({parts}), not 1",
                )
            )
        if server.trainer is not None and server.trainer.batch_policy != "tasks":
            issues.append(
                ConfigIssue(
                    f"clients[{index[groups[0].name]}].ratio",
                    f"ratios need trainer.batch_policy 'tasks' (server {server.name!r} uses "
                    f"{server.trainer.batch_policy!r})",
                )
            )
    return issues


def server_placement(server: ServerConfig) -> Placement:
    """Where the server's engine and trainer ranks run (``PlacementError`` when impossible). For a server
    with adapters, that of its first trained model: every model's ranks use the same trainer devices
    (each model's own: ``server_placement`` of ``ServerConfig.models()``'s entry)."""
    if server.adapters and server.trainer is None:
        server = next((m for m in server.models() if m.trainer is not None), server)
    return plan_placement(
        nodes=server.nodes,
        gpus_per_node=server.gpus_per_node,
        mode=server.placement,
        engine_gpus=server.engine_gpus,
        cpu_ranks=server.trainer.ranks if server.trainer is not None else 1,
        trains=server.trainer is not None,
    )


def _placement_issues(topology: Topology) -> list[ConfigIssue]:
    issues = []
    for i, server in enumerate(topology.servers):
        try:
            server_placement(server)
        except PlacementError as error:
            issues.append(ConfigIssue(f"servers[{i}].{error.field}", error.message))
        if server.placement == "colocate" and server.engine == "transformers":
            issues.append(
                ConfigIssue(
                    f"servers[{i}].engine",
                    "placement colocate needs the vllm engine (its sleep mode frees the GPUs for the "
                    "trainer); use engine: vllm, or placement: split",
                )
            )
    return issues


def _missing_envs(topology: Topology, envs_dir: Path) -> list[ConfigIssue]:
    issues = []
    for i, client in enumerate(topology.clients):
        if client.env is not None and not (envs_dir / client.env).is_file():
            present = sorted(p.name for p in envs_dir.iterdir() if p.is_file()) if envs_dir.is_dir() else []
            issues.append(
                ConfigIssue(
                    f"clients[{i}].env",
                    f"no environment file {client.env!r} in {envs_dir}; "
                    f"files there: {', '.join(present) or '(none)'}",
                )
            )
    return issues


def _duplicates_of_models(topology: Topology) -> list[ConfigIssue]:
    """Model names (servers and their adapters) must be unique over the run."""
    first: dict[str, str] = {}
    issues = []
    for i, server in enumerate(topology.servers):
        named = [(f"servers[{i}]", server.name)]
        named += [(f"servers[{i}].adapters[{j}]", a.name) for j, a in enumerate(server.adapters)]
        for path, name in named:
            if name in first:
                issues.append(ConfigIssue(f"{path}.name", f"duplicate name {name!r} (also {first[name]})"))
            else:
                first[name] = path
    return issues


def _duplicates(section: str, names: list[str]) -> list[ConfigIssue]:
    first: dict[str, int] = {}
    issues = []
    for i, name in enumerate(names):
        if name in first:
            issues.append(
                ConfigIssue(
                    f"{section}[{i}].name", f"duplicate name {name!r} (also {section}[{first[name]}])"
                )
            )
        else:
            first[name] = i
    return issues
