"""Actor-update time with per-call samples, linear merging and tree merging, on AppWorld-shaped episodes.

    .venv/bin/python tools/bench/merge.py            # full: N = 5, 15, 25 and the forked variant, 3 repeats
    .venv/bin/python tools/bench/merge.py --quick    # N = 5, 10, forked 10, 1 repeat (a smoke check)

Episodes are synthetic token sequences in the tiny model's chat format (its tokenizer's characters and
ChatML markers): a ~1.5k-token system prompt and a task, then N turns of a ~100-token model action and a
~150-token tool output. Call k's prompt is everything before action k, so call k+1 continues call k token
for token, as the server records it. The forked variant retries 20 % of the turns (every fifth turn, from
the third): the failed attempt is a call with the same prompt and another answer, a fork.

For each N the same episodes are trained three ways through the real trainer (DeepSpeed ZeRO-2 ranks on
CPU, the file protocol of ``ajet_hpc.trainer.protocol``): one sample per call; linear merging; tree
merging. The modes alternate within each repeat, and the time is the ranks' own ``step_time_s`` (forward,
backward and optimizer step; no export). Reported per N: median seconds, speedups over per-call samples,
and the token limit = per-call tokens / tokens after tree merging (the speedup if time were proportional
to tokens). The last line is ``RESULT linear_25=<x> tree_25=<x> limit_frac_25=<f> tree_vs_linear_forked=<x>
merge_ms_25=<ms> merge_ms_50=<ms> text_ms_50=<ms>``.

The merge keys time merging itself (no training), first: one task group of 8 episodes of N model calls each
in the Qwen2.5 vocabulary (``builtin:tiny-qwen``'s tokenizer): a ~500-token system prompt and a 50-token task,
then turns of a 50-300-token answer and a 50-300-token tool result. Episodes 4, 5 and 7 retry every fifth
turn (a fork), 6 and 7 are summarised halfway (the context restarts from the system prompt, the task and a
200-token summary), 2, 3 and 5 get every fourth answer back re-tokenized in the next prompt (sampled as
``" wo" + "rd"``, re-encoded as ``" word"``: a token-level snap, a text-level merge). Reported: milliseconds
per group for ``merge_linear`` over each episode's calls, token level (N = 25, 50) and text level (N = 50,
decoding like the trainer does), the median of ``--merge-repeats`` runs. ``--merge-only`` stops there.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ajet_hpc.algo import merge, tree_packing  # noqa: E402
from ajet_hpc.algo.sample_tensors import Sample  # noqa: E402
from ajet_hpc.config import ServingConfig, TrainerConfig  # noqa: E402
from ajet_hpc.config.placement import cpu_placement  # noqa: E402
from ajet_hpc.engine.model_path import resolve_model  # noqa: E402
from ajet_hpc.trainer.coordinator.channel import TrainerChannel  # noqa: E402
from ajet_hpc.trainer.coordinator.rank_launcher import start_ranks  # noqa: E402

SYSTEM_TOKENS, TASK_TOKENS, ACTION_TOKENS, TOOL_TOKENS = 1500, 60, 100, 150
MODES = ("per-call", "linear", "tree")
GROUP_EPISODES, GROUP_SYSTEM, GROUP_TASK, GROUP_SUMMARY = 8, 500, 50, 200
GROUP_ANSWER = GROUP_TOOL = (25, 150)  # a turn: an answer and a tool result, 50-300 tokens together
FORKED, SUMMARISED, RETOKENIZED = (4, 5, 7), (6, 7), (2, 3, 5)  # episode indices of each variant


class Synth:
    """Token sequences in the tiny model's ChatML format."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        specials = set(tokenizer.all_special_ids)
        self.alphabet = [i for i in range(len(tokenizer)) if i not in specials]
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def text(self, n: int) -> list[int]:
        return [self.rng.choice(self.alphabet) for _ in range(n)]

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def message(self, role: str, n: int) -> list[int]:
        return [self.im_start, *self.encode(f"{role}\n"), *self.text(n), self.im_end, *self.encode("\n")]

    def episode(self, turns: int, forked: bool, name: str) -> list[Sample]:
        """The calls of one episode, one plain sample each (answer trained, the rest context)."""
        context = self.message("system", SYSTEM_TOKENS) + self.message("user", TASK_TOKENS)
        header = [self.im_start, *self.encode("assistant\n")]
        calls: list[Sample] = []
        for k in range(turns):
            prompt = context + header
            if forked and k % 5 == 2:  # 20 % of the turns: a failed attempt first
                calls.append(
                    self.call(prompt, [*self.text(ACTION_TOKENS - 1), self.im_end], name, len(calls))
                )
            action = [*self.text(ACTION_TOKENS - 1), self.im_end]
            calls.append(self.call(prompt, action, name, len(calls)))
            context = prompt + action + self.encode("\n") + self.message("tool", TOOL_TOKENS)
        return calls

    def call(self, prompt: list[int], answer: list[int], name: str, index: int) -> Sample:
        n, m = len(prompt), len(answer)
        return Sample(
            token_ids=prompt + answer,
            loss_mask=[0] * n + [1] * m,
            old_logprobs=[0.0] * n + [-self.rng.uniform(0.5, 4.0) for _ in range(m)],
            advantages=[0.0] * n + [self.rng.choice((-1.0, 1.0))] * m,
            policy_version=0,
            episode_id=name,
            task_id="bench",
            calls=[index],
        )


