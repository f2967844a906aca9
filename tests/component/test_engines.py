"""Both engines for real on the tiny model: sampling, raw logprobs, streaming, stops, batching, abort,
weight reload. The reference for every logprob is a plain transformers forward pass (float32).

Each engine loads once for the module; the tests run their coroutines on one module-wide event loop
(vLLM's client is bound to the loop it started on).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from support import tied_copy
from transformers import AutoModelForCausalLM

from ajet_hpc.engine.base import (
    Chunk,
    Engine,
    EngineNotRunning,
    PromptTooLong,
    SamplingParams,
    VersionSpan,
    generate_all,
)
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.select import vllm_available
from ajet_hpc.engine.transformers_engine import TransformersEngine, TransformersSettings, job_cpus
from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

pytestmark = pytest.mark.slow

MAX_LEN = 512
TOL = 1e-3
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)

Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("builtin:tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def perturbed(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight moved by N(0, 0.05) noise, saved with save_pretrained."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=noise) * 0.05)
    dest = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def score() -> Callable[[Path, list[int], list[int]], list[float]]:
    """score(model_folder, prompt, response): each response token's raw logprob from a fresh load."""
    models: dict[Path, Any] = {}

    def logprobs(folder: Path, prompt: list[int], response: list[int]) -> list[float]:
        if folder not in models:
            models[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = models[folder](torch.tensor([prompt + response])).logits[0].float()
        table = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        return table.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()

    return logprobs


@pytest.fixture(scope="module")
def transformers_engine(run: Run, tiny: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(tiny, TransformersSettings(max_model_len=MAX_LEN))
    run(engine.start())
    yield engine
    run(stop_with_a_request_in_flight(engine))


@pytest.fixture(scope="module")
def vllm_engine(run: Run, tiny: Path) -> Iterator[VllmEngine]:
    ok, why = vllm_available()
    if not ok:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {why}: a skipped vLLM test would hide the engine check")
        pytest.skip(why)
    engine = VllmEngine(tiny, VllmSettings(max_model_len=MAX_LEN))
    run(engine.start())
    yield engine
    run(stop_with_a_request_in_flight(engine))


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def engine(request: pytest.FixtureRequest) -> Engine:
    return request.getfixturevalue(f"{request.param}_engine")


async def stop_with_a_request_in_flight(engine: Engine) -> None:
    """The engines' teardown, checked: stop() ends the streams in flight with `EngineNotRunning` (the server
    answers it 503: an answer cut by the stop is never served as a finished one)."""
    stream = engine.generate(prompt_of(engine, "Goodbye."), SamplingParams(max_tokens=400), "at-stop")
    chunks = [await anext(stream)]
    await engine.stop()
    with pytest.raises(EngineNotRunning):
        chunks += [chunk async for chunk in stream]
    assert sum(len(c.token_ids) for c in chunks) < 400


def prompt_of(engine: Engine, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    # tokenized and not as a dict: the ids of one conversation (transformers types every return shape)
    assert isinstance(ids, list), type(ids)
    return cast(list[int], ids)


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def collect(engine: Engine, prompt: list[int], params: SamplingParams, request_id: str) -> list[Chunk]:
    return [chunk async for chunk in engine.generate(prompt, params, request_id)]


def test_the_transformers_engine_computes_with_the_jobs_cpus(transformers_engine: TransformersEngine) -> None:
    """On the one thread that computes, torch runs as many threads as the job has CPUs (`job_cpus`)."""
    worker = transformers_engine._worker
    assert worker is not None
    assert worker.submit(torch.get_num_threads).result() == transformers_engine.threads == job_cpus()


def test_engines_meet_the_interface(engine: Engine) -> None:
    assert isinstance(engine, Engine)
    assert engine.name in ("vllm", "transformers")
    assert engine.max_model_len == MAX_LEN
    assert engine.tokenizer.eos_token == "<|im_end|>"


def test_greedy_is_deterministic_and_the_engines_agree(
    run: Run, transformers_engine: TransformersEngine, vllm_engine: VllmEngine, tiny: Path, score
) -> None:
    prompt = prompt_of(vllm_engine, "What is 2+3?")
    params = SamplingParams(max_tokens=48, temperature=0.0)
    hf = [run(generate_all(transformers_engine, prompt, params, f"hf{i}")) for i in range(2)]
    vl = [run(generate_all(vllm_engine, prompt, params, f"vl{i}")) for i in range(2)]
    assert hf[0] == hf[1] and vl[0] == vl[1]
    assert len(vl[0].token_ids) > 8
    # float32 on both sides: they may only part where the model's two best tokens (nearly) tie.
    same = next(
        (i for i, (a, b) in enumerate(zip(hf[0].token_ids, vl[0].token_ids, strict=True)) if a != b), None
    )
    if same is not None:
        lp_hf = score(tiny, prompt, hf[0].token_ids[: same + 1])[-1]
        lp_vl = score(tiny, prompt, vl[0].token_ids[: same + 1])[-1]
        assert abs(lp_hf - lp_vl) < 1e-4, f"the engines part at token {same} without a near-tie"
    else:
        assert hf[0].token_ids == vl[0].token_ids and hf[0].finish_reason == vl[0].finish_reason


@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, seed=3)]
)
def test_logprobs_are_the_raw_model_logprobs(run: Run, engine: Engine, tiny: Path, score, params) -> None:
    """Temperature and top-p shape the sampling, never the reported logprobs."""
    prompt = prompt_of(engine, "Say something.")
    out = run(generate_all(engine, prompt, params, "lp"))
    assert len(out.logprobs) == len(out.token_ids) > 0
    assert max_diff(out.logprobs, score(tiny, prompt, out.token_ids)) < TOL


