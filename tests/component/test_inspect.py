"""The inspector on a real run directory: a topology, metrics.jsonl and a real HDF5 server store with real
timelines (the context tracker on the tiny tokenizer), read through ``python -m ajet_hpc.offline``'s
``main``, also while a writer is still appending."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.config import dump_topology, load_topology
from ajet_hpc.engine.tiny import build_tokenizer
from ajet_hpc.offline.cli import main
from ajet_hpc.offline.run import Run
from ajet_hpc.storage.episode_store_writer import EpisodeWriter
from ajet_hpc.storage.records import EpisodeRecord, StepRecord
from ajet_hpc.tracking.context import ContextTracker
from ajet_hpc.tracking.timeline import Timeline

T0 = 1_700_000_000.0
WEATHER_TURNS = [  # (answer as sampled, reply returned to the agent, what the agent adds next)
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>',
        None,
        "tool:sunny",
    ),
    ("It is sunny.<|im_end|>", "It is sunny.", "user:And Rome?"),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call><|im_end|>',
        None,
        "tool:rain",
    ),
    ("Rainy in Rome.<|im_end|>", "Rainy in Rome.", "user:Thanks!"),
    ("You're welcome.<|im_end|>", "You're welcome.", None),
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# id, task, group, state, reward, reason
SHORT_EPISODES = [
    ("ep-a1", "t-math-1", "math", "finished", 0.0, None),
    ("ep-a2", "t-math-1", "math", "finished", 1.0, None),
    ("ep-a3", "t-math-2", "math", "finished", 0.5, None),
    ("ep-a4", "t-math-2", "math", "finished", 1.0, None),
    ("ep-dropped", "t-math-3", "math", "dropped", None, "no call for 600 s (episode_timeout_s)"),
    ("ep-aborted", "t-math-3", "math", "aborted", None, "agent raised ValueError"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def record(
    tracker: ContextTracker,
    messages: list[dict[str, Any]],
    reply: dict[str, Any],
    sampled: str,
    at: float,
    tools: list[dict[str, Any]] | None = None,
) -> Timeline:
    """One model call as the server makes it: plan the prompt, 'sample' ``sampled``, record."""
    plan = tracker.build_prompt(messages, tools)
    ids = encode(tracker.tokenizer, sampled)
    return tracker.record(
        plan, ids, [-0.25] * len(ids), reply, "stop", 1, started_at=at, finished_at=at + 0.5
    )


def five_turn_timelines(tokenizer) -> list[Timeline]:
    tracker = ContextTracker(tokenizer)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    for turn, (sampled, content, then) in enumerate(WEATHER_TURNS):
        city = "Paris" if turn == 0 else "Rome"
        calls: list[dict[str, Any]] = [
            {"id": f"c{turn}", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        ]
        calls[0]["function"]["arguments"] = json.dumps({"city": city})
        reply = {"role": "assistant", "content": content, **({} if content else {"tool_calls": calls})}
        record(tracker, messages, reply, sampled, T0 + 2 * turn, TOOLS)
        messages = [*messages, reply]
        if then:
            role, _, text = then.partition(":")
            messages.append(
                {"role": role, "content": text, **({"tool_call_id": f"c{turn}"} if role == "tool" else {})}
            )
    return tracker.timelines


def one_turn_timelines(tokenizer, question: str, answer: str, edited: bool = False) -> list[Timeline]:
    """One call; ``edited`` puts an assistant answer the server never produced in the prompt (drift)."""
    tracker = ContextTracker(tokenizer)
    messages = [{"role": "user", "content": question}]
    if edited:
        messages += [
            {"role": "assistant", "content": "I edited this."},
            {"role": "user", "content": "Again?"},
        ]
    record(tracker, messages, {"role": "assistant", "content": answer}, answer + "<|im_end|>", T0)
    return tracker.timelines


def episode(
    episode_id: str, task: str, group: str, state: str, reward, reason, timelines, **extra
) -> EpisodeRecord:
    fields = {
        "episode_id": episode_id,
        "model": "policy",
        "task_id": task,
        "group": group,
        "state": state,
        "reward": reward,
        "turn_rewards": None,
        "reason": reason,
        "metadata": {"seed": 7},
        "started_at": T0,
        "ended_at": T0 + 10,
        "timelines": timelines,
        **extra,
    }
    return EpisodeRecord(**fields)


def samples_of(record_: EpisodeRecord, advantage: float) -> list[Sample]:
    out = []
    for timeline in record_.timelines:
        mask = timeline.loss_mask
        logprobs = [0.0] * len(timeline.prompt_ids) + timeline.response_logprobs
        advantages = [advantage * m for m in mask]
        out.append(
            Sample(
                timeline.token_ids, mask, logprobs, advantages, 1, record_.episode_id, record_.task_id or ""
            )
        )
    return out


def metrics_row(step: int, reward: float) -> dict[str, Any]:
    return {
        "step": step,
        "model": "policy",
        "reward_mean": reward,
        "reward_std": 0.25,
        "loss": 0.1,
        "kl": 0.0,
        "entropy": 1.5,
        "tokens": 400 + step,
        "samples": 4,
        "episodes": 4,
        "step_time_s": 2.0 + step,
        "train_time_s": 1.5,
        "weight_sync_s": 0.2,
        "policy_version": step,
        "staleness": 0.0,
    }


def write_topology(run: Path) -> None:
    run.mkdir(parents=True)
    data = {
        "run": {"name": "inspect-test", "dir": str(run)},
        "servers": [{"name": "policy", "model": "builtin:tiny", "gpus_per_node": 0}],
    }
    (run / "topology.yaml").write_text(dump_topology(load_topology(data)))


def short_records(tokenizer) -> list[EpisodeRecord]:
    return [
        episode(
            eid, task, group, state, reward, reason, one_turn_timelines(tokenizer, f"Q {eid}?", f"A {eid}")
        )
        for eid, task, group, state, reward, reason in SHORT_EPISODES
    ]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer) -> Path:
    """Episodes: the 5-turn weather one, 4 short finished ones, a dropped, an aborted, one with drift."""
    run = tmp_path_factory.mktemp("inspect") / "run"
    write_topology(run)
    rows = [metrics_row(1, 0.625), metrics_row(2, 0.75)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run / "data").mkdir()
    five = episode(
        "ep-weather",
        "t-weather",
        "chat",
        "finished",
        1.0,
        None,
        five_turn_timelines(tokenizer),
        turn_rewards=[0.1, 0.0, 0.2, 0.0, 0.5],
    )
    short = short_records(tokenizer)
    drift = episode(
        "ep-drift", "t-math-4", "math", "finished", 0.0, None, one_turn_timelines(tokenizer, "Hi", "Ho", True)
    )
    writer = EpisodeWriter(run / "data" / "policy.h5")
    for item in [five, *short, drift]:
        writer.append_episode(item)
    trained = short[:4]
    samples = [
        s for rec, adv in zip(trained, [-1.0, 1.0, -1.0, 1.0], strict=True) for s in samples_of(rec, adv)
    ]
    writer.append_step(StepRecord(step=1, metrics=metrics_row(1, 0.625), samples=samples))
    writer.close()
    return run


def inspect(capsys, *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------------- summary
def test_summary_reports_steps_episodes_tasks_drift_and_failures(run_dir: Path, capsys) -> None:
    code, out, err = inspect(capsys, run_dir, "summary")
    assert code == 0, err
    assert "model policy" in out
    assert "steps      2 (last 2, policy version 2)" in out
    assert "episodes   8 (finished 6, dropped 1, aborted 1)" in out
    assert "tasks      5 " in out
    assert "0.625" in out and "0.750" in out  # reward by step, from metrics.jsonl
    assert "merge      1.00 samples per timeline (samples 4 / timelines 4" in out
    assert "drift      1 events (answer_not_found 1)" in out
    assert "failures   2" in out
    assert "1 x dropped: no call for 600 s (episode_timeout_s)" in out
    assert "1 x aborted: agent raised ValueError" in out
    code, same, _ = inspect(capsys, run_dir, "summary", "--model", "policy")
    assert (code, same) == (0, out)


def test_summary_of_metrics_only_reads_the_merge_ratio_from_them(tmp_path: Path, capsys) -> None:
    run = tmp_path / "metrics-only"
    write_topology(run)
    rows = [{**metrics_row(step, 0.5), "samples_before_merge": 8, "samples": 6} for step in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, out, err = inspect(capsys, run, "summary")
    assert code == 0, err
    assert "model policy  [no store yet (policy.h5)]" in out
    assert "steps      3 (last 3, policy version 3)" in out and "episodes   0" in out
    assert "merge      0.75 samples per timeline (samples 18 / samples_before_merge 24, metrics.jsonl)" in out
    code, _, err = inspect(capsys, run, "plot", "-o", tmp_path / "metrics.png")
    assert code == 0 and (tmp_path / "metrics.png").stat().st_size > 0, err


# ------------------------------------------------------------------------------------------------ episodes
def episode_ids(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:-1]]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], ["ep-weather", "ep-a1", "ep-a2", "ep-a3", "ep-a4", "ep-dropped", "ep-aborted", "ep-drift"]),
        (["--state", "dropped"], ["ep-dropped"]),
        (["--task", "t-math-2"], ["ep-a3", "ep-a4"]),
        (["--group", "chat"], ["ep-weather"]),
        (["--min-reward", "0.5"], ["ep-weather", "ep-a2", "ep-a3", "ep-a4"]),
        (["--max-reward", "0.5", "--group", "math"], ["ep-a1", "ep-a3", "ep-drift"]),
        (["--step", "1"], ["ep-a1", "ep-a2", "ep-a3", "ep-a4"]),
        (["--limit", "2"], ["ep-aborted", "ep-drift"]),
    ],
)
def test_episodes_filters(run_dir: Path, capsys, flags: list[str], expected: list[str]) -> None:
    code, out, err = inspect(capsys, run_dir, "episodes", *flags)
    assert code == 0, err
    assert out.splitlines()[0].split() == [
        "id",
        "task",
        "group",
        "state",
        "reward",
        "calls",
        "tokens",
        "drift",
        "versions",
    ]
    assert episode_ids(out) == expected
    assert out.splitlines()[-1] == f"{len(expected)} episodes"


def test_episodes_row_shows_calls_drift_and_versions(run_dir: Path, capsys) -> None:
    _, out, _ = inspect(capsys, run_dir, "episodes", "--group", "chat")
    row = out.splitlines()[1].split()
    assert row[:6] == ["ep-weather", "t-weather", "chat", "finished", "1.000", "5"]
    assert row[-2:] == ["0", "1"]
    _, out, _ = inspect(capsys, run_dir, "episodes", "--task", "t-math-4")
    assert out.splitlines()[1].split()[-2] == "1"


# ---------------------------------------------------------------------------------------------------- show
def test_show_prints_five_turns_with_the_models_tokens_marked(run_dir: Path, capsys, tokenizer) -> None:
    code, out, err = inspect(capsys, run_dir, "show", "ep-weather")
    assert code == 0, err
    assert "episode ep-weather  (model policy)" in out
    assert "turn rewards 0.100 0.000 0.200 0.000 0.500" in out
    assert [line.split(" ── ")[0] for line in out.splitlines() if line.startswith("── turn")] == [
        f"── turn {i}/5" for i in range(1, 6)
    ]
    # every answer, exactly as sampled, is one trained model span; the prompts before it are not
    for sampled, _, _ in WEATHER_TURNS:
        assert f"[model]{sampled}[/model]" in out
    assert out.count("[model]") == 5  # later prompts show only what is new, so no answer twice
    assert "[system]<|im_start|>assistant\n[/system]" in out
    assert "[user]<|im_start|>user\nAnd Rome?<|im_end|>\n[/user]" in out
    assert "[tool]<|im_start|>tool\nrain<|im_end|>\n[/tool]" in out
    masked = [line for line in out.splitlines() if line.startswith("loss-masked tokens:")]
    assert [line.split()[2] for line in masked] == [str(len(encode(tokenizer, t[0]))) for t in WEATHER_TURNS]
    assert '  reply assistant: -> get_weather({"city": "Rome"})' in out
    assert "turn reward 0.500" in out


def test_show_full_marks_reused_answers_as_context(run_dir: Path, capsys) -> None:
    _, out, _ = inspect(capsys, run_dir, "show", "ep-weather", "--full", "--turn", "5")
    assert "── turn 5/5" in out and "── turn 4/5" not in out
    assert out.count("[model mask=0]") == 4  # the four earlier answers, spliced back into the prompt
    assert out.count("[model]") == 1


def test_show_tokens_table_and_colour(run_dir: Path, capsys, tokenizer) -> None:
    code, out, _ = inspect(capsys, run_dir, "show", "ep-a1", "--tokens")
    assert code == 0
    header = next(line for line in out.splitlines() if line.startswith("pos"))
    assert header.split() == ["pos", "id", "text", "author", "mask", "logprob"]
    rows = [line.split() for line in out.splitlines() if line.split()[-3:-1] == ["model", "1"]]
    assert len(rows) == len(encode(tokenizer, "A ep-a1<|im_end|>"))
    assert all(row[-1] == "-0.250" for row in rows)
    _, out, _ = inspect(capsys, run_dir, "show", "ep-a1", "--color", "always")
    assert "\033[1;32mA ep-a1<|im_end|>\033[0m" in out and "[model]" not in out


def test_show_by_prefix_and_drift(run_dir: Path, capsys) -> None:
    code, out, _ = inspect(capsys, run_dir, "show", "ep-dri")
    assert code == 0
    assert "drift: message 1 answer_not_found:" in out
    assert "[system]<|im_start|>assistant\nI edited this.<|im_end|>\n[/system]" in out


def test_show_a_dropped_episode_gives_its_reason(run_dir: Path, capsys) -> None:
    _, out, _ = inspect(capsys, run_dir, "show", "ep-dropped")
    assert "state dropped  reward -  reason: no call for 600 s (episode_timeout_s)" in out


# -------------------------------------------------------------------------------------------------- export
def test_export_jsonl_per_episode_and_per_sample(run_dir: Path, tmp_path: Path, capsys) -> None:
    out_file = tmp_path / "episodes.jsonl"
    code, out, err = inspect(capsys, run_dir, "export", "--format", "jsonl", "-o", out_file)
    assert code == 0, err
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(rows) == 8 and out.startswith("wrote 8 episode rows")
    weather = next(row for row in rows if row["episode_id"] == "ep-weather")
    assert (weather["reward"], weather["calls"], len(weather["messages"])) == (1.0, 5, 11)
    assert weather["messages"][-1]["content"] == "You're welcome."

    samples_file = tmp_path / "samples.jsonl"
    code, _, _ = inspect(
        capsys, run_dir, "export", "--per", "sample", "--state", "finished", "-o", samples_file
    )
    rows = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert code == 0 and len(rows) == 5 + 4 + 1
    for row in rows:
        assert (
            len(row["token_ids"])
            == len(row["loss_mask"])
            == len(row["logprobs"])
            == len(row["token_authors"])
        )
    by_id = {row["episode_id"]: row for row in rows}
    assert (by_id["ep-a1"]["step"], by_id["ep-a1"]["advantage"]) == (1, -1.0)
    assert (by_id["ep-a2"]["step"], by_id["ep-a2"]["advantage"]) == (1, 1.0)
    assert by_id["ep-drift"]["step"] is None and by_id["ep-drift"]["advantage"] is None
    assert [row["turn_reward"] for row in rows if row["episode_id"] == "ep-weather"] == [
        0.1,
        0.0,
        0.2,
        0.0,
        0.5,
    ]


def test_export_parquet(run_dir: Path, tmp_path: Path, capsys) -> None:
    episodes_file, samples_file = tmp_path / "episodes.parquet", tmp_path / "samples.parquet"
    assert inspect(capsys, run_dir, "export", "-o", episodes_file)[0] == 0  # format from the suffix
    table = pq.read_table(episodes_file)
    assert table.num_rows == 8
    assert json.loads(table.column("messages")[0].as_py())[0] == {"role": "system", "content": "Be brief."}
    code, _, _ = inspect(
        capsys, run_dir, "export", "--format", "parquet", "--per", "sample", "-o", samples_file
    )
    table = pq.read_table(samples_file)
    assert code == 0 and table.num_rows == 5 + 6 + 1
    assert {"token_ids", "loss_mask", "logprobs", "advantage", "reward"} <= set(table.column_names)


# ---------------------------------------------------------------------------------------------------- plot
def test_plot_writes_a_png(run_dir: Path, tmp_path: Path, capsys) -> None:
    from matplotlib.image import imread

    png = tmp_path / "run.png"
    code, _, err = inspect(capsys, run_dir, "plot", "-o", png)
    assert code == 0, err
    image = imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert np.unique(image.reshape(-1, image.shape[-1]), axis=0).shape[0] > 10  # not one colour


# ----------------------------------------------------------------------------------------------- live runs
def test_reads_a_store_while_a_writer_appends(tmp_path: Path, tokenizer, capsys) -> None:
    run = tmp_path / "live"
    write_topology(run)
    (run / "data").mkdir()
    records = short_records(tokenizer)
    first, more = threading.Event(), threading.Event()
    done = threading.Event()
    failures: list[BaseException] = []

    def write() -> None:
        try:
            writer = EpisodeWriter(run / "data" / "policy.h5")
            for item in records[:2]:
                writer.append_episode(item)
            first.set()
            more.wait(timeout=30)
            for item in records[2:]:
                writer.append_episode(item)
            done.set()
            more.wait(timeout=30)  # still open while the readers look
            writer.close()
        except BaseException as exc:  # surfaced in the test thread
            failures.append(exc)
            first.set()
            done.set()

    thread = threading.Thread(target=write)
    thread.start()
    try:
        assert first.wait(timeout=30) and not failures
        code, out, err = inspect(capsys, run, "summary")
        assert code == 0, err
        assert "episodes   2 (finished 2)" in out
        with Run.open(run) as opened:
            (model,) = opened.models()
            assert len(model.summaries()) == 2
            more.set()
            assert done.wait(timeout=30) and not failures
            more.clear()
            deadline = time.monotonic() + 10
            while len(model.summaries()) < len(records) and time.monotonic() < deadline:
                opened.refresh()
            assert len(model.summaries()) == len(records)
        code, out, _ = inspect(capsys, run, "summary")
        assert "episodes   6 (finished 4, dropped 1, aborted 1)" in out
    finally:
        more.set()
        thread.join(timeout=30)
    assert not failures


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_exit_2_with_a_message(run_dir: Path, tmp_path: Path, capsys) -> None:
    cases = [
        ([tmp_path / "nowhere", "summary"], "is not a run directory"),
        ([run_dir, "summary", "--model", "critic"], "unknown model 'critic'; models of this run: policy"),
        ([run_dir, "show", "ep-nope"], "no episode 'ep-nope'"),
        ([run_dir, "show", "ep-a"], "ambiguous"),
        ([run_dir, "show", "ep-weather", "--turn", "9"], "has 5 calls"),
        ([run_dir, "episodes", "--step", "7"], "no step 7"),
        ([run_dir, "export", "-o", tmp_path / "x.csv"], "cannot tell the format"),
        ([run_dir, "export", "-o", tmp_path / "no" / "x.jsonl"], "does not exist"),
        ([run_dir, "export", "--task", "nope", "-o", tmp_path / "x.jsonl"], "no episodes match"),
    ]
    for argv, message in cases:
        code, out, err = inspect(capsys, *argv)
        assert (code, out) == (2, ""), argv
        assert err.startswith("error: ") and message in err, (argv, err)
        assert "Traceback" not in err


def test_an_empty_run_exits_2(tmp_path: Path, capsys) -> None:
    run = tmp_path / "empty"
    write_topology(run)
    for command in (["summary"], ["episodes"], ["plot", "-o", tmp_path / "x.png"], ["show", "ep-1"]):
        code, _, err = inspect(capsys, run, *command)
        assert code == 2 and "run 'inspect-test' has nothing recorded yet" in err, (command, err)


def test_a_store_that_is_not_a_store_exits_2(tmp_path: Path, capsys) -> None:
    run = tmp_path / "broken"
    write_topology(run)
    (run / "data").mkdir()
    (run / "data" / "policy.h5").write_bytes(b"not hdf5 at all")
    code, _, err = inspect(capsys, run, "summary")
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err


def test_a_store_of_an_older_layout_exits_2(tmp_path: Path, tokenizer, capsys) -> None:
    import h5py

    run = tmp_path / "old"
    write_topology(run)
    with EpisodeWriter(run / "data" / "policy.h5") as writer:
        writer.append_episode(short_records(tokenizer)[0])
    with h5py.File(run / "data" / "policy.h5", "r+", locking=False) as f:
        f.attrs["layout_version"] = 0
    for command in (["summary"], ["episodes"], ["show", "ep-a1"]):
        code, out, err = inspect(capsys, run, *command)
        assert (code, out) == (2, ""), command
        assert err.startswith("error: ") and "store layout version 0" in err and "Traceback" not in err


def test_usage_errors_return_2(run_dir: Path, capsys) -> None:
    assert inspect(capsys, run_dir, "frobnicate")[0] == 2
    assert inspect(capsys, run_dir, "export", "--format", "csv", "-o", "x")[0] == 2
