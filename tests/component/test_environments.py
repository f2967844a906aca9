"""Environments users bring, through the front door: the real package from the registry in the group's own
client runtime (``env:``), a short training run on the local backend, rewards from the library's scorer."""

from __future__ import annotations

import itertools
import json
import re
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from scripted_model import TITLED_TOOLS, TOOLS
from support import REPO, assert_off_policy_metrics, run_module, write_topology

from ajet_hpc.config import load_topology
from ajet_hpc.environments.calculator import tools as calculator
from ajet_hpc.environments.reasoning_gym.source import parse_spec
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.trainer.coordinator import metrics

pytestmark = pytest.mark.slow


def in_runtime(run: Path, env: str, script: str, payload: Any = None) -> Any:
    """The JSON a script prints when run in the group's runtime ``RUN/envs/<env>-*`` (built at launch),
    fed ``payload`` as JSON on stdin: each library checks our results apart from our code."""
    (python,) = (run / "envs").glob(f"{env}-*/bin/python")
    done = subprocess.run(
        [str(python), "-c", script],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return json.loads(done.stdout)


RESCORE = """
import json, sys
import reasoning_gym
out = []
for name, config, index, answer in json.load(sys.stdin):
    dataset = reasoning_gym.create_dataset(name, **config)
    out.append(dataset.score_answer(answer, dataset[index]))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def rg_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/reasoning_gym.yaml for 3 steps with configs/math_answers.yaml's group beside its three (a
    quarter of each batch's tasks each): one server start for both environments, each group in its own
    runtime (envs/reasoning-gym.txt, envs/math.txt)."""
    folder = tmp_path_factory.mktemp("rg-run")
    run = folder / "run"
    topology = yaml.safe_load((REPO / "configs" / "reasoning_gym.yaml").read_text())
    (sums,) = yaml.safe_load((REPO / "configs" / "math_answers.yaml").read_text())["clients"]
    topology["clients"].append(sums)
    for group in topology["clients"]:
        group["ratio"] = 0.25
    topology["servers"][0]["models"][0]["trainer"] |= {
        "total_steps": 3,
        "tasks_per_batch": 8,
    }  # 2 a group a step
    topology["servers"][0]["engine"]["kind"] = (
        "transformers"  # the environments are the subject, not the engine
    )
    topology["run"]["dir"] = str(run)
    done = run_module("ajet_hpc.launch", str(write_topology(folder, topology)), timeout_s=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    server_log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
    assert "unexpected error on" not in server_log and "Traceback" not in server_log  # no 5xx answered
    return run


def test_a_reasoning_gym_mix_of_three_datasets_trains_with_rewards_per_dataset(rg_run: Path) -> None:
    """configs/reasoning_gym.yaml's groups (the shared run): chain_sum, gcd and count_bits as three groups
    in one runtime; every step trains all three (rewards per dataset in its row), every episode is stored
    with the answer it was scored on, and reasoning-gym itself, run apart from our code, gives the same
    rewards."""
    run = rg_run
    config = REPO / "configs" / "reasoning_gym.yaml"
    groups = {"chain_sum", "gcd", "count_bits"}
    rows = metrics.read_rows(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert set(row["reward_by_group"]) == groups | {"sums"}
        assert row["client_groups"] == dict.fromkeys(groups | {"sums"}, 2)
    with EpisodeReader(run / "data" / "policy.h5") as reader:
        finished = [s for s in reader.summaries() if s["state"] == "finished" and s["group"] in groups]
    assert {s["group"] for s in finished} == groups
    assert all(s["metadata"]["dataset"] == s["group"] for s in finished)
    sources = {g.name: parse_spec(g.tasks) for g in load_topology(config).clients}
    asked = []
    for s in finished[:60]:
        name, params = sources[s["group"]]
        index = int(re.fullmatch(rf"{name}-1-(\d+)", s["task_id"])[1])  # type: ignore[index]
        asked.append([name, {"size": 200, "seed": 1, **params}, index, s["metadata"]["answer"]])
    rescored = in_runtime(run, "reasoning-gym", RESCORE, asked)
    assert rescored == pytest.approx([s["reward"] for s in finished[:60]])


VERIFY = """
import json, sys
from math_verify import parse, verify
print(json.dumps([float(verify(parse(gold), parse(answer))) for answer, gold in json.load(sys.stdin)]))
"""

HELPER = """
import json
from concurrent.futures import ThreadPoolExecutor
from ajet_hpc.environments.rewards.math_answer import math_reward
cases = [("\\\\boxed{1/2}", "0.5"), ("so it is \\\\frac{1}{2}", "1/2"), ("7", "8")]
cases += [("no number", "3"), ("3.0", "3")]
with ThreadPoolExecutor(4) as pool:  # from threads, as a runner calls agents
    print(json.dumps(list(pool.map(lambda case: math_reward(*case), cases))))
"""


def test_math_verify_rewards_math_answers_in_a_short_training_run(rg_run: Path) -> None:
    """configs/math_answers.yaml's group (the shared run), in the runtime envs/math.txt: every episode's
    reward is math-verify's verdict on its answer against the oracle answer (checked with math-verify
    itself), and the helper gives math's answer from agent threads (equivalent forms match, others do
    not)."""
    run = rg_run
    config = REPO / "configs" / "math_answers.yaml"
    with EpisodeReader(run / "data" / "policy.h5") as reader:
        finished = [s for s in reader.summaries() if s["state"] == "finished" and s["group"] == "sums"]
    assert finished
    (group,) = load_topology(config).clients
    name, params = parse_spec(group.tasks)
    gold_of = in_runtime(run, "math", GOLDS, [name, {"size": 200, "seed": 2, **params}])
    pairs = [[s["metadata"]["answer"], gold_of[int(s["task_id"].rsplit("-", 1)[1])]] for s in finished]
    assert in_runtime(run, "math", VERIFY, pairs) == [s["reward"] for s in finished]
    assert in_runtime(run, "math", HELPER) == [1.0, 1.0, 0.0, 0.0, 1.0]


GOLDS = """
import json, sys
import reasoning_gym
name, config = json.load(sys.stdin)
dataset = reasoning_gym.create_dataset(name, **config)
print(json.dumps([dataset[i]["answer"] for i in range(len(dataset))]))
"""


ATTACKS = {  # task id -> (hostile code, what may stop it: CPU or wall time, whichever comes first under load)
    "read-secret": ("print(open({secret!r}).read())", ("exit 1: FileNotFoundError",)),
    "socket": ("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)", ("exit 1: ",)),
    "fork-bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  ("wall_time", "cpu_time")),
    "allocate-10g": ("blob = bytearray(10 * 1024**3)", ("memory: MemoryError",)),
    "loop": ("while True:\n    pass", ("cpu_time", "wall_time")),
}  # fmt: skip


@dataclass
class SharedRun:
    """One short training run whose groups several tests examine (one server start for all of them)."""

    dir: Path
    finished: list[dict]
    summaries: list[dict]

    def group(self, name: str) -> list[dict]:
        return [s for s in self.finished if s["group"] == name]


def launch_shared(folder: Path, topology: dict) -> SharedRun:
    run = folder / "run"
    topology["run"]["dir"] = str(run)
    done = run_module("ajet_hpc.launch", str(write_topology(folder, topology)), timeout_s=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = sorted({row["step"] for row in metrics.read_rows(run / "metrics.jsonl")})
    assert steps == [1, 2, 3]
    with EpisodeReader(run / "data" / "policy.h5") as reader:
        summaries = reader.summaries()
    server_log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
    assert "unexpected error on" not in server_log and "Traceback" not in server_log  # no 5xx answered
    return SharedRun(run, [s for s in summaries if s["state"] == "finished"], summaries)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SharedRun, socket.socket]]:
    """configs/code.yaml for 3 steps on builtin:tiny with one more group, ``attacks``, whose episodes run
    hostile code in place of the model's reply (tests.fixture_agents.sandbox_attack)."""
    folder = tmp_path_factory.mktemp("tiny-run")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    attacks = folder / "attacks.jsonl"
    with attacks.open("w") as f:
        for task_id, (code, _) in ATTACKS.items():
            code = code.format(secret=str(folder / "run" / "secret"), port=port)
            data = {"question": "Write f(x).", "function": "f", "tests": [[[1], 1]], "attack": code}
            f.write(json.dumps({"id": task_id, **data}) + "\n")
    topology = yaml.safe_load((REPO / "configs" / "code.yaml").read_text())
    topology["servers"][0]["models"][0]["trainer"]["total_steps"] = 3
    topology["servers"][0]["engine"]["kind"] = "transformers"  # the sandbox is the subject, not the engine
    topology["clients"].append(
        {**topology["clients"][0], "name": "attacks", "agent": "tests.fixture_agents:sandbox_attack"}
        | {"tasks": str(attacks), "repeats": 1, "in_flight": len(ATTACKS)}
    )
    yield launch_shared(folder, topology), listener
    listener.close()


def test_code_tasks_train_through_the_sandbox(tiny_run: tuple[SharedRun, socket.socket]) -> None:
    """builtin:code: every episode's reward is the share of its hidden tests that passed in the sandbox
    (re-running the stored code gives it again), with the sandbox's verdict in its metadata."""
    from ajet_hpc.environments.code.agent import check

    run, _ = tiny_run
    code_episodes = run.group("code")
    assert code_episodes and all(
        s["metadata"]["sandbox"] and s["metadata"]["isolation"] == "bwrap" for s in code_episodes
    )
    sample = code_episodes[:40]
    rescored = [check(s["metadata"]["code"], task_data(s["task_id"])).reward for s in sample]
    assert rescored == [s["reward"] for s in sample]


def test_the_sandbox_stops_hostile_code_and_the_client_task_goes_on(
    tiny_run: tuple[SharedRun, socket.socket],
) -> None:
    """Reading the run's secret, opening a socket to a listener of this test, a fork bomb, 10 GB, an
    endless loop: each is stopped by its limit and earns 0 with the reason in its metadata, the client task
    goes on committing episodes, and no process of the sandbox outlives the run."""
    from ajet_hpc.environments.code.agent import LIMITS
    from ajet_hpc.environments.sandbox import isolation_in_use

    assert isolation_in_use() == "bwrap"  # CI installs bubblewrap: the fallback would hide a broken sandbox
    run, listener = tiny_run
    hostile = {s["task_id"]: s for s in run.group("attacks")}
    assert set(hostile) == set(ATTACKS)
    for task_id, (_, stopped_by) in ATTACKS.items():
        meta = hostile[task_id]["metadata"]
        assert meta["sandbox"].startswith(stopped_by) and hostile[task_id]["reward"] == 0.0, (task_id, meta)
        assert meta["isolation"] == "bwrap" and meta["sandbox_s"] < LIMITS.wall_s + 30
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the test's listener
    last_attack = max(s["ended_at"] for s in hostile.values())
    assert any(s["ended_at"] > last_attack for s in run.group("code"))  # the client task kept going
    assert not sandbox_processes()


RESCORE_VERIFIERS = """
import asyncio, json, sys
import verifiers.v1 as vf
from ajet_hpc.environments.verifiers import adapter as verifiers_env
async def score(taskset, data, answer):
    env = verifiers_env.load_env(taskset)
    task = verifiers_env.task_of(env, data)
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                     agent=vf.AgentInfo(config=vf.AgentConfig()), root_reply=answer)
    await task.score(trace)
    return trace.reward
print(json.dumps([asyncio.run(score(*case)) for case in json.load(sys.stdin)]))
"""


def test_verifiers_environments_train_with_their_own_rewards(tools_run: SharedRun) -> None:
    """configs/verifiers.yaml's groups: verifiers drives every episode (its interception server relays the
    model calls to the episode's endpoint) and every one finishes with the reward verifiers itself gives the
    stored answer, scored apart from the training (Task.score, the task's own @vf.reward). ``reverse`` is
    one turn; in ``sums`` verifiers serves the task's toolset over MCP, executes the model's real tool calls
    and asks again with their results: several turns."""
    episodes = [s for s in tools_run.summaries if s["group"] in ("reverse", "sums")]
    assert all(s["state"] == "finished" or "is finished" in s["reason"] for s in episodes), episodes
    finished = [s for s in tools_run.finished if s["group"] in ("reverse", "sums")]
    assert {s["group"] for s in finished} == {"reverse", "sums"}
    cases = [[s["metadata"]["taskset"], s["metadata"]["task"], s["metadata"]["answer"]] for s in finished]
    rescored = in_runtime(tools_run.dir, "verifiers", RESCORE_VERIFIERS, cases)
    assert rescored == pytest.approx([s["reward"] for s in finished])
    sums = tools_run.group("sums")
    with EpisodeReader(tools_run.dir / "data" / "policy.h5") as reader:
        timelines = [reader.episode(s["episode_id"]).timelines for s in sums]
    # the model samples at temperature 1: not every first answer is a tool call, but every one that is
    # (the last message of a call's record is its reply) was executed by verifiers and asked about again
    called = [t for t in timelines if t[0].messages[-1].get("tool_calls")]
    with_tool = [t for t in timelines if any(m.get("role") == "tool" for m in t[-1].messages)]
    assert called and len(with_tool) == len(called), [s["metadata"] for s in sums]
    for timeline in with_tool:
        messages = timeline[-1].messages
        call = next(m for m in messages if m.get("tool_calls"))["tool_calls"][0]["function"]
        answer, refused = _as_mcp_answers(call["name"], call["arguments"])
        result = next(m for m in messages if m.get("role") == "tool")["content"]
        assert refused or result == answer, call  # executed by verifiers' MCP server as the model named it
        assert timeline[-1].tools == TITLED_TOOLS  # the tool as verifiers lists it
    turns = {s["episode_id"]: s["metadata"]["turns"] for s in sums}
    assert max(turns.values()) >= 2
    assert any(s["reward"] == 1.0 for s in sums)


def task_data(task_id: str) -> dict:
    from ajet_hpc.environments.code.tasks import tasks

    index = int(task_id.rsplit("-", 1)[1])
    return next(itertools.islice(tasks(), index, None)).data


def sandbox_processes() -> list[str]:
    """Processes of the sandbox's own user ids still alive."""
    from ajet_hpc.environments.sandbox.runner import UID_BASE

    alive = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid_line = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
            uid = int(uid_line.split()[1])
        except (OSError, StopIteration):
            continue
        if uid >= UID_BASE:
            alive.append(status.parent.name)
    return alive


FRAMEWORKS = {  # group -> (runtime, framework_shapes name)
    "openai_agents": ("openai-agents", "openai-agents"),
    "langgraph": ("langgraph", "langgraph"),
    "pydantic_ai": ("pydantic-ai", "pydantic-ai"),
}
REFUSED = {  # (framework, case) -> the field the server's 400 names; every other case must succeed
    ("openai-agents", "tool_choice_required"): "tool_choice",
    ("openai-agents", "structured_output"): "text.format",
    ("langgraph", "tool_choice_any"): "tool_choice",
    ("langgraph", "parallel_tool_calls_false"): "parallel_tool_calls",
    ("langgraph", "structured_output"): "response_format",
    ("pydantic-ai", "parallel_tool_calls_false"): "parallel_tool_calls",
    ("pydantic-ai", "structured_output"): "tool_choice",  # its tool output mode asks for tool_choice=required
}


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory: pytest.TempPathFactory, scripted_qwen_model: Path) -> SharedRun:
    """configs/agent_frameworks.yaml (the OpenAI Agents SDK, LangGraph, Pydantic AI, each in its own
    runtime) plus configs/mcp_tools.yaml's group and configs/verifiers.yaml's two, for 3 steps on tiny-qwen
    taught to call the calculator's ``add`` (tests/scripted_model.py); the tasks of the MCP group and of
    verifiers' ``sums`` are the script's question."""
    folder = tmp_path_factory.mktemp("tools-run")
    script = folder / "script.jsonl"
    question = {"question": "What is 2+3? Use the tool.", "tools": ["add"], "answer": 5}
    script.write_text("".join(json.dumps({"id": f"sum-{k}", **question}) + "\n" for k in range(6)))
    topology = yaml.safe_load((REPO / "configs" / "agent_frameworks.yaml").read_text())
    topology["servers"][0]["engine"] |= {"model": str(scripted_qwen_model)}
    off_policy = {"max_staleness": 2, "recompute_logprobs": True, "off_policy": {"mode": "tis"}}
    topology["servers"][0]["models"][0]["trainer"] |= {
        "total_steps": 3,
        "tasks_per_batch": 4,
        "lr": 1e-6,
        **off_policy,
    }
    (mcp_group,) = yaml.safe_load((REPO / "configs" / "mcp_tools.yaml").read_text())["clients"]
    topology["clients"].append(mcp_group | {"tasks": str(script), "epochs": 4})
    reverse, sums = yaml.safe_load((REPO / "configs" / "verifiers.yaml").read_text())["clients"]
    taskset = "ajet_hpc.environments.verifiers.tools_example"
    sum_data = {"system_prompt": calculator.SYSTEM, "prompt": question["question"], "answer": 5}
    sum_script = folder / "verifiers-sums.jsonl"
    sum_script.write_text(
        "".join(
            json.dumps({"id": f"vsum-{k}", "taskset": taskset, "data": sum_data}) + "\n" for k in range(6)
        )
    )
    topology["clients"] += [reverse, sums | {"tasks": str(sum_script), "epochs": 4}]
    return launch_shared(folder, topology)


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_mcp_answers(tool: str, arguments: str) -> tuple[str, bool]:
    """What the agent and the calculator's MCP server answer to a call the model sampled at temperature 1:
    mostly ``add`` with the script's 2 and 3, sometimes another name (once ``""``), "2" or 2.5. Arguments
    that are no JSON object and a tool the server does not list come back as errors; MCP validates the
    arguments as pydantic does, in lax mode, so "2" is 2, and a value that is no int is the tool's error.
    Returns the result (checked for ``add`` only) and whether it is an error."""
    try:
        parsed = json.loads(arguments or "{}")
        a, b = (pydantic.TypeAdapter(int).validate_python(parsed[k]) for k in ("a", "b"))
    except (ValueError, TypeError, KeyError, pydantic.ValidationError):
        return "", True
    return (str(a + b), False) if tool == "add" else ("", True)


def test_tiny_qwen_trains_off_policy_with_its_weights_sent_in_memory(tools_run: SharedRun) -> None:
    """The shared run's trainer on tiny-qwen (Qwen2, tied embeddings, Qwen2.5's byte-level BPE), off-policy
    (stale episodes allowed, logprobs recomputed, truncated importance sampling): the weights reach vLLM in
    memory every step, and every episode that trained is in the store."""
    rows = metrics.read_rows(tools_run.dir / "metrics.jsonl")
    assert_off_policy_metrics(rows, "is_truncated_frac")
    for row in rows:
        assert row["policy_version"] == row["step"]
        assert row["weight_sync"] == "memory" and row["weight_sync_bytes"] > 0
        assert row["engine_pause_s"] is not None
    assert len(tools_run.summaries) >= sum(row["episodes"] for row in rows)


def test_tools_over_mcp_train_through_the_built_in_mcp_server(tools_run: SharedRun) -> None:
    """The agent offers the tool as the built-in MCP server lists it, the server parses the model's real
    <tool_call>, the client executes it over MCP (stdio, a server started beside the task) and feeds the
    result back; the reward checks the final answer against the task's; the MCP server ends with the run."""
    finished = tools_run.group("tools")
    called = [s for s in finished if s["metadata"]["tool_calls"]]
    assert finished and len(called) >= len(finished) // 2, [s["metadata"] for s in finished]
    with EpisodeReader(tools_run.dir / "data" / "policy.h5") as reader:
        for summary in called:
            first = summary["metadata"]["tool_calls"][0]  # executed as the model named it, by MCP
            answer, refused = _as_mcp_answers(first["tool"], first["arguments"])
            assert first.get("error", False) == refused and (refused or first["result"] == answer), first
            timelines = reader.episode(summary["episode_id"]).timelines
            sent = [m for t in timelines for m in t.messages if m.get("role") == "tool"]
            assert sent and sent[0]["content"] == first["result"]  # the tool's result went back to the model
            assert timelines[0].tools == [TOOLS[0]]  # the tool as MCP lists it, titles dropped
    for s in finished:
        assert s["reward"] == (5 in map(int, re.findall(r"-?\d+", s["metadata"]["answer"])))
    assert any(s["reward"] == 1.0 for s in called)
    first_calls = [s["metadata"]["tool_calls"][0] for s in called]
    assert any(c["tool"] == "add" and _json_or_none(c["arguments"]) == {"a": 2, "b": 3} for c in first_calls)
    assert not subprocess.run(
        ["pgrep", "-f", "ajet_hpc.environments.calculator.mcp_server"], capture_output=True
    ).stdout


def test_agent_frameworks_train_as_they_are(tools_run: SharedRun) -> None:
    """The OpenAI Agents SDK (Responses API), LangGraph over ChatOpenAI (chat completions) and Pydantic AI
    (Responses API): every episode of each is stored, with the reward of its final answer."""
    episodes = [s for s in tools_run.summaries if s["group"] in FRAMEWORKS]
    assert {s["group"] for s in episodes} == set(FRAMEWORKS)
    unfinished = [s for s in episodes if s["state"] != "finished" and "is finished" not in s["reason"]]
    assert not unfinished  # only the run's end may abort an episode
    for s in tools_run.finished:
        if s["group"] in FRAMEWORKS:
            assert s["reward"] == calculator.reward(s["metadata"]["answer"], task_of(s["task_id"]))


def test_every_request_the_frameworks_send_is_answered(tools_run: SharedRun, qwen_hf_harness) -> None:
    """In the run's runtimes, tests/framework_shapes.py drives each framework the ways users do and records
    every request it sends: each is answered 200, or 400 naming a field the request carries (the expected
    ones in REFUSED); never a 5xx. At least one tool result goes back to the model through them."""
    server = qwen_hf_harness.serve(max_tokens=64)
    round_trips = 0
    for runtime, framework in FRAMEWORKS.values():
        episode = server.begin(task_id="shapes", group=framework)
        target = {"base_url": episode["base_url"], "api_key": episode["api_key"], "model": "policy"}
        (python,) = (tools_run.dir / "envs").glob(f"{runtime}-*/bin/python")
        shapes = subprocess.run(
            [str(python), "tests/framework_shapes.py", framework, json.dumps(target)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=600,
        )
        assert shapes.returncode == 0, shapes.stderr[-3000:]
        for case in json.loads(shapes.stdout):
            refused = REFUSED.get((framework, case["case"]))
            exchanges = case["exchanges"]
            assert exchanges and all(ex["status"] < 500 for ex in exchanges), (framework, case)
            for ex in exchanges:
                if ex["status"] >= 400:  # the field it names is one the request sent
                    assert ex["error"]["param"].split(".")[0].split("[")[0] in ex["body"], (framework, ex)
            statuses = [(ex["status"], (ex["error"] or {}).get("param")) for ex in exchanges]
            if refused is None:
                assert case["failure"] is None and {s for s, _ in statuses} == {200}, (framework, case)
            else:
                assert statuses[-1] == (400, refused) and refused.split(".")[0] in case["failure"], case
            for ex in exchanges:
                items = ex["body"].get("messages") or ex["body"].get("input") or []
                fed_back = ("tool", "function_call_output")
                round_trips += any(
                    isinstance(item, dict) and (item.get("role") in fed_back or item.get("type") in fed_back)
                    for item in items
                )
    assert round_trips, "no framework fed a tool result back to the model"


def task_of(task_id: str) -> dict:
    from ajet_hpc.environments.calculator.tasks import tasks

    return next(itertools.islice(tasks(), int(task_id.rsplit("-", 1)[1]), None)).data


def test_textarena_two_adapters_play_each_other_and_the_frozen_base_and_both_train(tmp_path: Path) -> None:
    """configs/textarena.yaml for 3 steps per adapter in the runtime envs/textarena.txt: player_a and
    player_b (LoRA adapters of one frozen base) play TextArena's Iterated Prisoner's Dilemma against each
    other, and player_a plays the frozen base. Both adapters train; every game is stored for each model
    that moved in it with that model's own reward from TextArena, which replaying the moves in
    TextArena itself gives again; the base trains nothing."""
    run = tmp_path / "textarena"
    config = REPO / "configs" / "textarena.yaml"
    steps = [f"servers.base.adapters.{name}.trainer.total_steps=3" for name in ("player_a", "player_b")]
    done = run_module("ajet_hpc.launch", str(config), f"run.dir={run}", *steps, timeout_s=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = metrics.read_rows(run / "metrics.jsonl")
    assert sorted((row["model"], row["step"]) for row in rows) == [
        (model, step) for model in ("player_a", "player_b") for step in (1, 2, 3)
    ]
    games: dict[str, dict] = {}
    for model in ("player_a", "player_b", "base"):
        with EpisodeReader(run / "data" / f"{model}.h5") as reader:
            for s in reader.summaries():
                if s["state"] != "finished":  # a game that one model's training ended mid-way
                    assert "training of" in s["reason"] and "is finished" in s["reason"], s
                    continue
                meta = s["metadata"]
                assert s["reward"] == meta["game_rewards"][model]
                assert model in {move["model"] for move in meta["moves"]}  # stored where it moved
                games[f"{s['group']}/{s['task_id']}/{meta['repeat']}"] = {"task_id": s["task_id"], **meta}
    assert {g["seats"][1] for g in games.values()} == {"player_b", "base"}
    replay = [
        [g["task_id"], [m["action"] for m in g["moves"]], g["seats"]] for g in list(games.values())[:40]
    ]
    assert in_runtime(run, "textarena", REPLAY, replay) == [
        g["game_rewards"] for g in list(games.values())[:40]
    ]


REPLAY = """
import json, sys
import textarena as ta
from ajet_hpc.environments.textarena.tasks import GAME
out = []
for task_id, actions, seats in json.load(sys.stdin):
    env = ta.make(env_id=GAME["env_id"], **GAME["env_kwargs"])
    env.reset(num_players=2, seed=int(task_id.rsplit("-", 1)[1]))
    for action in actions:
        env.step(action=action)
    rewards, _ = env.close()
    out.append({seats[seat]: float(value) for seat, value in rewards.items()})
print(json.dumps(out))
"""