def test_stream_concatenates_to_the_whole_completion(run: Run, engine: Engine) -> None:
    prompt = prompt_of(engine, "Stream, please.")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    chunks = run(collect(engine, prompt, params, "stream"))
    whole = run(generate_all(engine, prompt, params, "whole"))
    assert len(chunks) > 1
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason is not None
    assert all(len(c.token_ids) == len(c.logprobs) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert max_diff([x for c in chunks for x in c.logprobs], whole.logprobs) < 1e-6


def test_max_tokens_stop_token_ids_and_stop_strings(run: Run, engine: Engine) -> None:
    prompt = prompt_of(engine, "Count: 1, 2, 3")
    free = run(generate_all(engine, prompt, GREEDY, "free"))
    assert (len(free.token_ids), free.finish_reason) == (GREEDY.max_tokens, "length")

    short = run(generate_all(engine, prompt, SamplingParams(max_tokens=5, temperature=0.0), "short"))
    assert (short.token_ids, short.finish_reason) == (free.token_ids[:5], "length")

    # Stop on a token the free run samples later, not first: the stop token is included.
    stop_token = next((t for t in free.token_ids if t != free.token_ids[0]), free.token_ids[0])
    end = free.token_ids.index(stop_token) + 1
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, stop_token_ids=(stop_token,))
    by_token = run(generate_all(engine, prompt, params, "by-token"))
    assert (by_token.token_ids, by_token.finish_reason) == (free.token_ids[:end], "stop")

    # A two-token stop string: generation ends with the token that completes it.
    decode = engine.tokenizer.decode
    stop = decode(free.token_ids[end - 1 : end + 1], skip_special_tokens=True)
    assert isinstance(stop, str)  # one sequence decodes to one string
    end = next(n for n in range(1, len(free.token_ids) + 1) if stop in decode(free.token_ids[:n]))
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, stop=(stop,))
    by_string = run(generate_all(engine, prompt, params, "by-string"))
    assert (by_string.token_ids, by_string.finish_reason) == (free.token_ids[:end], "stop")


def test_prompt_too_long_and_max_tokens_clamped(run: Run, engine: Engine) -> None:
    filler = engine.tokenizer.encode("x")[0]
    with pytest.raises(PromptTooLong, match="max_model_len"):
        run(generate_all(engine, [filler] * MAX_LEN, GREEDY, "too-long"))
    last_room = run(generate_all(engine, [filler] * (MAX_LEN - 1), GREEDY, "last-room"))
    assert len(last_room.token_ids) == 1 and last_room.finish_reason in ("length", "stop")


