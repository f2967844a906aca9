"""One training step at the Qwen2.5 vocabulary: today's full output layer against the chunked one.

    .venv/bin/python tools/bench/output_layer.py            # full: 8k tokens, 1.5k trained, 3 timed pairs
    .venv/bin/python tools/bench/output_layer.py --quick    # 2k tokens, 384 trained, 1 pair (a smoke check)
    .venv/bin/python tools/bench/output_layer.py --quick --vocab 4096   # the smoke test's: it runs, no figure

The model is a randomly initialised two-layer Qwen2 (hidden 128, tied embeddings, as ``builtin:tiny-qwen``)
with Qwen2.5's 151,643-token vocabulary (``--vocab`` sets another, for a run that only checks the script:
the figures are the full vocabulary's), built here (no download), float32 on the CPU. The step is 8
samples of 1,024 tokens, each with three 64-token answers of the model (loss mask 1): 8,192 tokens, 1,536
trained. Both computations run the trainer's loop without DeepSpeed (``trainer/ranks/step.py`` adds only the
gradient reduction): micro-batches of ``micro_batch_tokens`` 2,048 (today's path on one 8k micro-batch would
hold ~25 GB of float32 vocabulary tensors, more than this machine has), per micro-batch the GRPO loss with
the step's normaliser and a backward, the entropy metric, and one AdamW step.

- **old**: today's computation, kept here: ``model(**inputs).logits`` at every position, ``token_logprobs``
  and ``entropy_from_logits`` over the full vocabulary.
- **new**: ``ajet_hpc.algo.output_layer.model_logprobs`` with the default ``logits_chunk_tokens``.

``vocab_speedup`` = old / new median step time over paired runs (alternating, ABBA). ``logits_mem_ratio`` =
new / old peak bytes allocated during the micro-batches' forwards and backwards (the entropy included, the
optimizer step not), from torch.profiler's memory events: everything allocated there is counted against
the output layer, though the two-layer body and the embedding gradient are in it too (so the ratio is an
upper bound). The last line is ``RESULT vocab_speedup=<x> logits_mem_ratio=<f>``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ajet_hpc.algo.grpo import entropy_from_logits, policy_loss, token_logprobs  # noqa: E402
from ajet_hpc.algo.output_layer import model_logprobs  # noqa: E402
from ajet_hpc.algo.sample_tensors import Sample, collate, pack_micro_batches  # noqa: E402
from ajet_hpc.config.trainer import TrainerConfig  # noqa: E402
from ajet_hpc.engine import tiny_qwen  # noqa: E402
from ajet_hpc.trainer.ranks.step import model_inputs  # noqa: E402

VOCAB = 151_643
SAMPLE_TOKENS = 1024
ANSWERS, ANSWER_TOKENS = 3, 64
MICRO_BATCH_TOKENS = 2048


def build_model(vocab: int = VOCAB, seed: int = 0):
    """``builtin:tiny-qwen``'s network with a ``vocab``-token vocabulary (no padding rows, no pad id)."""
    model = tiny_qwen.build_model(vocab, seed)
    model.config.use_cache = False
    return model.float().train()


def workload(samples: int, vocab: int = VOCAB, seed: int = 0) -> list[Sample]:
    """``samples`` sequences of SAMPLE_TOKENS random tokens below ``vocab``, each with ANSWERS trained
    answers."""
    rng = random.Random(seed)
    out = []
    gap = SAMPLE_TOKENS // ANSWERS
    for i in range(samples):
        mask = [0] * SAMPLE_TOKENS
        for a in range(ANSWERS):
            start = (a + 1) * gap - ANSWER_TOKENS
            mask[start : start + ANSWER_TOKENS] = [1] * ANSWER_TOKENS
        out.append(
            Sample(
                token_ids=[rng.randrange(vocab) for _ in range(SAMPLE_TOKENS)],
                loss_mask=mask,
                old_logprobs=[-rng.uniform(1, 12) * m for m in mask],
                advantages=[(1.0 if i % 2 else -1.0) * m for m in mask],
                policy_version=0,
                episode_id=f"e{i}",
                task_id=f"t{i // 2}",
            )
        )
    return out


def old_logprobs(model, inputs: dict, batch: dict) -> tuple[torch.Tensor, object]:
    """Today's computation: full logits, log-softmax over the vocabulary at every position."""
    logits = model(**inputs).logits
    return token_logprobs(logits, batch["input_ids"], batch.get("parents")), lambda: entropy_from_logits(
        logits.detach(), batch.get("parents")
    )


