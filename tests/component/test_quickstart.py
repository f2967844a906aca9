"""The main job end to end on this machine: the quickstart topology, local processes, real vLLM and
DeepSpeed, a shorter run. The reward must rise."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import OFF_POLICY, REPO, assert_off_policy_metrics, export, run_module

from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.protocol.weight_handoff import local_export_root

pytestmark = pytest.mark.slow


def run_locally(
    config: str, run: Path, *overrides: str
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """Launch ``configs/<config>`` in the foreground on the local backend; its output and step rows."""
    done = run_module(
        "ajet_hpc.launch", str(REPO / "configs" / config), f"run.dir={run}", *overrides, timeout_s=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, metrics.read_rows(run / "metrics.jsonl")


def test_quickstart_learns(tmp_path: Path) -> None:
    run = tmp_path / "quickstart"
    done, rows = run_locally(
        "quickstart.yaml", run, "servers.policy.trainer.total_steps=14", "servers.policy.trainer.seed=1"
    )
    assert [row["step"] for row in rows] == list(range(1, 15))
    first = statistics.fmean(row["reward_mean"] for row in rows[:5])
    last = statistics.fmean(row["reward_mean"] for row in rows[-5:])
    assert last > first + 0.1, f"reward did not rise: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    assert "reward_mean" in done.stdout and "run finished" in done.stdout  # the table at the end
    for row in rows:
        assert row["policy_version"] == row["step"] and row["weight_sync_s"] is not None
    assert (run / "ckpt" / "policy" / "ds" / "trainer_state.json").is_file()
    assert not local_export_root(run / "ckpt" / "policy").exists()  # the node's disk gets its space back
    server_log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
    starting = server_log.index("trainer ranks starting while the engine loads")  # Coordinator.prestart
    assert starting < server_log.index("vllm engine: loaded"), server_log[-3000:]
    # `ajet-hpc export` of full fine-tuning (ZeRO-2, 2 ranks): step 10 reproduces the engine's version 10
    export(run, tmp_path / "exported", step=10)
    assert_folder_reproduces(tmp_path / "exported", recorded_calls(run, 10))
    assert_eval_rounds(run, [0, 5, 10, 14], samples=4, tasks=16)
    assert "eval group" in done.stdout and "best eval step of policy / math-eval" in done.stdout
    # `ajet-hpc eval`: the checkpoint of step 10, offline, the same agent and held-out tasks
    offline = run_module("ajet_hpc.cli", "eval", str(run), "--step", "10", timeout_s=600)
    assert offline.returncode == 0, offline.stdout[-3000:] + offline.stderr[-3000:]
    (head,) = [line for line in offline.stdout.splitlines() if line.startswith("policy step 10: ")]
    assert head.startswith("policy step 10: 64 episodes of 16 tasks") and "pass@1 " in head, offline.stdout
    (scratch,) = (run / "eval").iterdir()
    with EpisodeReader(scratch / "data" / "policy.h5") as reader:
        offline_eps = [s for s in reader.summaries() if s["state"] == "finished"]
    assert len(offline_eps) == 64 and {tuple(s["policy_versions"]) for s in offline_eps} == {(0,)}


def recount_pass_at_1(rewards: dict[str, list[float]]) -> float:
    """pass@1 of a round by hand: the mean over tasks of the share of its samples with reward 1."""
    return statistics.fmean(sum(r >= 1.0 for r in values) / len(values) for values in rewards.values())


def assert_eval_rounds(run: Path, steps: list[int], samples: int, tasks: int) -> None:
    """Every eval row equals a recount of its round from the server store; each round's episodes were
    served by that step's policy; no eval episode was consumed by a training step (journal, store)."""
    evals = metrics.read_eval_rows(run / "metrics.jsonl", "policy")
    assert [row["step"] for row in evals] == steps
    with EpisodeReader(run / "data" / "policy.h5") as reader:
        summaries = reader.summaries()
        trained_in_store = {
            episode_id for entry in reader.steps() for episode_id in entry.get("episode_ids") or ()
        }
    eval_eps = [s for s in summaries if s["group"] == "math-eval"]
    assert all((s["metadata"] or {}).get("eval_step") is not None for s in eval_eps)
    for row in evals:
        step = row["step"]
        mine = [s for s in eval_eps if s["state"] == "finished" and s["task_id"].startswith(f"s{step}/")]
        assert len(mine) == samples * tasks and row["eval_episodes"] == len(mine) and row["eval_complete"]
        assert {tuple(s["policy_versions"]) for s in mine} == {(step,)}  # served by policy `step` only
        by_task: dict[str, list[float]] = {}
        for s in mine:
            by_task.setdefault(s["task_id"].split("/", 1)[1], []).append(s["reward"])
        assert row["eval_reward_mean"] == pytest.approx(statistics.fmean(s["reward"] for s in mine), abs=1e-6)
        assert row["eval_pass@1"] == pytest.approx(recount_pass_at_1(by_task), abs=1e-6)
        assert {task: (v["n"], v["passed"]) for task, v in row["eval_tasks"].items()} == {
            task: (len(values), sum(r >= 1.0 for r in values)) for task, values in by_task.items()
        }
    assert (
        evals[-1]["eval_best_step"]
        == max(evals, key=lambda r: (r["eval_pass@1"], r["eval_reward_mean"]))["step"]
    )
    eval_ids = {s["episode_id"] for s in eval_eps}
    journal = [json.loads(line) for line in (run / "ckpt" / "policy" / "consumed.jsonl").read_text().split()]
    consumed = {i for entry in journal for i in entry["trained"] + entry["dropped"]}
    assert consumed and not consumed & eval_ids
    assert trained_in_store and not trained_in_store & eval_ids