class GroupWorkload:
    """The merging workload of one task group (see the module doc), in the Qwen2.5 vocabulary."""

    def __init__(self, tokenizer, seed: int) -> None:
        self.tok = tokenizer
        self.rng = random.Random(seed)
        vocab = tokenizer.get_vocab()
        self.words = sorted(i for t, i in vocab.items() if re.fullmatch("\u0120[a-z]{3,8}", t))
        self.im_start, self.im_end = vocab["<|im_start|>"], vocab["<|im_end|>"]
        self.newline = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text(self, n: int) -> list[int]:
        return [self.rng.choice(self.words) for _ in range(n)]

    def message(self, role: str, body: list[int]) -> list[int]:
        return [self.im_start, *self.encode(f"{role}\n"), *body, self.im_end, *self.newline]

    def split(self, ids: list[int]) -> list[int]:
        """The same text with every fifth word sampled in two pieces (``" wo" + "rd"``)."""
        out: list[int] = []
        for j, token in enumerate(ids):
            word = self.decode([token])
            out += self.encode(word[:3]) + self.encode(word[3:]) if j % 5 == 0 else [token]
        return out

    def group(self, calls: int) -> list[list[Sample]]:
        return [self.episode(e, calls) for e in range(GROUP_EPISODES)]

    def episode(self, e: int, n: int) -> list[Sample]:
        system, task = (
            self.message("system", self.text(GROUP_SYSTEM)),
            self.message("user", self.text(GROUP_TASK)),
        )
        context = system + task
        header = [self.im_start, *self.encode("assistant\n")]
        out: list[Sample] = []
        turn = 0
        while len(out) < n:
            if e in SUMMARISED and turn == n // 2:
                context = system + task + self.message("user", self.text(GROUP_SUMMARY))
            prompt = context + header
            if e in FORKED and turn % 5 == 2 and len(out) < n - 1:
                out.append(
                    self.call(prompt, [*self.text(self.rng.randint(*GROUP_ANSWER)), self.im_end], e, len(out))
                )
            answer = self.text(self.rng.randint(*GROUP_ANSWER))
            sampled = self.split(answer) if e in RETOKENIZED and turn % 4 == 1 else answer
            out.append(self.call(prompt, [*sampled, self.im_end], e, len(out)))
            tool = self.message("user", self.text(self.rng.randint(*GROUP_TOOL)))
            context = prompt + answer + [self.im_end, *self.newline] + tool
            turn += 1
        return out

    def call(self, prompt: list[int], answer: list[int], e: int, index: int) -> Sample:
        n, m = len(prompt), len(answer)
        return Sample(
            token_ids=prompt + answer,
            loss_mask=[0] * n + [1] * m,
            old_logprobs=[0.0] * n + [-self.rng.uniform(0.5, 4.0) for _ in range(m)],
            advantages=[0.0] * n + [self.rng.choice((-1.0, 1.0))] * m,
            policy_version=0,
            episode_id=f"ep{e}",
            task_id="group",
            calls=[index],
        )