def new_logprobs(config: TrainerConfig):
    def compute(model, inputs: dict, batch: dict) -> tuple[torch.Tensor, object]:
        logprobs, entropy = model_logprobs(
            model,
            inputs,
            batch["loss_mask"],
            batch.get("parents"),
            chunk_tokens=config.logits_chunk_tokens,
            entropy=True,
        )
        return logprobs, lambda: entropy

    return compute


def micro_batches(model, samples: list[Sample], config: TrainerConfig, compute) -> dict[str, float]:
    """The trainer's micro-batch loop (trainer/ranks/step.py without DeepSpeed): loss, backward, metrics."""
    normalizer = float(sum(sum(s.loss_mask) for s in samples))
    sums = {"loss": 0.0, "entropy": 0.0}
    attention = model.config._attn_implementation
    for indices in pack_micro_batches(samples, config.micro_batch_tokens):
        batch = collate([samples[i] for i in indices], pad_id=0)
        logprobs, entropy = compute(model, model_inputs(batch, attention), batch)
        loss, _ = policy_loss(
            logprobs,
            batch["old_logprobs"],
            batch["advantages"],
            batch["loss_mask"],
            clip_eps=config.clip_eps,
            clip_eps_high=config.clip_eps_high,
            weights=batch["weights"],
            normalizer=normalizer,
        )
        loss.backward()
        with torch.no_grad():
            mask = batch["loss_mask"] != 0
            sums["loss"] += float(loss)
            sums["entropy"] += float(torch.where(mask, entropy(), 0.0).sum())
        del logprobs, entropy, loss
    return sums


def step(model, optimizer, samples: list[Sample], config: TrainerConfig, compute) -> tuple[float, dict]:
    start = time.perf_counter()
    sums = micro_batches(model, samples, config, compute)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, sums


def peak_bytes(model, samples: list[Sample], config: TrainerConfig, compute) -> int:
    """Peak bytes allocated during the micro-batches (above what was allocated before), from the
    profiler's memory events (every allocation and free of the CPU allocator, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        micro_batches(model, samples, config, compute)
    model.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    live = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += int(event["args"]["Bytes"])
        peak = max(peak, live)
    return peak


def measure_vocab(quick: bool, vocab: int = VOCAB) -> dict[str, float]:
    """Old against new on the same model and samples; the keys of the RESULT line and the raw figures."""
    torch.manual_seed(0)
    config = TrainerConfig(micro_batch_tokens=MICRO_BATCH_TOKENS)
    samples = workload(2 if quick else 8, vocab)
    model = build_model(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    paths = {"old": old_logprobs, "new": new_logprobs(config)}
    step(model, optimizer, samples, config, paths["new"])  # warm-up: Adam's state, the head check
    peaks = {name: peak_bytes(model, samples, config, compute) for name, compute in paths.items()}
    times: dict[str, list[float]] = {"old": [], "new": []}
    entropy: dict[str, float] = {}
    for i in range(1 if quick else 3):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            seconds, sums = step(model, optimizer, samples, config, paths[name])
            times[name].append(seconds)
            entropy[name] = sums["entropy"]
            print(f"  {name}: {seconds:.2f} s", flush=True)
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    return {
        "vocab_speedup": old_s / new_s,
        "logits_mem_ratio": peaks["new"] / peaks["old"],
        "old_s": old_s,
        "new_s": new_s,
        "old_peak_mb": peaks["old"] / 2**20,
        "new_peak_mb": peaks["new"] / 2**20,
        "tokens": float(len(samples) * SAMPLE_TOKENS),
        "trained_tokens": float(sum(sum(s.loss_mask) for s in samples)),
        "chunk_tokens": float(config.logits_chunk_tokens),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2k tokens per step, one timed pair")
    parser.add_argument(
        "--vocab",
        type=int,
        default=VOCAB,
        help=f"vocabulary size (default {VOCAB:,}, Qwen2.5's: the figures are that vocabulary's); smaller "
        "only to check that the script runs",
    )
    args = parser.parse_args(argv)
    r = measure_vocab(args.quick, args.vocab)
    print(
        f"step of {r['tokens']:.0f} tokens ({r['trained_tokens']:.0f} trained), vocabulary {args.vocab}, "
        f"micro-batches of {MICRO_BATCH_TOKENS} tokens, logits_chunk_tokens {r['chunk_tokens']:.0f}"
    )
    print(f"old: {r['old_s']:.2f} s, peak {r['old_peak_mb']:.0f} MiB")
    print(f"new: {r['new_s']:.2f} s, peak {r['new_peak_mb']:.0f} MiB")
    print(f"RESULT vocab_speedup={r['vocab_speedup']:.2f} logits_mem_ratio={r['logits_mem_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
