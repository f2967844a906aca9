"""Each algorithm of ``trainer.algorithm`` on the quickstart, over the same seeds: how many steps until the
step's mean reward first reaches ``--target`` (0.45), and the mean reward of the last five steps.

Every run is the real quickstart (``configs/quickstart.yaml``: vLLM on the CPU, DeepSpeed ZeRO-2 with 2
ranks, 3 client tasks of the built-in agent) launched in the foreground on the local backend with
``servers.policy.trainer.algorithm`` and ``.seed`` set (with the algorithm's ``SETTINGS``), one after
the other. A run that never reaches the target counts ``inf`` steps. Medians over the seeds;
``learned_<algorithm>`` is how many seeds ended (last five steps) above where they began (first five).

The quickstart's eval rounds (``clients.math.eval``: 16 held-out sums x 4 samples at steps 0, 5, 10, ...
and the last step) give ``eval_pass1_<algorithm>``: the median over seeds of pass@1 at the last step. A
run without a pass@1 at its last step stops the benchmark (exit 1, naming algorithm and seed) rather
than enter the median as ``nan``, where it would sort arbitrarily and leave a plausible-looking median.

Ends with ``RESULT steps_to_target_<algorithm>=<median> final_reward_<algorithm>=<median>
learned_<algorithm>=<seeds> eval_pass1_<algorithm>=<median> ...`` for every algorithm run.

    .venv/bin/python tools/bench/algorithms.py                  # 6 algorithms x 3 seeds x 20 steps, ~1 h here

The smoke test runs ``--smoke --algorithms gspo --seeds 0 --steps 1 --engine transformers``: ``--smoke``
makes the quickstart small (``SMOKE``), for a run that only checks that the script runs.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup import SMOKE as SMALL_QUICKSTART

from ajet_hpc.config.algorithms import ALGORITHMS
from ajet_hpc.trainer.coordinator import metrics

REPO = Path(__file__).resolve().parents[2]

SMOKE = [
    *SMALL_QUICKSTART,
    "clients.math.eval.at_start=false",
    "clients.math.eval.max_tasks=4",
    "clients.math.eval.samples_per_task=1",
]
"""``--smoke``'s overrides of the quickstart: ``startup.py``'s small quickstart (1 rank, steps of 2 tasks, 1
client task) and one eval round, at the last step, of 4 held-out tasks once each. Every part runs (the
algorithm's settings, training, the round whose pass@1 is reported); the figures are not the quickstart's."""

# Trainer overrides beyond ``trainer.algorithm``: the settings of SETTINGS in
# tests/component/test_algorithms_learn.py, which says more about them. Under the trainer's defaults dapo
# trains exactly what grpo trains: clip-higher (0.2 / 0.28) and skip_equal_groups with batch_policy tasks
# (dynamic sampling: the collector refills) are grpo's defaults too. So dapo gets those written out and
# overlong shaping on, its budget the agent's max_tokens (2), not serving.max_tokens (1024, which no
# answer nears).
SETTINGS: dict[str, list[str]] = {
    "dapo": [
        "clip_eps=0.2",
        "clip_eps_high=0.28",
        "skip_equal_groups=true",
        "batch_policy=tasks",
        "overlong={max_tokens: 2, buffer_tokens: 1, penalty: 0.25}",
    ],
}


def overrides(folder: Path, algorithm: str, seed: int, steps: int, engine: str, smoke: bool) -> list[str]:
    """The quickstart's overrides for one run."""
    trainer = "servers.policy.trainer"
    return [
        f"run.dir={folder}",
        f"servers.policy.engine={engine}",
        f"{trainer}.algorithm={algorithm}",
        *(f"{trainer}.{setting}" for setting in SETTINGS.get(algorithm, [])),
        f"{trainer}.seed={seed}",
        f"{trainer}.total_steps={steps}",
        f"{trainer}.save_every={steps}",
        *(SMOKE if smoke else []),
    ]


def run_once(
    folder: Path, algorithm: str, seed: int, steps: int, engine: str, smoke: bool
) -> tuple[list[float], float]:
    """One quickstart run; the reward mean of each step, and pass@1 of the last step's eval round
    (``SystemExit`` naming the run when that round has none)."""
    quickstart = str(REPO / "configs" / "quickstart.yaml")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ajet_hpc.launch",
            quickstart,
            *overrides(folder, algorithm, seed, steps, engine, smoke),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(
            f"{algorithm} seed {seed} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
        )
    rows = metrics.read_rows(folder / "metrics.jsonl")
    evals = metrics.read_eval_rows(folder / "metrics.jsonl")
    return [float(row["reward_mean"]) for row in rows], last_pass1(evals, steps, f"{algorithm} seed {seed}")


def last_pass1(evals: list[dict], steps: int, run: str) -> float:
    """pass@1 of the eval round at step ``steps``; ``SystemExit`` naming ``run`` when there is none (no
    round at that step, or a round in which no eval episode ended)."""
    last = [row for row in evals if row["step"] == steps]
    if not last:
        rounds = sorted({int(row["step"]) for row in evals})
        raise SystemExit(
            f"{run}: no eval round at step {steps} (rounds at steps {rounds}); no pass@1 to report"
        )
    value = last[-1].get("eval_pass@1")
    if value is None or not math.isfinite(float(value)):
        raise SystemExit(f"{run}: the eval round at step {steps} has pass@1 {value} (no eval episode ended?)")
    return float(value)


def steps_to(rewards: list[float], target: float) -> float:
    return next((float(step) for step, r in enumerate(rewards, 1) if r >= target), math.inf)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated trainer seeds")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.45)
    parser.add_argument(
        "--engine", choices=["vllm", "transformers"], default="vllm", help="the figures are vLLM's (default)"
    )
    parser.add_argument("--smoke", action="store_true", help="a small quickstart: does the script run")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithms {unknown}; algorithms are: {', '.join(ALGORITHMS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    window = min(5, max(1, args.steps // 2))
    result = []
    with tempfile.TemporaryDirectory(prefix="ajet-bench-algorithms-") as tmp:
        for algorithm in algorithms:
            reached, final, learned, passed = [], [], 0, []
            for seed in seeds:
                start = time.monotonic()
                rewards, pass1 = run_once(
                    Path(tmp) / f"{algorithm}-{seed}", algorithm, seed, args.steps, args.engine, args.smoke
                )
                passed.append(pass1)
                reached.append(steps_to(rewards, args.target))
                final.append(statistics.fmean(rewards[-window:]))
                first = statistics.fmean(rewards[:window])
                learned += final[-1] > first
                print(
                    f"{algorithm:<13} seed {seed}: steps to {args.target} {reached[-1]:g}, "
                    f"last {window} steps {final[-1]:.3f}, first {window} {first:.3f}, "
                    f"eval pass@1 at step {args.steps} {pass1:.3f} "
                    f"({time.monotonic() - start:.0f} s)",
                    flush=True,
                )
            result += [
                f"steps_to_target_{algorithm}={statistics.median(reached):g}",
                f"final_reward_{algorithm}={statistics.median(final):.3f}",
                f"learned_{algorithm}={learned}",
                f"eval_pass1_{algorithm}={statistics.median(passed):.3f}",
            ]
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
