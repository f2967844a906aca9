"""Time from launch to the first trained step, with the trainer's ranks started while the engine loads
(``trainer.start_with_engine: true``, the default) and after it (``false``), side by side.

    .venv/bin/python tools/bench/startup.py            # the quickstart, 3 launches each way, alternating
    .venv/bin/python tools/bench/startup.py --runs 1   # a smoke check
    .venv/bin/python tools/bench/startup.py --runs 1 --engine transformers --smoke   # the smoke test's
    --engine vllm|transformers  --steps N  --dir DIR

Each launch is the quickstart (``configs/quickstart.yaml``) on the local backend in the foreground
(``python -m ajet_hpc.launch``) with ``trainer.total_steps`` = ``--steps``, the two orders in turn.
``--smoke`` makes the quickstart small (``SMOKE``): a run that only checks that the script runs.
``first_step_s`` is the first metrics row's ``time`` less the moment the launch began; ``run_s`` is the
launch's wall time. The clients start with the server both ways, so the first step also waits for the first
batch of episodes: what a user waits for after ``make run`` or after a requeue. It ends with one line::

    RESULT first_step_with_s=<median> first_step_after_s=<median> speedup=<after/with> run_with_s=<median>
           run_after_s=<median>
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SMOKE = [
    "servers.policy.trainer.ranks=1",
    "servers.policy.trainer.tasks_per_batch=2",
    "clients.math.array=1",
]
"""``--smoke``'s overrides of the quickstart: 1 rank, steps of 2 tasks (16 episodes), 1 client task. The
run keeps every part (engine, DeepSpeed rank, clients, steps); its figures are not the quickstart's.
``algorithms.py --smoke`` starts from them too."""


def launch(run: Path, engine: str, steps: int, with_engine: bool, smoke: bool) -> tuple[float, float]:
    """One quickstart run; (first_step_s, run_s)."""
    command = [
        sys.executable,
        "-m",
        "ajet_hpc.launch",
        str(REPO / "configs" / "quickstart.yaml"),
        f"run.dir={run}",
        f"servers.policy.engine={engine}",
        f"servers.policy.trainer.total_steps={steps}",
        f"servers.policy.trainer.start_with_engine={str(with_engine).lower()}",
        "clients.math.eval=null",  # an eval round at step 0 would hold the first step: not start-up
        *(SMOKE if smoke else []),
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    began = time.time()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"launch failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return rows[0]["time"] - began, ended - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="launches each way")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--engine", choices=["vllm", "transformers"], default="vllm")
    parser.add_argument("--dir", help="keep the runs here (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="a small quickstart: does the script run")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ajet-startup-"))
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(args.runs):
        for with_engine in (True, False) if i % 2 == 0 else (False, True):
            name = f"{i}-{'with' if with_engine else 'after'}"
            first, run = launch(root / name, args.engine, args.steps, with_engine, args.smoke)
            times[with_engine].append((first, run))
            print(f"{name:>8}: first step {first:6.1f} s, whole run {run:6.1f} s", flush=True)

    def median(with_engine: bool, index: int) -> float:
        return statistics.median(t[index] for t in times[with_engine])

    first_with, first_after = median(True, 0), median(False, 0)
    print(
        f"RESULT first_step_with_s={first_with:.1f} first_step_after_s={first_after:.1f} "
        f"speedup={first_after / first_with:.2f} run_with_s={median(True, 1):.1f} "
        f"run_after_s={median(False, 1):.1f}"
    )


if __name__ == "__main__":
    main()