def merge_ms(group: list[list[Sample]], level: str, decode, repeats: int) -> float:
    """Median milliseconds to merge every episode of ``group`` (``merge_linear`` per episode)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for calls in group:
            merge.merge_linear(calls, level=level, decode=decode)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def merge_timing(args: argparse.Namespace) -> dict[str, float]:
    """The merge keys of the RESULT line, printed as they are measured."""
    from ajet_hpc.algo.detokenize import TokenText
    from ajet_hpc.engine.tiny_qwen import build_tokenizer

    workload = GroupWorkload(build_tokenizer(), seed=0)
    groups = {n: workload.group(n) for n in (25, 50)}
    for n, group in groups.items():
        sizes = [sum(len(s) for s in calls) for calls in group]
        merged = sum(len(merge.merge_linear(calls)[0]) for calls in group)
        print(f"group N={n}: {sum(len(c) for c in group)} calls, {sum(sizes):,} tokens -> {merged} samples")
    result = {
        "merge_ms_25": merge_ms(groups[25], merge.TOKEN, None, args.merge_repeats),
        "merge_ms_50": merge_ms(groups[50], merge.TOKEN, None, args.merge_repeats),
        "text_ms_50": merge_ms(groups[50], merge.TEXT, TokenText(workload.tok), args.merge_repeats),
    }
    print("merge time per group (ms): " + "  ".join(f"{k} {v:.1f}" for k, v in result.items()), flush=True)
    return result


def batches(episodes: list[list[Sample]]) -> dict[str, list[Sample]]:
    linear = [merge.merge_linear(calls)[0] for calls in episodes]
    return {
        "per-call": [s for calls in episodes for s in calls],
        "linear": [s for merged in linear for s in merged],
        "tree": [tree_packing.pack_tree(merged) for merged in linear],
    }


async def measure(channel: TrainerChannel, step: int, samples: list[Sample]) -> float:
    channel.submit(step, samples)
    result = await channel.wait_result(step, timeout_s=3600)
    return result.step_time_s


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    timing = merge_timing(args)
    merge_keys = " ".join(f"{k}={v:.1f}" for k, v in timing.items())
    if args.merge_only:
        print(f"RESULT {merge_keys}")
        return 0

    work = Path(tempfile.mkdtemp(prefix="ajet-bench-merge-"))
    model = resolve_model("builtin:tiny", work / "models")
    tokenizer = AutoTokenizer.from_pretrained(model)
    synth = Synth(tokenizer, seed=0)
    cases = [(n, False) for n in args.turns] + [(n, True) for n in args.forked]
    data = {
        case: batches([synth.episode(case[0], case[1], f"ep{e}") for e in range(args.episodes)])
        for case in cases
    }
    config = TrainerConfig(
        zero_stage=2, ranks=1, lr=1e-5, micro_batch_tokens=args.micro_batch_tokens, total_steps=10**6
    ).resolved(ServingConfig())
    log_path = work / "ranks.log"
    process = start_ranks(
        work / "trainer", model, config, on_slurm=False, placement=cpu_placement(1), log_path=log_path
    )
    channel = TrainerChannel(work / "trainer", alive=lambda: process.poll() is None, log_path=log_path)
    print(f"trainer: 1 rank, ZeRO-2, CPU, micro_batch_tokens {args.micro_batch_tokens}; work dir {work}")
    started = time.monotonic()
    try:
        asyncio.run(channel.wait_ready(timeout_s=900))
        step = 0
        step += 1  # warm-up: allocator, first optimizer step
        asyncio.run(measure(channel, step, data[cases[0]]["linear"]))
        times: dict[tuple, dict[str, list[float]]] = {case: {m: [] for m in MODES} for case in cases}
        for repeat in range(args.repeats):
            for case in cases:
                order = MODES if repeat % 2 == 0 else MODES[::-1]
                for mode in order:
                    step += 1
                    seconds = asyncio.run(measure(channel, step, data[case][mode]))
                    times[case][mode].append(seconds)
                    print(
                        f"  repeat {repeat + 1}/{args.repeats}  N={case[0]:>2}"
                        f"{' forked' if case[1] else '':7}  {mode:8}  {seconds:7.2f} s",
                        flush=True,
                    )
    finally:
        channel.request_stop()
        try:
            process.wait(timeout=60)
        except Exception:
            process.kill()
    print(
        f"\nmeasured in {time.monotonic() - started:.0f} s; {args.episodes} episodes per batch, median of "
        f"{args.repeats} repeat(s)\n"
    )
    header = (
        f"{'N':>3} {'variant':8} {'samples':>15} {'tokens per-call/linear/tree':>29} {'per-call s':>10} "
        f"{'linear s':>9} {'tree s':>8} {'linear x':>9} {'tree x':>7} {'limit x':>8} {'tree/limit':>10}"
    )
    print(header)
    summary = {}
    for case in cases:
        n, forked = case
        med = {m: statistics.median(times[case][m]) for m in MODES}
        tokens = {m: sum(len(s) for s in data[case][m]) for m in MODES}
        samples = {m: len(data[case][m]) for m in MODES}
        limit = tokens["per-call"] / tokens["tree"]
        linear_x, tree_x = med["per-call"] / med["linear"], med["per-call"] / med["tree"]
        summary[case] = (linear_x, tree_x, limit, med)
        print(
            f"{n:>3} {'forked' if forked else 'linear':8} "
            f"{samples['per-call']:>5}/{samples['linear']:>3}/{samples['tree']:>3} "
            f"{tokens['per-call']:>11,}/{tokens['linear']:>8,}/{tokens['tree']:>8,} "
            f"{med['per-call']:>10.2f} {med['linear']:>9.2f} {med['tree']:>8.2f} "
            f"{linear_x:>9.2f} {tree_x:>7.2f} {limit:>8.2f} {tree_x / limit:>10.2f}"
        )
    top = max(args.turns)
    linear_top, tree_top, limit_top, _ = summary[(top, False)]
    forked_top = max(args.forked) if args.forked else None
    tree_vs_linear = (
        summary[(forked_top, True)][3]["linear"] / summary[(forked_top, True)][3]["tree"]
        if forked_top
        else 0.0
    )
    print(
        f"\nAt N={top}: linear merging {linear_top:.2f}x, tree {tree_top:.2f}x, token limit {limit_top:.2f}x "
        f"(linear reaches {linear_top / limit_top:.0%} of it). Forked N={forked_top}: tree is "
        f"{tree_vs_linear:.2f}x faster than linear."
    )
    print(
        f"RESULT linear_{top}={linear_top:.2f} tree_{top}={tree_top:.2f} "
        f"limit_frac_{top}={linear_top / limit_top:.2f} tree_vs_linear_forked={tree_vs_linear:.2f} "
        f"{merge_keys}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 5, 10 and forked 10, one repeat")
    parser.add_argument("--turns", type=int, nargs="+", default=[5, 15, 25])
    parser.add_argument("--forked", type=int, nargs="*", default=[25], help="N of the forked variant")
    parser.add_argument("--episodes", type=int, default=1, help="episodes per training batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch-tokens", type=int, default=TrainerConfig().micro_batch_tokens)
    parser.add_argument("--merge-repeats", type=int, default=5, help="runs of the merge timing (median)")
    parser.add_argument("--merge-only", action="store_true", help="time merging only, no training")
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.forked, args.repeats = [5, 10], [10], 1
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
