"""The engine a server job runs and how it serves agents: ``engine`` (its kind, weights, GPUs and ``vllm``,
the vLLM engine's settings) and ``serving`` (limits, episodes, TLS, connections)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from ajet_hpc.config.fields import MODEL_CONFIG, ModelSource, NotBool
from ajet_hpc.config.lora import VLLM_LORA_RANKS


class ServingConfig(BaseModel):
    """How a server serves agents: context length, limits, episodes and tokens."""

    model_config = MODEL_CONFIG

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

    model_config = MODEL_CONFIG

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
        "(those with trainer.lora, and those served from an adapter folder); null: exactly that many.",
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


class EngineConfig(BaseModel):
    """The one inference engine of a server job: its kind, the base model's weights, its GPUs, and vLLM's
    settings. Every model of the job is served by it (the base, or a LoRA adapter of the base)."""

    model_config = MODEL_CONFIG

    kind: Literal["auto", "vllm", "transformers"] = Field(
        default="auto", description="Inference engine; 'auto' picks vLLM when it is installed."
    )
    model: ModelSource = Field(description="Model weights: 'builtin:tiny' or a local path.")
    gpus: int = Field(
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
