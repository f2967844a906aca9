"""The debug engine: plain transformers, one request at a time, token by token with a KV cache.

For debugging and for machines without vLLM. Requests are served one at a time, in arrival order, by a
single worker thread (the event loop never blocks); a request waiting its turn can still be aborted.
`load_weights` runs on the same thread, so it takes effect between requests. Sampling follows vLLM's
rules (greedy below ``GREEDY_EPS``, then temperature, then top-p), and the reported log-probabilities
are raw (see `ajet_hpc.engine.base`). With ``lora_adapter`` the model is wrapped by peft with that
adapter (the version-0 one, `ajet_hpc.engine.adapter`), and `load_weights` of an adapter folder replaces
the adapter's tensors in place (``set_peft_model_state_dict``).

On the CPU, torch computes with as many threads as the job has CPUs (`job_cpus`), not as many as the node
has cores: where Slurm does not bind a job to its cores, torch's default (every core it may run on) spun
its threads against the node's other jobs, up to 45 times slower per token on the dev cluster.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class TransformersSettings:
    """Settings of the transformers engine."""

    dtype: str = "auto"
    """Weights' dtype: "auto" is bfloat16 on a GPU and float32 on the CPU."""
    max_model_len: int = 2048
    """Most tokens of prompt + completion (capped by the model's max_position_embeddings)."""
    device: str = "auto"
    """torch device: "auto" is cuda when available, else cpu."""
    seed: int = 0
    """Seeds the random stream of requests that give no seed of their own."""
    lora_adapter: str | None = None
    """A peft adapter folder: serve the model with a LoRA adapter, starting with this one; None: the
    model's own weights."""
    cpu_threads: int | None = None
    """torch's threads on the CPU; None: the job's CPUs (`job_cpus`)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 (or None: the job's CPUs), got {self.cpu_threads}")


def job_cpus(environ: Mapping[str, str] = os.environ) -> int:
    """The CPUs this process may use: the cores it may run on, no more than its Slurm job was given
    (``SLURM_CPUS_PER_TASK``: a cluster that does not bind jobs to cores still grants only that many)."""
    usable = len(os.sched_getaffinity(0))
    granted = environ.get("SLURM_CPUS_PER_TASK", "")
    return min(usable, int(granted)) if granted.isdigit() and int(granted) > 0 else usable


@dataclass
class _Request:
    """One request's mailbox between the worker thread and the async consumer."""

    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, item: Chunk | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)