def test_abort_ends_a_running_request(run: Run, engine: Engine) -> None:
    prompt = prompt_of(engine, "Talk for a long time.")
    params = SamplingParams(max_tokens=400, temperature=0.0)

    async def abort_after(n: int) -> list[Chunk]:
        chunks = []
        async for chunk in engine.generate(prompt, params, "long"):
            chunks.append(chunk)
            if len(chunks) == n:
                await engine.abort("long")
        return chunks

    chunks = run(abort_after(3))
    assert chunks[-1].finish_reason == "abort"
    assert 3 <= sum(len(c.token_ids) for c in chunks) < 400
    run(engine.abort("no-such-request"))  # ignored
    # The id is free again and the engine serves the next request.
    assert run(generate_all(engine, prompt, SamplingParams(max_tokens=4), "long")).finish_reason


def test_leaving_a_stream_early_frees_the_request(run: Run, engine: Engine) -> None:
    prompt = prompt_of(engine, "Talk for a long time.")

    async def first_chunk_only() -> None:
        stream = engine.generate(prompt, SamplingParams(max_tokens=400), "left")
        assert isinstance(stream, AsyncGenerator)  # both engines' generate is an async generator
        await anext(stream)
        await stream.aclose()

    run(first_chunk_only())
    started = time.monotonic()
    assert run(generate_all(engine, prompt, SamplingParams(max_tokens=4), "after")).finish_reason
    assert time.monotonic() - started < 30  # not stuck behind the abandoned 400 tokens


def test_vllm_batches_concurrent_requests(run: Run, vllm_engine: VllmEngine) -> None:
    """32 requests in flight together: every one starts streaming before most of them have ended."""

    async def timed(i: int) -> tuple[float, float, Chunk]:
        first: float | None = None
        tokens: list[int] = []
        reason = None
        async for chunk in vllm_engine.generate(prompt_of(vllm_engine, f"Question {i}"), GREEDY, f"c{i}"):
            first = first or time.monotonic()
            tokens += chunk.token_ids
            reason = chunk.finish_reason
        assert first is not None, f"request c{i} streamed nothing"
        return first, time.monotonic(), Chunk(tokens, [], reason)

    async def all_at_once() -> list[tuple[float, float, Chunk]]:
        return await asyncio.gather(*(timed(i) for i in range(32)))

    results = run(all_at_once())
    assert all(out.finish_reason in ("stop", "length") and out.token_ids for _, _, out in results)
    last_start = max(first for first, _, _ in results)
    still_running = sum(end > last_start for _, end, _ in results)
    assert still_running >= 24, f"only {still_running}/32 requests overlapped: they were not batched"


def test_load_weights_matches_a_fresh_load(
    run: Run, engine: Engine, tiny: Path, perturbed: Path, score
) -> None:
    prompt = prompt_of(engine, "Which weights?")
    before = run(generate_all(engine, prompt, GREEDY, "before"))
    version = engine.policy_version
    # each completion says which weights sampled it (the server records that, not a version read before)
    assert before.versions == (VersionSpan(version, 0, len(before.token_ids)),)
    run(engine.load_weights(perturbed, version + 1))
    try:
        assert engine.policy_version == version + 1
        after = run(generate_all(engine, prompt, GREEDY, "after"))
        assert after.versions == (VersionSpan(version + 1, 0, len(after.token_ids)),)
        assert max_diff(after.logprobs, score(perturbed, prompt, after.token_ids)) < TOL
        assert after.token_ids != before.token_ids or max_diff(after.logprobs, before.logprobs) > 1e-2
    finally:
        run(engine.load_weights(tiny, version + 2))
    assert engine.policy_version == version + 2
    restored = run(generate_all(engine, prompt, GREEDY, "restored"))
    assert restored.token_ids == before.token_ids
    assert max_diff(restored.logprobs, before.logprobs) < TOL


