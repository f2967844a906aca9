"""The coordinator's own work for one training step at a real batch size, with no training.

    .venv/bin/python tools/bench/step.py            # 256 episodes x 25 turns (32 task groups of 8), 5 repeats
    .venv/bin/python tools/bench/step.py --quick    # 64 episodes x 10 turns, 2 repeats (a smoke check)

Episodes come from ``tools/bench/merge.py``'s generators (imported, not copied). The default
(``--workload group``) is ``GroupWorkload``: issue 17's task group of 8 episodes in the Qwen2.5 vocabulary
(a ~500-token system prompt and a task, turns of 50-300 tokens, forked, summarised and re-tokenized
episodes), one such group per task. ``--workload synth`` is ``Synth``: the tiny model's characters, a
~1.5k-token system prompt, turns of a ~100-token action and a ~150-token tool output, every fourth episode
forked. Each call becomes a ``Timeline`` as the server records it (prompt, response, logprobs, authors,
loss mask, messages), and each episode a finished ``Episode`` with its task group's reward, as the
collector receives it.

Each repeat times the functions the coordinator calls for a step (``ajet_hpc/trainer/coordinator/loop.py``),
in the same order, on the same objects:

- ``collect``: ``BatchCollector.add`` for every episode, then ``try_batch`` (the batch of 32 task groups);
- ``build``: ``build_samples`` (credit and advantages, loss weights, merging as configured, packing),
  with the coordinator's decode (``TokenText`` of the workload's tokenizer: the snap report asks whether
  a call that did not merge is a text prefix of the next);
- ``encode``: ``encode_batch`` (the batch file's bytes; with overlap the coordinator makes them while the
  previous step trains). Build and encode run with the garbage collector paused, as in the coordinator
  (``trainer.samples.gc_paused``);
- ``handover``: ``ConsumedJournal.append`` (the consumed journal line, fsynced) and
  ``TrainerChannel.submit`` with those bytes (the batch file, written by rename): what stays on the
  critical path when the batch was prepared ahead;
- ``record``: the metrics row (``metrics.append_row``, fsynced) and the step record's serialisation for the
  server store (``encode_step``, which the recorder thread runs).

``coordinator_s`` is their sum, the median over repeats. ``critical_s`` is the part of it the ranks wait
for when the batch was prepared while the previous step trained (``max_staleness`` > 0): ``handover`` and
the previous step's metrics row (the step record's encoding runs on the recorder thread). Without overlap
they wait for all of ``coordinator_s``.

``build`` is broken down by running its parts again on their own:

- ``faults``: ``record_fault`` per episode (its calls and rewards; ``episode_fault``, which also builds
  its call samples alone, runs only when the build fails);
- ``samples``: ``call_samples`` per task group (per-call samples with their advantages);
- ``merge``: ``merge_linear`` and the snap report per episode;
- ``pack``: ``pack_tree`` (zero unless ``--merge tree``);
- ``rest``: ``build`` minus those (the finiteness check of the advantages, merge statistics).

The last line is::

    RESULT coordinator_s=<median s> critical_s=<> collect_s=<> build_s=<> faults_s=<> samples_s=<>
           merge_s=<> pack_s=<> rest_s=<> encode_s=<> handover_s=<> record_s=<>
           [vocab_speedup=<> logits_mem_ratio=<>]

The bracketed keys come from ``tools/bench/output_layer.py``'s ``measure_vocab(quick)`` (see
`output_layer_result`; ``--no-vocab`` leaves them out).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parents[1]
for folder in (REPO, BENCH):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import merge as merge_bench  # noqa: E402  (tools/bench/merge.py: the episode generator)

from ajet_hpc.algo import merge, tree_packing  # noqa: E402
from ajet_hpc.algo.detokenize import TokenText  # noqa: E402
from ajet_hpc.config import MergeConfig, TrainerConfig  # noqa: E402
from ajet_hpc.engine.model_path import resolve_model  # noqa: E402
from ajet_hpc.server.episodes import FINISHED, Episode  # noqa: E402
from ajet_hpc.storage.records import StepRecord, encode_step  # noqa: E402
from ajet_hpc.tracking.episode import EpisodeData  # noqa: E402
from ajet_hpc.tracking.timeline import MODEL, SYSTEM, TOOL, USER, Timeline  # noqa: E402
from ajet_hpc.trainer.coordinator import metrics  # noqa: E402
from ajet_hpc.trainer.coordinator.channel import TrainerChannel  # noqa: E402
from ajet_hpc.trainer.coordinator.collector import BatchCollector  # noqa: E402
from ajet_hpc.trainer.coordinator.episodes_to_samples import (  # noqa: E402
    build_samples,
    call_samples,
    explain_snaps,
    gc_paused,
    record_fault,
)
from ajet_hpc.trainer.coordinator.journal import ConsumedJournal  # noqa: E402
from ajet_hpc.trainer.protocol.batch_file import encode_batch  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GROUP_SIZE = 8  # episodes per task group (repeats)
FORK_EVERY = 4  # every fourth episode is the forked variant
PHASES = ("collect", "build", "faults", "samples", "merge", "pack", "rest", "encode", "handover", "record")
WORK = ("collect", "build", "encode", "handover", "record")  # their sum is coordinator_s


# ---- workload ------------------------------------------------------------------------------------------


def episode(calls: list, decode: Callable[[list[int]], str], system: int, **fields) -> Episode:
    """One finished episode: a generator's calls (plain samples) as the timelines the server records."""
    history = [
        {"role": "system", "content": "system prompt"},
        {"role": "user", "content": f"task {fields['task_id']}"},
    ]
    timelines = []
    for k, call in enumerate(calls):
        cut = call.loss_mask.index(1)
        prompt, answer = call.token_ids[:cut], call.token_ids[cut:]
        reply = {"role": "assistant", "content": decode(answer)}
        timelines.append(
            Timeline(
                prompt_ids=prompt,
                response_ids=answer,
                response_logprobs=call.old_logprobs[cut:],
                token_authors=_authors(prompt, system) + [MODEL] * len(answer),
                loss_mask=[0] * len(prompt) + [1] * len(answer),
                messages=[*history, reply],
                tools=None,
                policy_version=0,
                finish_reason="stop",
            )
        )
        retried = k + 1 < len(calls) and calls[k + 1].token_ids[:cut] == prompt
        if not retried:  # the conversation goes on from this answer (a failed attempt is left behind)
            history = [*history, reply, {"role": "tool", "content": f"output of turn {len(history)}"}]
    return Episode(
        model="policy", tracker=None, state=FINISHED, stored_timelines=timelines, group="bench", **fields
    )


