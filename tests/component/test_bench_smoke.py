"""Every benchmark in tools/bench still runs: its quickest mode as a subprocess exits 0 and ends with a
``RESULT`` line holding its keys as finite numbers.

The benchmarks are scripts nobody imports, so a refactor of the package can break them silently (a renamed
function, a changed signature) until the next full benchmark run. These runs use the tiniest sizes (the
benchmarks' own size flags, or ``--smoke`` where those could not shrink a fixed part); the figures they
print mean nothing and are not checked, only that each part ran and printed its keys, each a finite
number: a part that measured nothing prints ``nan`` or ``inf``, and that fails here. A run's
``non_finite`` names the keys that may be otherwise: ``nan`` where a flag of the run skips the part,
``inf`` where it means "never". The runs that train, start vLLM or build a 151k-vocabulary model take
from 20 s to minutes here and are marked slow.
``tools/bench/zero_engine.py`` is a module, not a script: ``proxy.py --skip-vllm`` serves it.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tools" / "bench"

SLOW = pytest.mark.slow
SMOKE = [
    pytest.param(
        "merge.py",
        ["--merge-only", "--merge-repeats", "1"],
        ["merge_ms_25", "merge_ms_50", "text_ms_50"],
        {},
        id="merge",
    ),
    pytest.param(
        "merge.py",
        # 3 turns: the forked variant's retry (every fifth turn from the third) is its last turn
        ["--turns", "3", "--forked", "3", "--repeats", "1", "--merge-repeats", "1"],
        [
            "linear_3",
            "tree_3",
            "limit_frac_3",
            "tree_vs_linear_forked",
            "merge_ms_25",
            "merge_ms_50",
            "text_ms_50",
        ],
        {},
        id="merge-training",
        marks=SLOW,
    ),
    pytest.param(
        "store.py",
        ["--smoke"],
        [
            "size_ratio",
            "write_eps",
            "read_ms_10k",
            "read_ms_100k",
            "write_eps_group",
            "fsyncs_per_episode",
            "fsyncs_per_episode_client",
        ],
        {},
        id="store",
    ),
    pytest.param(
        "step.py",
        ["--episodes", "8", "--turns", "2", "--repeats", "1", "--no-vocab"],
        ["coordinator_s", "critical_s", "merge_s", "pack_s"],
        {},
        id="step",
    ),
    pytest.param(
        "output_layer.py",
        ["--quick", "--vocab", "4096"],  # every part; Qwen2.5's 151k vocabulary is the benchmark's
        ["vocab_speedup", "logits_mem_ratio"],
        {},
        id="output_layer",
        marks=SLOW,
    ),
    pytest.param(
        "proxy.py",
        ["--skip-vllm", "--smoke"],
        ["proxy_vs_vllm", "overhead_rps", "p50_added_ms"],
        {"proxy_vs_vllm": "nan"},  # --skip-vllm: no vLLM to compare with
        id="proxy",
    ),
    pytest.param(
        "weight_sync.py",
        ["--syncs", "1", "--shape", "smoke"],
        ["sync_memory_s", "sync_disk_s", "speedup", "pause_s"],
        {},
        id="weight_sync",
        marks=SLOW,
    ),
    pytest.param(
        "lora.py",
        ["--steps", "1", "--shape", "smoke", "--adapters", "2"],
        ["sync_bytes_ratio", "sync_speedup", "step_ratio", "swarm_mem_ratio"],
        {},
        id="lora",
        marks=SLOW,
    ),
    pytest.param(
        "startup.py",
        ["--runs", "1", "--engine", "transformers", "--smoke"],
        ["first_step_with_s", "first_step_after_s", "speedup"],
        {},
        id="startup",
        marks=SLOW,
    ),
    pytest.param(
        "algorithms.py",
        ["--smoke", "--algorithms", "gspo", "--seeds", "0", "--steps", "1", "--engine", "transformers"],
        ["steps_to_target_gspo", "final_reward_gspo", "learned_gspo", "eval_pass1_gspo"],
        {"steps_to_target_gspo": "inf"},  # the target is rarely reached in 1 step
        id="algorithms",
        marks=SLOW,
    ),
    pytest.param(
        "load_agents.py",
        ["--agents", "4", "--seconds", "3", "--turns", "1", "--engine", "transformers"],
        ["agents", "episodes_per_s", "chat_p50_ms", "chat_p99_ms", "errors_5xx", "transport_errors"],
        {},
        id="load_agents",
        marks=SLOW,
    ),
]


def result_line(output: str) -> dict[str, float]:
    """The keys of the last ``RESULT`` line, as numbers (``nan`` and ``inf`` among them)."""
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, "no RESULT line"
    pairs = [item.split("=", 1) for item in lines[-1].split()[1:]]
    return {key: float(value) for key, value in pairs}


def run_bench(
    script: str, args: list[str], keys: list[str], non_finite: dict[str, str] | None = None
) -> dict[str, float]:
    """``script`` run with ``args``: it exits 0, and its RESULT line (returned) holds ``keys``, each a
    finite number unless ``non_finite`` allows it ``"nan"`` (a part a flag skipped) or ``"inf"`` (never)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} {' '.join(args)} exited {done.returncode}:\n{output[-4000:]}"
    found = result_line(done.stdout)
    missing = [key for key in keys if key not in found]
    assert not missing, f"{script}: RESULT line lacks {missing}: {found}"
    bad = {key: found[key] for key in keys if not allowed(found[key], (non_finite or {}).get(key))}
    assert not bad, f"{script}: RESULT values that are no figure {bad} (allowed: {non_finite}): {found}"
    return found


def allowed(value: float, non_finite: str | None) -> bool:
    """Whether ``value`` may stand for a key: finite, or the one non-finite value the run allows it."""
    if non_finite == "nan":
        return math.isfinite(value) or math.isnan(value)
    if non_finite == "inf":
        return math.isfinite(value) or value == math.inf
    return math.isfinite(value)


@pytest.mark.parametrize(("script", "args", "keys", "non_finite"), SMOKE)
def test_benchmark_runs_in_its_quickest_mode(
    script: str, args: list[str], keys: list[str], non_finite: dict[str, str]
) -> None:
    run_bench(script, args, keys, non_finite)


def test_scale_smoke_meets_the_bounds_that_hold_at_any_size() -> None:
    """``scale.py --smoke`` (48 open episodes on the real server over the zero engine, one client task under
    strace): unlike the other smoke runs, some of its figures are bounds that do not depend on the size: a
    client task whose server answers makes no metadata operation on the run directory, no client task runs
    a Slurm command, the probe's calls all succeed, and every held episode is committed (the script exits 1
    otherwise). The rates and the away figures (its window is the first minute here) are not checked."""
    keys = ["api_ratio_48_vs_16", "mem_per_open_episode_kb", "store_commits_per_s", "coordinator_s_per_step"]
    keys += ["metaops_per_task_min_away", "fsyncs_per_episode_client", "server_sockets_48"]
    found = run_bench("scale.py", ["--smoke"], keys)
    assert found["metaops_per_task_min_healthy"] == 0, found
    assert found["slurm_cmds_per_task"] == 0, found
    assert found["probe_errors"] == 0 and found["dropped_groups"] == 0, found
