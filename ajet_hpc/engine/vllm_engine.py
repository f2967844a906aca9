"""The production engine: vLLM's ``AsyncLLM`` (v1), continuously batching concurrent requests.

vLLM runs the model in its own processes (EngineCore and a worker); this process holds the client, which
streams each request's outputs as deltas (``RequestOutputKind.DELTA``), one token per engine step.
Log-probabilities are requested for the sampled token only (``logprobs=0``) in vLLM's default
``logprobs_mode="raw_logprobs"``, set explicitly here: the model's log-softmax before temperature and top-p.

Weights are reloaded in place (`load_weights`, through our worker extension ``vllm_worker``) between
engine steps, with generation paused, and the KV cache of requests in flight is recomputed with the new
weights: every token sampled after ``load_weights`` returns comes from the new weights. With placement
colocate the engine sleeps (vLLM sleep mode, level 1) while the trainer's ranks use the GPUs.

With ``lora_adapters`` the engine serves named LoRA adapters of its base model (vLLM's multi-LoRA,
``enable_lora``), one or several, each starting as the given folder (a trained one's version-0 adapter,
`ajet_hpc.engine.adapter`); a request names its adapter (``generate(..., adapter=name)``; none, or
`BARE_BASE`, runs the base without any), and `load_adapter` replaces one in place (``add_lora`` with
``load_inplace``) under the same pause, prefix-cache reset and version tag as `load_weights`. Every model
of a server that serves adapters, a lone LoRA model included, sees the engine through its own
`ajet_hpc.engine.shared.SharedModel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from ajet_hpc.engine.adapter import kind_mismatch
from ajet_hpc.engine.base import (
    NOT_RUNNING,
    Chunk,
    EngineError,
    EngineLifecycle,
    EngineNotRunning,
    FinishReason,
    SamplingParams,
    VersionSpan,
    check_prompt,
)
from ajet_hpc.engine.model_path import offline_hub
from ajet_hpc.engine.vllm_signals import STOPPING_VAR
from ajet_hpc.engine.vllm_worker import EXTENSION as WORKER_EXTENSION

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
BARE_BASE = ""
"""``generate(..., adapter=BARE_BASE)``: the base model's own weights, no adapter."""