def test_vllm_reload_mid_request_switches_weights_between_tokens(
    run: Run, vllm_engine: VllmEngine, tiny: Path, perturbed: Path, score
) -> None:
    """Tokens sampled before the reload score under the old weights, those after under the new ones
    over the whole prefix: the KV cache of the request in flight was recomputed. The last chunk's
    version spans (vLLM's weight-version tags) split the tokens exactly there."""
    prompt = prompt_of(vllm_engine, "Keep going.")
    version = vllm_engine.policy_version

    async def reload_midway() -> list[Chunk]:
        chunks = []
        async for chunk in vllm_engine.generate(
            prompt, SamplingParams(max_tokens=60, temperature=0.0), "mid"
        ):
            chunks.append(chunk)
            if len(chunks) == 10:
                await vllm_engine.load_weights(perturbed, version + 1)
        return chunks

    try:
        chunks = run(reload_midway())
    finally:
        run(vllm_engine.load_weights(tiny, version + 2))
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [x for c in chunks for x in c.logprobs]
    assert len(tokens) == 60
    old, new = score(tiny, prompt, tokens), score(perturbed, prompt, tokens)
    which = [
        "old" if abs(x - o) < TOL else "new" if abs(x - n) < TOL else "?"
        for x, o, n in zip(logprobs, old, new, strict=True)
    ]
    assert "new" in which, which  # "?": the KV cache of the old weights was kept
    switch = which.index("new")
    assert switch >= 10 and which == ["old"] * switch + ["new"] * (60 - switch), which
    assert chunks[-1].versions == (VersionSpan(version, 0, switch), VersionSpan(version + 1, switch, 60))


@pytest.fixture(scope="module")
def tied_pair(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny model with its output head tied to the input embedding, and that model perturbed."""
    tied = tied_copy(tiny, tmp_path_factory.mktemp("tied"))
    return tied, tied_copy(tiny, tmp_path_factory.mktemp("tied-perturbed"), sigma=0.05)


def test_vllm_loads_tied_embeddings_in_place(run: Run, tied_pair: tuple[Path, Path], score) -> None:
    """vLLM's own reload_weights breaks the tie (FACTS.md); ours keeps the head on the embedding."""
    ok, why = vllm_available()
    if not ok:
        pytest.fail(why) if os.environ.get("CI", "").lower() == "true" else pytest.skip(why)
    tied, trained = tied_pair
    engine = VllmEngine(tied, VllmSettings(max_model_len=MAX_LEN))
    run(engine.start())
    try:
        prompt = prompt_of(engine, "Tied?")
        for version, folder in enumerate((trained, tied, trained), start=1):
            run(engine.load_weights(folder, version))
            out = run(generate_all(engine, prompt, GREEDY, f"tied-{version}"))
            assert max_diff(out.logprobs, score(folder, prompt, out.token_ids)) < 1e-4, folder.name
    finally:
        run(engine.stop())


def test_vllm_processes_survive_the_jobs_signals(run: Run, vllm_engine: VllmEngine) -> None:
    """Slurm signals every process of the job (USR2, and SIGTERM on a preemption); vLLM's engine core
    must not die of them while the server saves: it keeps generating, a request in flight included, and
    still stops when the server stops it (the fixture's teardown)."""
    import signal

    import psutil

    # vLLM names its processes VLLM::EngineCore, VLLM::Worker...; every VLLM:: process gets the signals, as
    # under Slurm. Helpers below them (resource trackers, compile workers, forks that keep their parent's
    # title) come and go, and a signal may end them: CI saw them gone or zombies, twice. What must survive is
    # asserted: the engine core, this process's own child, stays up; its workers are proven alive by the
    # generation that goes on after the signals (with one worker, its death stops the engine core).
    children = psutil.Process().children(recursive=True)
    vllm = [p for p in children if p.name().startswith("VLLM::") and p.is_running()]
    engine = [p for p in psutil.Process().children() if p.name().startswith("VLLM::EngineCore")]
    assert engine, [p.name() for p in children]
    prompt = prompt_of(vllm_engine, "Still there?")

    async def signalled_mid_request() -> Any:
        stream = vllm_engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0), "sig")
        chunks = [await anext(stream)]
        for process in vllm:
            process.send_signal(signal.SIGUSR2)
            process.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)  # vLLM's own handler would have shut the engine core down by now
        return chunks + [chunk async for chunk in stream]

    chunks = run(signalled_mid_request())
    assert chunks[-1].finish_reason in ("stop", "length")
    assert all(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine), engine
    after = run(generate_all(vllm_engine, prompt, GREEDY, "after-signals"))
    assert after.finish_reason in ("stop", "length") and after.token_ids