def _authors(prompt: list[int], system: int) -> list[int]:
    """Who wrote each prompt token, roughly (neither the collector nor merging reads authors)."""
    return [SYSTEM if i < system else (USER if i % 3 else TOOL) for i in range(len(prompt))]


def workload(episodes: int, turns: int, kind: str = "group", seed: int = 0) -> tuple[list[Episode], object]:
    """``episodes`` finished episodes in task groups of ``GROUP_SIZE``, rewards unequal within each group,
    and their tokenizer.

    ``group``: ``merge.py``'s ``GroupWorkload`` (issue 17's group: Qwen2.5 vocabulary, ~500-token system
    prompt, turns of 50-300 tokens, forked, summarised and re-tokenized episodes), one group per task;
    ``synth``: ``merge.py``'s ``Synth`` (tiny model, 1.5k-token system prompt, every fourth episode forked).
    """
    rng = random.Random(seed)
    tokenizer: PreTrainedTokenizerBase
    if kind == "group":
        from ajet_hpc.engine.tiny_qwen import build_tokenizer

        tokenizer = build_tokenizer()
        generator = merge_bench.GroupWorkload(tokenizer, seed)
        decode, system = generator.decode, merge_bench.GROUP_SYSTEM
        calls = [c for _ in range(episodes // GROUP_SIZE) for c in generator.group(turns)]
    else:
        from transformers import AutoTokenizer

        model = resolve_model("builtin:tiny", Path(tempfile.mkdtemp(prefix="ajet-bench-step-")) / "models")
        tokenizer = AutoTokenizer.from_pretrained(model)
        synth = merge_bench.Synth(tokenizer, seed)
        system = merge_bench.SYSTEM_TOKENS

        def decode(ids: list[int]) -> str:
            text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert isinstance(text, str), "one sequence decodes to one string"
            return text

        calls = [synth.episode(turns, e % FORK_EVERY == FORK_EVERY - 1, f"ep{e}") for e in range(episodes)]
    built = [
        episode(
            episode_calls,
            decode,
            system,
            episode_id=f"ep{e:05d}",
            task_id=f"task{e // GROUP_SIZE}",
            repeat=e % GROUP_SIZE,
            reward=float(e % GROUP_SIZE == 0) if e % 2 else rng.choice((0.0, 0.5, 1.0)),
        )
        for e, episode_calls in enumerate(calls)
    ]
    return built, tokenizer


# ---- one repeat ----------------------------------------------------------------------------------------


def one_step(
    episodes: list[Episode], config: TrainerConfig, work: Path, step: int, decode: TokenText
) -> dict[str, float]:
    """The coordinator's work for one step, phase by phase (seconds)."""
    times: dict[str, float] = {}
    started = time.perf_counter()
    collector = BatchCollector(config)
    for item in episodes:
        collector.add(item)
    batch = collector.try_batch()
    if batch is None or len(batch.episodes) != len(episodes):
        raise RuntimeError(f"the collector made no batch of all {len(episodes)} episodes")
    times["collect"] = _lap(started)

    with gc_paused():  # as the coordinator builds and encodes (`BatchPreparer.build`)
        started = time.perf_counter()
        samples, merging = build_samples(batch, config, decode)
        times["build"] = _lap(started)
        if batch.invalid:
            raise RuntimeError(f"episodes dropped from the batch: {batch.invalid}")

        started = time.perf_counter()
        encoded = encode_batch(step, samples, save_checkpoint=False)
        times["encode"] = _lap(started)

    started = time.perf_counter()
    ConsumedJournal(work / "ckpt" / "consumed.jsonl").append(step, [e.episode_id for e in batch.episodes], [])
    channel = TrainerChannel(work / "ckpt")
    channel.submit(step, samples, save_checkpoint=False, encoded=encoded)
    times["handover"] = _lap(started)
    channel.work.batch_file(step).unlink()

    started = time.perf_counter()
    row = {"step": step, "model": "policy", "samples": len(samples), **merging.metrics(), "time": time.time()}
    metrics.append_row(work / "metrics.jsonl", row)
    times["row"] = _lap(started)
    encode_step(StepRecord(step=step, metrics=row, samples=samples))
    times["record"] = _lap(started)
    with gc_paused():
        times.update(build_parts(batch.groups, config, decode))
    times["rest"] = times["build"] - sum(times[p] for p in ("faults", "samples", "merge", "pack"))
    return times


def build_parts(
    groups: list[list[EpisodeData]], config: TrainerConfig, decode: TokenText
) -> dict[str, float]:
    """``build_samples``'s parts run on their own, in its order: the per-episode record checks, call samples,
    merging, packing."""
    started = time.perf_counter()
    for group in groups:
        for item in group:
            record_fault(item)
    faults_s = _lap(started)
    started = time.perf_counter()
    per_call = [call_samples(group, config.turn_gamma) for group in groups]
    samples_s = _lap(started)
    merge_s = pack_s = 0.0
    for group, group_calls in zip(groups, per_call, strict=True):
        for item, calls in zip(group, group_calls, strict=True):
            if config.merge.mode == "none" or len(calls) < 2:
                continue
            started = time.perf_counter()
            merged, _ = merge.merge_linear(calls, level=config.merge.level, decode=decode)
            explain_snaps(item.episode_id, item.timelines, merged, decode)
            merge_s += _lap(started)
            if config.merge.mode == "tree" and len(merged) > 1:
                started = time.perf_counter()
                tree_packing.pack_tree(merged)
                pack_s += _lap(started)
    return {"faults": faults_s, "samples": samples_s, "merge": merge_s, "pack": pack_s}


def _lap(started: float) -> float:
    return time.perf_counter() - started


# ---- the output layer (another benchmark's part of this one's RESULT line) ------------------------------


def output_layer_result(quick: bool) -> dict[str, float]:
    """``tools/bench/output_layer.py``'s ``measure_vocab(quick)``: one step on a 2-layer model with the
    Qwen2.5 vocabulary, today's output layer against the chunked one; its two RESULT keys."""
    import output_layer

    measured = output_layer.measure_vocab(quick)
    print(
        f"output layer: old {measured['old_s']:.2f} s, peak {measured['old_peak_mb']:.0f} MiB; "
        f"new {measured['new_s']:.2f} s, peak {measured['new_peak_mb']:.0f} MiB"
    )
    return {key: measured[key] for key in ("vocab_speedup", "logits_mem_ratio")}


# ---- main ----------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    episodes, tokenizer = workload(args.episodes, args.turns, args.workload)
    decode = TokenText(tokenizer)  # as the coordinator decodes (snap reports; text-level merging)
    decode.joins  # noqa: B018  (read once per run, as the coordinator's, not timed)
    calls = sum(len(e.timelines) for e in episodes)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for e in episodes for t in e.timelines)
    print(
        f"workload: {len(episodes)} episodes x {args.turns} turns ({calls} calls, {tokens:,} call tokens), "
        f"built in {time.monotonic() - started:.1f} s; {args.workload}, merge {args.merge}, "
        f"{args.repeats} repeat(s)",
        flush=True,
    )
    config = TrainerConfig(
        tasks_per_batch=len(episodes) // GROUP_SIZE,
        repeats=GROUP_SIZE,
        merge=MergeConfig(mode=args.merge),
        total_steps=10**6,
    )
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="ajet-bench-step-") as tmp:
        for repeat in range(args.repeats):
            times = one_step(episodes, config, Path(tmp), step=repeat + 1, decode=decode)
            times["coordinator"] = sum(times[p] for p in WORK)
            times["critical"] = times["handover"] + times["row"]
            runs.append(times)
            print(
                f"  repeat {repeat + 1}/{args.repeats}: "
                + "  ".join(f"{p} {times[p]:.3f}" for p in ("coordinator", *PHASES))
                + " s",
                flush=True,
            )
    med = {p: statistics.median(r[p] for r in runs) for p in ("coordinator", "critical", *PHASES)}
    print(f"\nmedian of {args.repeats}, seconds:")
    shown: tuple[str, ...] = ("collect", "build", "  faults", "  samples", "  merge", "  pack", "  rest")
    shown += ("encode", "handover", "record")
    for phase in (*shown, "coordinator", "critical"):
        name = phase.strip()
        spread = f"{min(r[name] for r in runs):.3f}-{max(r[name] for r in runs):.3f}"
        print(f"  {phase:12} {med[name]:8.3f}   ({spread})")
    extra = {} if args.no_vocab else output_layer_result(args.quick)
    keys = {"coordinator_s": med["coordinator"], "critical_s": med["critical"]}
    keys.update({f"{p}_s": med[p] for p in PHASES}, **extra)
    print("RESULT " + " ".join(f"{key}={_fmt(value)}" for key, value in keys.items()))
    return 0


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 episodes x 10 turns, 2 repeats")
    parser.add_argument("--episodes", type=int, default=256, help=f"a multiple of {GROUP_SIZE}")
    parser.add_argument("--turns", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--merge", choices=("none", "linear", "tree"), default="linear")
    parser.add_argument("--no-vocab", action="store_true", help="leave out the output-layer measurement")
    parser.add_argument(
        "--workload", choices=("group", "synth"), default="group", help="merge.py's GroupWorkload or Synth"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.turns, args.repeats = 64, 10, 2
    if args.episodes % GROUP_SIZE:
        parser.error(f"--episodes must be a multiple of {GROUP_SIZE}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