@dataclass(frozen=True)
class VllmSettings:
    """Settings of the vLLM engine."""

    dtype: Dtype = "auto"
    """Weights' dtype: "auto" is bfloat16 on a GPU and float32 on the CPU."""
    max_model_len: int = 2048
    """Most tokens of prompt + completion."""
    gpu_memory_utilization: float = 0.85
    """Share of the GPU's memory vLLM may take (weights + KV cache). Unused on the CPU."""
    cpu_kv_cache_gib: int = 1
    """KV cache size on the CPU (VLLM_CPU_KVCACHE_SPACE) unless that variable is already set."""
    enforce_eager: bool | None = None
    """No CUDA graphs / compilation; None: True on the CPU, False on a GPU."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (reset on every weight reload)."""
    seed: int = 0
    """Seeds the random stream of requests that give no seed of their own."""
    tensor_parallel_size: int = 1
    """GPUs the engine spreads the model over (the server's ``engine.gpus``)."""
    max_num_seqs: int = 256
    """Most requests batched in one engine step."""
    enable_sleep_mode: bool = False
    """Let the engine free its GPU memory while the trainer runs (placement colocate; CUDA only)."""
    weight_transfer_backend: str | None = None
    """vLLM weight-transfer backend for in-memory syncs (``nccl``, ``ipc``, ``ajet_gloo``); None: reloads
    from disk only."""
    lora_adapters: tuple[tuple[str, str], ...] = ()
    """The LoRA adapters served (see the module doc): (name, first folder) each; a request names its own."""
    max_loras: int = 1
    """With LoRA: adapters vLLM holds on the device at once (at least as many as it serves)."""
    max_lora_rank: int = 16
    """With LoRA: the largest adapter rank vLLM serves (one of vLLM's LoRA ranks)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        names = [name for name, _ in self.lora_adapters]
        if len(set(names)) != len(names) or BARE_BASE in names:
            raise ValueError(f"adapter names must be distinct and not empty, got {names}")
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} adapters need max_loras >= {len(names)}, got {self.max_loras}")
        if self.tensor_parallel_size < 1 or self.max_num_seqs < 1:
            raise ValueError("tensor_parallel_size and max_num_seqs must be >= 1")
        if self.cpu_kv_cache_gib < 1:
            raise ValueError(f"cpu_kv_cache_gib must be >= 1, got {self.cpu_kv_cache_gib}")


class VllmEngine(EngineLifecycle):
    """`ajet_hpc.engine.base.Engine` on vLLM's ``AsyncLLM`` (see the module doc)."""

    name = "vllm"

    def __init__(self, model_path: Path, settings: VllmSettings | None = None) -> None:
        self.model_path = Path(model_path)
        self.settings = settings or VllmSettings()
        self.max_model_len = self.settings.max_model_len
        self.policy_version = 0
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._llm: Any = None
        self._vocab_size = 0
        self._asleep = False
        self._update_started: float | None = None  # when generation paused for an in-memory sync
        self.last_pause_s = 0.0
        """How long generation waited during the last weight sync."""
        self._reload_lock: asyncio.Lock | None = None
        self._in_flight: set[str] = set()
        self._stopping = Path(os.devnull)  # set by start()
        self._adapters: dict[str, Any] = {}  # name -> the LoRARequest of every served adapter
        # the policy version of each served model ("": the full weights, else an adapter's name), which
        # vLLM's weight-version tag carries as JSON: each output token is tagged with the versions of the
        # weights that sampled it, and a request's final output spans them (`_version_spans`)
        self._versions: dict[str, int] = {}

    async def start(self) -> None:
        if self._llm is not None:
            return
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        offline_hub()
        started = time.monotonic()
        on_cpu = current_platform.is_cpu()
        settings = self.settings
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kv_cache_gib))
        # inherited by vLLM's processes (see vllm_signals.shield_from_job_signals); created by stop()
        self._stopping = Path(tempfile.mkdtemp(prefix="ajet-engine-")) / "stopping"
        os.environ[STOPPING_VAR] = str(self._stopping)
        dtype: Dtype = settings.dtype if settings.dtype != "auto" else "float32" if on_cpu else "bfloat16"
        config = json.loads((self.model_path / "config.json").read_text())
        self._vocab_size = config["vocab_size"]
        if settings.enable_sleep_mode and on_cpu:
            raise EngineError("sleep mode (placement colocate) needs CUDA; vLLM has none on the CPU")
        args = AsyncEngineArgs(
            model=str(self.model_path),
            dtype=dtype,
            max_model_len=settings.max_model_len,
            enforce_eager=on_cpu if settings.enforce_eager is None else settings.enforce_eager,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enable_prefix_caching=settings.enable_prefix_caching,
            seed=settings.seed,
            logprobs_mode="raw_logprobs",
            # vLLM's per-iteration statistics feed its Prometheus endpoint and its periodic log line, which
            # a server of ours has neither: computing them was ~5 % of the server process's CPU
            disable_log_stats=True,
            tensor_parallel_size=settings.tensor_parallel_size,
            max_num_seqs=settings.max_num_seqs,
            enable_sleep_mode=settings.enable_sleep_mode,
            worker_extension_cls=WORKER_EXTENSION,
            **_weight_transfer_args(settings.weight_transfer_backend),
            **_lora_args(settings),
        )
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        # Building the engine blocks for a while (it spawns and waits for its processes): off the loop.
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self._reload_lock = asyncio.Lock()
        for name, folder in settings.lora_adapters:
            await self._add_adapter(name, Path(folder), inplace=False)
        self._versions = {"": self.policy_version} | {name: 0 for name in self._adapters}
        await self._llm.update_weight_version(json.dumps(self._versions, sort_keys=True))
        log.info(
            "vllm engine: loaded %s (%s, %s, max_model_len %d) in %.1f s",
            self.model_path,
            current_platform.device_type,
            dtype,
            self.max_model_len,
            time.monotonic() - started,
        )

    @property
    def failure(self) -> str | None:
        """Why the engine can serve no more (vLLM's engine core process died or its output loop ended),
        or None; the server's watchdog acts on it (``ajet_hpc.server.watchdog``)."""
        llm = self._llm
        if llm is None or not llm.errored:
            return None
        return "vLLM's engine core process died"

    async def stop(self) -> None:
        """Shut the engine's processes down (requests in flight end with "abort")."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        started = time.monotonic()
        with contextlib.suppress(OSError):
            self._stopping.touch()  # vLLM's processes obey the SIGTERM of its shutdown now
        if self._in_flight:
            await llm.abort(list(self._in_flight))  # their streams get their final "abort" output now
        if llm.output_handler is not None:  # else it may log the engine's death as a failure
            llm.output_handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await llm.output_handler
        await asyncio.to_thread(llm.shutdown)
        # AsyncLLM.__del__ shuts down again; run it now, not at interpreter exit (where it fails).
        del llm
        shutil.rmtree(self._stopping.parent, ignore_errors=True)
        log.info("vllm engine: stopped in %.1f s", time.monotonic() - started)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        stream: bool = True,
        adapter: str | None = None,
    ) -> AsyncIterator[Chunk]:
        """`Engine.generate`; ``adapter`` names the served adapter to run with (None or `BARE_BASE`:
        none, the base's own weights)."""
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import tokens_input

        if self._llm is None:
            raise EngineNotRunning(NOT_RUNNING)
        lora = self._adapters.get(adapter) if adapter else None
        if adapter and lora is None:
            raise EngineError(f"no adapter named {adapter!r}; the engine serves {sorted(self._adapters)}")
        max_tokens = check_prompt(prompt_ids, self._vocab_size, params.max_tokens, self.max_model_len)
        if request_id in self._in_flight:
            raise EngineError(f"request id {request_id!r} is already in flight")
        outputs = self._llm.generate(
            tokens_input(list(prompt_ids)),
            _vllm_params(params, max_tokens, stream),
            request_id,
            lora_request=lora,
        )
        self._in_flight.add(request_id)
        key = "" if lora is None else lora.lora_name
        try:
            async for output in outputs:
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                finish = completion.finish_reason
                if not token_ids and finish is None:
                    continue
                if finish is not None and finish not in _FINISH_REASONS:
                    raise EngineError(f"request {request_id}: vLLM finished it with {finish!r}")
                if finish == "abort" and self._llm is None:  # cut by `stop`: no answer, the server goes
                    raise EngineNotRunning(NOT_RUNNING)
                logprobs = _sampled_logprobs(token_ids, completion.logprobs)
                if len(logprobs) != len(token_ids):
                    raise EngineError(f"request {request_id}: vLLM returned no logprob for some tokens")
                if finish is None:
                    yield Chunk(token_ids, logprobs)
                else:
                    spans = _version_spans(completion.weight_versions, key)
                    yield Chunk(token_ids, logprobs, _FINISH_REASONS[finish], spans)
        except (VLLMValidationError, ValueError) as error:
            raise EngineError(f"request {request_id}: {error}") from error
        finally:
            self._in_flight.discard(request_id)
            await outputs.aclose()  # aborts the request in vLLM when the consumer left early

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def load_weights(self, path: Path, version: int) -> None:
        """Load the weights of a ``save_pretrained`` folder in place, without restarting vLLM.

        Generation pauses (requests in flight are kept), each worker reloads the checkpoint into its model's
        parameters (`vllm_worker`: tied embeddings stay tied), the prefix cache is dropped and requests in
        flight recompute their KV cache under the new weights, then generation resumes. A sleeping engine
        (placement colocate) is woken first.
        """
        if self._llm is None or self._reload_lock is None:
            raise EngineNotRunning(NOT_RUNNING)
        path = Path(path)
        if not any(path.glob("*.safetensors")):
            raise EngineError(f"load_weights: no *.safetensors file in {path} (save with save_pretrained)")
        mismatch = kind_mismatch(path, False)
        if mismatch is not None:
            raise EngineError(mismatch)
        if self._asleep:
            await self.wake_up()

        def tag() -> None:
            self.policy_version = version

        async def reload() -> None:
            await self._llm.collective_rpc("ajet_reload_weights", kwargs={"weights_path": str(path)})

        await self._paused_reload(reload, f"weights {path}", version, tag, key="")

    async def load_adapter(self, name: str, path: Path, version: int, tag: Callable[[], None]) -> None:
        """Replace the served adapter ``name`` by the folder ``path`` in place, as `load_weights` does for
        the full weights (a sleeping engine woken first); ``tag`` runs before generation resumes (the
        model's policy version)."""
        if self._llm is None or self._reload_lock is None:
            raise EngineNotRunning(NOT_RUNNING)
        if name not in self._adapters:
            raise EngineError(f"no adapter named {name!r}; the engine serves {sorted(self._adapters)}")
        path = Path(path)
        mismatch = kind_mismatch(path, True)
        if mismatch is not None:
            raise EngineError(mismatch)
        if self._asleep:
            await self.wake_up()

        async def reload() -> None:
            await self._add_adapter(name, path, inplace=True)

        await self._paused_reload(reload, f"adapter {name} from {path}", version, tag, key=name)

    async def _paused_reload(
        self,
        reload: Callable[[], Awaitable[None]],
        what: str,
        version: int,
        tag: Callable[[], None],
        key: str,
    ) -> None:
        """``reload`` with generation paused; then the prefix cache is reset (requests in flight recompute
        their KV cache: for an adapter, the prefix cache keys blocks by adapter, but its requests in flight
        hold KV of its old weights), the model ``key`` is tagged as ``version`` (vLLM's weight version and
        ``tag``), and generation resumes."""
        assert self._reload_lock is not None
        async with self._reload_lock:
            started = time.monotonic()
            llm = self._llm
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await reload()
                await llm.reset_prefix_cache(reset_running_requests=True)
                await self._tag_weights(key, version)
                tag()  # before any token of the new weights streams out
            finally:
                await llm.resume_generation()
            log.info(
                "vllm engine: loaded %s as policy version %d in %.3f s",
                what,
                version,
                time.monotonic() - started,
            )

    async def _tag_weights(self, key: str, version: int) -> None:
        """The tokens sampled from now on come from version ``version`` of the model ``key``."""
        self._versions[key] = version
        await self._llm.update_weight_version(json.dumps(self._versions, sort_keys=True))

    async def _add_adapter(self, name: str, path: Path, inplace: bool) -> None:
        """Load the adapter folder into vLLM as the adapter ``name`` (its id kept), in place of the one
        there; requests then carry a request naming it (without ``load_inplace``, which would reload per
        use)."""
        from vllm.lora.request import LoRARequest

        known = self._adapters.get(name)
        lora_id = known.lora_int_id if known is not None else len(self._adapters) + 1
        try:
            loaded = await self._llm.add_lora(LoRARequest(name, lora_id, str(path), load_inplace=inplace))
        except Exception as error:  # vLLM's message names the shape or rank it refused
            raise EngineError(f"vLLM refused the LoRA adapter {path}: {error}") from error
        if not loaded:
            raise EngineError(f"vLLM did not load the LoRA adapter {path}")
        self._adapters[name] = LoRARequest(name, lora_id, str(path))

    # ---- in-memory weight sync (vLLM's weight-transfer API, driven by trainer/ranks/weight_sync.py)

    async def weight_transfer(self, method: str, argument) -> None:
        """One control call of an in-memory sync, as the trainer's sender asks for it: set up the transfer
        group, start (generation pauses), receive (the weights arrive over the group), finish (the weights
        are tagged with ``argument`` as their policy version, the prefix cache is reset, generation resumes).
        """
        if self._llm is None:
            raise EngineNotRunning(NOT_RUNNING)
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        llm = self._llm
        if method == "init_weight_transfer_engine":
            await llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=argument))
        elif method == "start_weight_update":
            if self._asleep:
                await self.wake_up()
            await llm.pause_generation(mode="keep", clear_cache=False)
            self._update_started = time.monotonic()
            try:
                await llm.start_weight_update()
            except BaseException:
                await self._end_update()
                raise
        elif method == "update_weights":
            try:
                await llm.update_weights(WeightTransferUpdateRequest(update_info=argument))
            except BaseException:
                await self._end_update(failed=True)
                raise
        elif method == "finish_weight_update":
            try:
                await llm.finish_weight_update()
                await llm.collective_rpc("ajet_retie_output_head")
                await llm.reset_prefix_cache(reset_running_requests=True)
                if argument is not None:
                    await self._tag_weights("", int(argument))
                    self.policy_version = int(argument)  # before any token of the new weights streams out
            finally:
                await self._end_update()
        else:
            raise EngineError(f"unknown weight-transfer call {method!r}")

    async def abandon_weight_update(self) -> None:
        """The server's job is ending during a sync whose sender stopped (``sync_channel.JOB_ENDING``):
        generation resumes on a servable model, as after a failed sync; nothing when no sync is open."""
        await self._end_update(failed=True)

    async def _end_update(self, failed: bool = False) -> None:
        """Resume generation after a sync; after a failed one first put the model back in a servable state
        (the layers that arrived keep their new values, the others their old ones: the trainer's restart
        from its last checkpoint sends a whole model again)."""
        if self._update_started is None:
            return
        if failed:
            await self._llm.collective_rpc("ajet_abort_weight_update")
        self.last_pause_s = time.monotonic() - self._update_started
        self._update_started = None
        await self._llm.resume_generation()

    async def sleep(self) -> float:
        """Free the engine's GPU memory (sleep level 1: weights to host memory, KV cache dropped) while the
        trainer runs; requests in flight wait. Returns the seconds it took; 0 without sleep mode."""
        if self._llm is None or not self.settings.enable_sleep_mode or self._asleep:
            return 0.0
        started = time.monotonic()
        await self._llm.sleep(level=1, mode="keep")
        self._asleep = True
        return time.monotonic() - started

    async def wake_up(self) -> float:
        """Bring the weights and KV cache back after `sleep`; the seconds it took (0 when awake)."""
        if self._llm is None or not self._asleep:
            return 0.0
        started = time.monotonic()
        await self._llm.wake_up()
        await self._llm.reset_prefix_cache(reset_running_requests=True)
        self._asleep = False
        return time.monotonic() - started


