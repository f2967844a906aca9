"""Each algorithm of ``trainer.algorithm`` on the quickstart, over the same seeds: how many steps until the
step's mean reward first reaches ``--target`` (0.45), and the mean reward of the last five steps.

Every run is the real quickstart (``configs/quickstart.yaml``: vLLM on the CPU, DeepSpeed ZeRO-2 with 2
ranks, 3 client tasks of the built-in agent) launched in the foreground on the local backend with
``servers.policy.trainer.algorithm`` and ``.seed`` set, one after the other. A run that never reaches
the target counts ``inf`` steps. Medians over the seeds; ``learned_<algorithm>`` is how many seeds ended
(last five steps) above where they began (first five).

The quickstart's eval rounds (``clients.math.eval``: 16 held-out sums x 4 samples at steps 0, 5, 10, ...
and the last step) give ``eval_pass1_<algorithm>``: the median over seeds of pass@1 at the last step.

Ends with ``RESULT steps_to_target_<algorithm>=<median> final_reward_<algorithm>=<median>
learned_<algorithm>=<seeds> eval_pass1_<algorithm>=<median> ...`` for every algorithm run.

    .venv/bin/python tools/bench/algorithms.py                  # 6 algorithms x 3 seeds x 20 steps, ~1 h here
    .venv/bin/python tools/bench/algorithms.py --algorithms gspo --seeds 0 --steps 2   # the smoke test's
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

from ajet_hpc.config.algorithms import ALGORITHMS
from ajet_hpc.trainer import metrics

REPO = Path(__file__).resolve().parents[2]


def run_once(folder: Path, algorithm: str, seed: int, steps: int) -> tuple[list[float], float]:
    """One quickstart run; the reward mean of each step, and pass@1 of the last step's eval round."""
    overrides = [
        f"run.dir={folder}",
        f"servers.policy.trainer.algorithm={algorithm}",
        f"servers.policy.trainer.seed={seed}",
        f"servers.policy.trainer.total_steps={steps}",
        f"servers.policy.trainer.save_every={steps}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "ajet_hpc.launch", str(REPO / "configs" / "quickstart.yaml"), *overrides],
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
    evals = [row for row in metrics.read_eval_rows(folder / "metrics.jsonl") if row["step"] == steps]
    final_pass1 = float(evals[-1]["eval_pass@1"]) if evals else math.nan
    return [float(row["reward_mean"]) for row in rows], final_pass1


def steps_to(rewards: list[float], target: float) -> float:
    return next((float(step) for step, r in enumerate(rewards, 1) if r >= target), math.inf)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated trainer seeds")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--target", type=float, default=0.45)
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
                rewards, pass1 = run_once(Path(tmp) / f"{algorithm}-{seed}", algorithm, seed, args.steps)
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