def test_multi_turn_task_trains_with_merging(tmp_path: Path) -> None:
    """The guessing game (up to four calls per episode) with linear merging: every step trains fewer
    samples than there were calls, and the same trained tokens. Its rows also go to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, rows = run_locally(
        "guess.yaml",
        tmp_path / "guess",
        "servers.policy.trainer.total_steps=3",
        "servers.policy.trainer.tasks_per_batch=4",
        "run.trackers=[tensorboard]",
        *OFF_POLICY,
        "servers.policy.trainer.off_policy.mode=mis",
        "servers.policy.trainer.off_policy.level=sequence",
        "servers.policy.engine=transformers",  # merging and the trackers are the subject, not the engine
    )
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert_off_policy_metrics(rows, "is_masked_frac")
    events = EventAccumulator(str(tmp_path / "guess" / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("policy/samples")] == [
        (r["step"], r["samples"]) for r in rows
    ]
    assert [h.step for h in events.Histograms("policy/response_lengths")] == [1, 2, 3]
    for row in rows:
        assert row["samples"] == row["episodes"], row  # one linear conversation each: one sample
        assert row["samples_before_merge"] > row["samples"]
        assert row["tokens_before_merge"] > row["tokens_after_merge"]
        assert row["merge_snaps"] == {}  # keep_history: re-serialized tool calls do not break prefixes
        assert set(row["drift"]) <= {"history_kept"}


def test_quickstart_with_a_lora_adapter_learns(tmp_path: Path) -> None:
    """configs/quickstart_lora.yaml: the base frozen, a rank-16 adapter trained and served by vLLM's LoRA
    kernels; the reward rises over 12 steps as the full model's does (the config's 20 steps are for
    users: by step 12 its last five steps are 0.4 above its first five), the engine gets the adapter
    folder each step and the checkpoint holds the adapter, not the base."""
    run = tmp_path / "lora"
    _, rows = run_locally(
        "quickstart_lora.yaml", run, "servers.policy.trainer.seed=1", "servers.policy.trainer.total_steps=12"
    )
    assert [row["step"] for row in rows] == list(range(1, 13))
    first = statistics.fmean(row["reward_mean"] for row in rows[:5])
    last = statistics.fmean(row["reward_mean"] for row in rows[-5:])
    assert last > first + 0.1, f"reward did not rise: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    for row in rows:
        assert row["policy_version"] == row["step"] and row["weight_sync"] == "disk"
    server_log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
    assert "LoRA rank 16 on policy: the engine serves adapter version 0" in server_log
    assert "LoRA rank 16: " in (run / "ckpt" / "policy" / "ranks.log").read_text()  # "... trained parameters"
    states = torch.load(
        run / "ckpt" / "policy" / "ds" / "step-000012" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,  # DeepSpeed's own file, written by this test's run
    )
    assert states["module"] and all(".lora_" in name for name in states["module"])  # the adapter alone
    # `ajet-hpc export` of step 10: merged and as an adapter, each reproduces what the engine recorded at
    # policy version 10; vLLM loads the merged folder as `vllm serve` would
    calls = recorded_calls(run, 10)
    export(run, tmp_path / "merged", step=10)
    assert_folder_reproduces(tmp_path / "merged", calls)
    export(run, tmp_path / "adapter", "--adapter", step=10)
    assert_folder_reproduces(tmp_path / "adapter", calls, base=run / "models" / "tiny")
    script = tmp_path / "vllm_loads.py"  # a file: vLLM's spawned processes import the main module again
    script.write_text(VLLM_LOADS)
    served = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "merged")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert served.returncode == 0 and "generated" in served.stdout, (
        served.stdout[-2000:] + served.stderr[-2000:]
    )


VLLM_LOADS = """
import sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True, dtype="float32")
    out = llm.generate(["2+3="], SamplingParams(max_tokens=4, temperature=0))
    print("generated", out[0].outputs[0].token_ids)
"""
"""`vllm serve`'s load of a folder, through ``vllm.LLM`` in a process of its own."""


def recorded_calls(run: Path, version: int) -> list[tuple[list[int], int, list[float]]]:
    """(token ids, prompt length, the engine's recorded logprobs) of every call sampled whole by policy
    ``version`` (not one whose tokens span a weight swap: its later tokens came from the next version)."""
    from ajet_hpc.offline.export import sample_rows
    from ajet_hpc.offline.run import Run
    from ajet_hpc.offline.views import EpisodeFilter

    with Run.open(run) as opened:
        (model,) = opened.models()
        rows = [
            r
            for r in sample_rows(model, EpisodeFilter())
            if r["policy_version"] == version and not r["version_spans"]
        ]
    return [(r["token_ids"], r["prompt_tokens"], r["logprobs"][r["prompt_tokens"] :]) for r in rows]


def assert_folder_reproduces(folder: Path, calls, base: Path | None = None) -> None:
    """A transformers load of ``folder`` (a model, or an adapter on ``base``) gives the recorded logprobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    net: Any = AutoModelForCausalLM.from_pretrained(base or folder, dtype=torch.float32)
    if base is not None:
        net = PeftModel.from_pretrained(net, folder)
    net.eval()
    assert calls, "no call was recorded at the exported step's policy version"
    worst = 0.0
    for ids, prompt, recorded in calls[:32]:
        with torch.no_grad():
            table = torch.log_softmax(net(torch.tensor([ids])).logits[0, prompt - 1 : -1], dim=-1)
        mine = table.gather(1, torch.tensor(ids[prompt:])[:, None])[:, 0].tolist()
        worst = max(worst, *(abs(a - b) for a, b in zip(mine, recorded, strict=True)))
    assert worst <= 1e-3, worst