class TransformersEngine(EngineLifecycle):
    """`ajet_hpc.engine.base.Engine` on transformers' ``AutoModelForCausalLM`` (see the module doc)."""

    name = "transformers"

    def __init__(self, model_path: Path, settings: TransformersSettings | None = None) -> None:
        self.model_path = Path(model_path)
        self.settings = settings or TransformersSettings()
        self.max_model_len = self.settings.max_model_len
        self.policy_version = 0
        # the version of the weights the model holds, set on the worker thread with them: a request runs
        # whole on that thread, so every token of it comes from this version (`Chunk.versions`)
        self._weights_version = 0
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._model: Any = None
        self._device: torch.device | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._generator: torch.Generator | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._requests: dict[str, _Request] = {}
        self.threads: int | None = None  # torch's threads on the CPU, once started

    async def start(self) -> None:
        if self._worker is not None:
            return
        offline_hub()
        started = time.monotonic()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers-engine")
        try:
            await asyncio.get_running_loop().run_in_executor(self._worker, self._load)
        except BaseException:
            self._worker.shutdown(wait=False)
            self._worker = None
            raise
        log.info(
            "transformers engine: loaded %s on %s (%s%s) in %.1f s",
            self.model_path,
            self._device,
            self._model.dtype,
            f", {self.threads} thread(s)" if self.threads else "",
            time.monotonic() - started,
        )

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        settings = self.settings
        device = (
            settings.device if settings.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        )
        dtype = settings.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=getattr(torch, dtype), local_files_only=True
        )
        if settings.lora_adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, settings.lora_adapter, is_trainable=False)
        self._model = model.to(device).eval()
        self._device = torch.device(device)
        if self._device.type == "cpu":  # here, on the one thread that computes: OpenMP's count is per thread
            self.threads = settings.cpu_threads or job_cpus()
            torch.set_num_threads(self.threads)
        self.max_model_len = min(settings.max_model_len, model.config.max_position_embeddings)
        self._eos_ids = _eos_ids(self._tokenizer, model)
        self._generator = torch.Generator(device).manual_seed(settings.seed)

    async def stop(self) -> None:
        """Abort every request and release the model."""
        for state in self._requests.values():
            state.cancelled.set()
        if self._worker is not None:
            worker, self._worker = self._worker, None
            await asyncio.get_running_loop().run_in_executor(None, worker.shutdown)
        self._model = None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, *, stream: bool = True
    ) -> AsyncIterator[Chunk]:
        if self._worker is None:
            raise EngineNotRunning(NOT_RUNNING)
        max_tokens = check_prompt(
            prompt_ids, self._model.config.vocab_size, params.max_tokens, self.max_model_len
        )
        if request_id in self._requests:
            raise EngineError(f"request id {request_id!r} is already in flight")
        state = _Request(asyncio.get_running_loop())
        self._requests[request_id] = state
        self._worker.submit(self._run, list(prompt_ids), params, max_tokens, state)
        try:
            while True:
                item = await state.chunks.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"request {request_id} failed: {item!r}") from item
                if item.finish_reason == "abort" and self._worker is None:  # cut by `stop`: no answer
                    raise EngineNotRunning(NOT_RUNNING)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            state.cancelled.set()  # the consumer left early: stop computing
            self._requests.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None:
            state.cancelled.set()

    def _run(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, state: _Request) -> None:
        try:
            self._decode(prompt_ids, params, max_tokens, state)
        except Exception as error:
            log.exception("transformers engine: request failed")
            state.put(error)

    def _decode(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens: int, state: _Request
    ) -> None:
        import torch

        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(self._device).manual_seed(params.seed)
        if generator is None:
            raise EngineNotRunning(NOT_RUNNING)
        stop_ids = self._eos_ids | set(params.stop_token_ids)
        inputs = torch.tensor([prompt_ids], device=self._device)
        cache = None
        sampled: list[int] = []
        text = ""
        with torch.inference_mode():
            for step in range(max_tokens):
                if state.cancelled.is_set():
                    state.put(Chunk([], [], "abort"))
                    return
                out = self._model(input_ids=inputs, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                token, logprob = sample(out.logits[0, -1], params, generator)
                sampled.append(token)
                finish: FinishReason | None = None
                if token in stop_ids:
                    finish = "stop"
                elif params.stop:
                    new_text = self.tokenizer.decode(sampled, skip_special_tokens=True)
                    if not isinstance(new_text, str):  # a list only for a batch of sequences
                        raise TypeError(f"decoding one sequence gave a {type(new_text).__name__}")
                    if completes_stop_string(new_text, len(new_text) - len(text), params.stop):
                        finish = "stop"
                    text = new_text
                if finish is None and step == max_tokens - 1:
                    finish = "length"
                if finish is None:
                    state.put(Chunk([token], [logprob]))
                else:
                    span = VersionSpan(self._weights_version, 0, len(sampled))
                    state.put(Chunk([token], [logprob], finish, (span,)))
                    return
                inputs = torch.tensor([[token]], device=self._device)

    async def load_weights(self, path: Path, version: int) -> None:
        """Copy the weights of a ``save_pretrained`` folder (safetensors) into the model, in place.

        Runs on the worker thread: requests before it finish on the old weights, later ones use the new.
        """
        if self._worker is None:
            raise EngineNotRunning(NOT_RUNNING)
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(
            self._worker, self._load_version, Path(path), version
        )
        self.policy_version = version
        log.info(
            "transformers engine: loaded weights %s as policy version %d in %.3f s",
            path,
            version,
            time.monotonic() - started,
        )

    def _load_version(self, path: Path, version: int) -> None:
        self._copy_weights(path)
        self._weights_version = version

    def _copy_weights(self, path: Path) -> None:
        import torch
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise EngineError(f"load_weights: no *.safetensors file in {path} (save with save_pretrained)")
        loaded: dict[str, torch.Tensor] = {}
        for file in files:
            loaded.update(load_file(file))
        served = self.settings.lora_adapter is not None
        mismatch = kind_mismatch(path, served)
        if mismatch is not None:
            raise EngineError(mismatch)
        if served:
            self._copy_adapter(path, loaded)
            return
        params = self._model.state_dict()
        unexpected = sorted(set(loaded) - set(params))
        if unexpected:
            raise EngineError(f"load_weights: {path} holds tensors the model lacks: {unexpected[:5]}")
        loaded_ptrs = {params[name].data_ptr() for name in loaded}
        missing = [n for n in params if n not in loaded and params[n].data_ptr() not in loaded_ptrs]
        if missing:  # a tied weight (one storage, two names) counts as loaded
            raise EngineError(f"load_weights: {path} lacks tensors of the model: {missing[:5]}")
        with torch.no_grad():
            for name, tensor in loaded.items():
                if params[name].shape != tensor.shape:
                    raise EngineError(
                        f"load_weights: {name} has shape {tuple(tensor.shape)} in {path}, "
                        f"{tuple(params[name].shape)} in the model"
                    )
                params[name].copy_(tensor)

    def _copy_adapter(self, path: Path, loaded: dict[str, torch.Tensor]) -> None:
        """Replace the served adapter's tensors with those of the folder (the same modules and ranks)."""
        import torch
        from peft import set_peft_model_state_dict

        try:
            with torch.no_grad():
                result: Any = set_peft_model_state_dict(self._model, loaded)
        except RuntimeError as error:  # a shape that differs (another rank)
            raise EngineError(f"load_weights: adapter {path} does not fit the served one: {error}") from error
        unexpected = sorted(result.unexpected_keys)
        missing = sorted(k for k in result.missing_keys if "lora_" in k)
        if unexpected or missing:
            raise EngineError(
                f"load_weights: adapter {path} does not match the served one: holds {unexpected[:3]} the "
                f"model lacks, lacks {missing[:3]}"
            )


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """One token from the last position's logits, and its raw log-probability (temperature 1, no top-p)."""
    import torch

    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(raw[token])
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        # Keep the most likely tokens whose mass reaches top_p (always at least the first).
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs[before >= params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(raw[token])


def completes_stop_string(text: str, new_chars: int, stops: tuple[str, ...]) -> bool:
    """Whether a stop string ends within the last ``new_chars`` characters of ``text`` (vLLM's rule)."""
    return any(text.find(stop, max(0, len(text) - new_chars - len(stop) + 1)) != -1 for stop in stops)


def _eos_ids(tokenizer: PreTrainedTokenizerBase, model: Any) -> frozenset[int]:
    """The ids that always stop: the tokenizer's EOS and the generation config's (as vLLM reads them)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids |= {configured} if isinstance(configured, int) else set(configured)
    return frozenset(ids)