def _lora_args(settings: VllmSettings) -> dict[str, Any]:
    if not settings.lora_adapters:
        return {}
    return {"enable_lora": True, "max_loras": settings.max_loras, "max_lora_rank": settings.max_lora_rank}


def _weight_transfer_args(backend: str | None) -> dict[str, Any]:
    if backend is None:
        return {}
    from vllm.config.weight_transfer import WeightTransferConfig

    if backend.startswith("ajet_"):
        from ajet_hpc.engine.weight_transfer import register

        register()  # in this process; the workers register it through our vLLM plugin entry point
    return {"weight_transfer_config": WeightTransferConfig(backend=backend)}


def _version_spans(spans: Any, key: str) -> tuple[VersionSpan, ...]:
    """vLLM's weight-version spans of a request's output tokens as the policy versions of the model
    ``key`` (neighbours of one version joined); () where a span carries no tag of ours."""
    joined: list[VersionSpan] = []
    for span in spans or ():
        try:
            version = json.loads(span.version)[key]
        except (ValueError, KeyError, TypeError):  # vLLM's "default", before start() tagged the engine
            return ()
        if joined and joined[-1].version == version:
            joined[-1] = VersionSpan(version, joined[-1].start, span.end)
        else:
            joined.append(VersionSpan(version, span.start, span.end))
    return tuple(joined)


def _sampled_logprobs(token_ids: list[int], found: Any) -> list[float]:
    """The logprob of each sampled token. ``flat_logprobs`` gives one flat list per field, and with
    ``logprobs=0`` one entry per position (the sampled token): read it as it is, without building a
    ``{token: Logprob}`` dict per token."""
    if found is None:
        return []
    flat_ids = getattr(found, "token_ids", None)
    if flat_ids is not None and list(flat_ids) == token_ids:
        return list(found.logprobs)
    return [entry[token].logprob for token, entry in zip(token_ids, found, strict=False)]


def _vllm_params(params: SamplingParams, max_tokens: int, stream: bool) -> Any:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        logprobs=0,  # the sampled token's logprob only
        flat_logprobs=True,  # a few flat lists per request instead of a dict and a Logprob per token
        # streamed: one output per step with the new tokens; else one output at the end, as `vllm serve`
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        skip_special_tokens=True,  # stop strings are matched on this text
        # vLLM's text is not used (the server decodes the ids itself): without stop strings, skip its
        # incremental detokenizer and the decoding of every logprob's token in the API process
        detokenize=bool(params.stop),
        skip_clone=True,  # made for this one request: vLLM need not deep-copy it (as `vllm serve`'s are)
    )
