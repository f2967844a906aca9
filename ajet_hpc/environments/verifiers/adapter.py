"""Any environment written for ``verifiers`` (v1 API, runtime ``envs/verifiers.txt``) as a trainable agent.

The environment drives the episode and scores it; only the model endpoint is ours. Per episode:

1. the environment is loaded by its verifiers taskset id (an installed package, or a module path such
   as ``ajet_hpc.environments.verifiers.example``) with ``vf.resolve_env_config`` + ``vf.load_environment``:
   a plain taskset gets ``SingleAgentEnv``, a package that exports its own ``Env`` (multi-agent, judges)
   gets that;
2. the task is rebuilt from the task's data (``tasks()`` below lists an environment's tasks in that form);
3. ``Env.run_episode`` runs inside ``Env.serving()`` with a ``vf.ModelContext`` whose ``EvalClientConfig``
   points at the episode's ``base_url``: verifiers' interception server stands between the harness and
   our server, relays every model call there unchanged (so each is recorded and trained), and builds the
   trace; the task's ``@vf.reward`` methods (and judges) score it;
4. the reward is the trainable traces' ``Trace.reward`` (the weighted sum of the named rewards).

Harness: an agent seat that names no harness gets ``LocalChatHarness``, verifiers' own ``null`` chat program
(multi-turn, MCP tools of the task's toolsets) run by this runtime's python. The stock ``null`` and ``bash``
harnesses run that program through ``uv sync --script`` (``Runtime.prepare_uv_script``), which downloads
its packages at run time; this runtime already has them (they are verifiers' own dependencies).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.harnesses.null.harness import NullHarness

from ajet_hpc.environments.episode import EpisodeContext, ModelHandle, Outcome

TASKSET_VARIABLE = "AJET_VERIFIERS_TASKSET"
"""Environment variable naming the verifiers taskset ``tasks()`` lists (default: ``EXAMPLE``)."""
EXAMPLE = "ajet_hpc.environments.verifiers.example"
MAX_TOKENS = 32
"""Sampling cap of every model call (verifiers applies it to the harness's requests)."""
KEY_PREFIX = "AJET_VERIFIERS_API_KEY_"
"""verifiers reads the endpoint's key from an environment variable (``api_key_var``): each episode gets
its own variable, so concurrent episodes never share one. "API_KEY" keeps it out of harness processes."""


class EpisodeFailed(RuntimeError):
    """verifiers ended the episode with errors (they are in the message): the episode has no reward."""


def plugin_id(name: str) -> str:
    """The verifiers plugin id for a taskset or harness named ``name``. verifiers imports plugins by top-level
    module name (``utils.loaders._import_plugin``): a dotted module path is imported here and registered in
    ``sys.modules`` under a top-level alias, which is the id handed to verifiers."""
    if "." not in name or "/" in name:
        return name
    alias = "ajet_vf__" + name.replace(".", "__")
    sys.modules.setdefault(alias, importlib.import_module(name))
    return alias


class _LocalPython:
    """A runtime whose ``prepare_uv_script`` runs a PEP 723 script with this python instead of syncing a uv
    environment for it; everything else is the wrapped runtime's."""

    def __init__(self, runtime: vf.Runtime) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(
        self, script: str | bytes, env: Any = None, *, activate: bool = True
    ) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = f"vf-program-{hashlib.sha256(data).hexdigest()[:16]}.py"  # in the rollout's workspace
        await self._runtime.write(path, data)
        return [sys.executable, path]


class LocalChatHarness(NullHarness):
    """verifiers' ``null`` harness (its chat program, prompts and MCP wiring) run by this runtime's python."""

    async def setup(self, runtime: vf.Runtime) -> None:
        return None

    async def launch(
        self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, *args: Any, **kwargs: Any
    ) -> vf.ProgramResult:
        return await super().launch(ctx, trace, _LocalPython(runtime), *args, **kwargs)


def load_env(taskset: str) -> vf.Env:
    """The verifiers environment of ``taskset``: every agent seat without a harness on ``LocalChatHarness``,
    every seat on verifiers' default runtime (a Prime cloud sandbox) in a local subprocess instead."""
    raw: dict[str, Any] = {"taskset": {"id": plugin_id(taskset)}}
    harness = {"id": plugin_id(__name__)}
    for name, seat in agent_config_fields(vf.resolve_env_config(raw)).items():
        pinned: dict[str, Any] = {} if seat.harness is not None else {"harness": harness}
        if isinstance(seat.runtime, vf.PrimeConfig):  # the default: a remote sandbox on Prime's cloud
            pinned["runtime"] = {"type": "subprocess"}
        raw[name] = pinned
    return vf.load_environment(vf.resolve_env_config(raw))


def task_of(env: vf.Env, data: dict[str, Any]) -> vf.Task:
    """The environment's task whose wire data is ``data`` (as ``tasks()`` gives it)."""
    task_type = type(env.taskset).task_type()
    return task_type(task_type.data_type().model_validate(data), env.taskset.config.task)


def tasks(taskset: str | None = None) -> Iterator[dict[str, Any]]:
    """Task source ``ajet_hpc.environments.verifiers.adapter:tasks``: every task of ``taskset``, by default
    the one named by ``$AJET_VERIFIERS_TASKSET`` (else the example), as ``{"id", "taskset", "data"}``."""
    taskset = taskset or os.environ.get(TASKSET_VARIABLE, EXAMPLE)
    loaded = vf.load_taskset(vf.resolve_env_config({"taskset": {"id": plugin_id(taskset)}}).taskset)
    for task in loaded:
        data = task.data.model_dump(mode="json", exclude_none=True)
        yield {"id": str(data.get("id") or task.key), "taskset": taskset, "data": data}


async def run_episode(taskset: str, data: dict[str, Any], model: ModelHandle) -> vf.Episode:
    """One verifiers episode of the task ``data`` of ``taskset`` against ``model``."""
    env = load_env(taskset)
    key_variable = KEY_PREFIX + uuid.uuid4().hex
    os.environ[key_variable] = model.api_key
    try:
        client = vf.EvalClientConfig(base_url=model.base_url, api_key_var=key_variable)
        ctx = vf.ModelContext(model=model.name, client=client, sampling=vf.Sampling(max_tokens=MAX_TOKENS))
        async with env.serving():
            return await env.run_episode(task_of(env, data), ctx)
    finally:
        os.environ.pop(key_variable, None)


def reward_of(episode: vf.Episode) -> float:
    """The mean reward of the episode's trainable traces (one for a single-agent environment)."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not episode.ok or errors:
        raise EpisodeFailed("; ".join(f"{e.type}: {e.message}" for e in errors) or "episode not ok")
    traces = [t for t in episode.traces if t.agent.trainable] or episode.traces
    return sum(t.reward for t in traces) / len(traces)


def solve(ctx: EpisodeContext) -> Outcome:
    data = ctx.task.data
    taskset = str(data.get("taskset") or os.environ.get(TASKSET_VARIABLE, EXAMPLE))
    wire = data.get("data", data)
    episode = asyncio.run(run_episode(taskset, wire, ctx.model))
    reward = reward_of(episode)
    rewards = {name: r.score for t in episode.traces for name, r in t.rewards.items() if r is not None}
    answer = episode.traces[-1].last_reply if episode.traces else ""
    return Outcome(
        reward=reward,
        metadata={
            "taskset": taskset,
            "task": wire,
            "answer": answer,
            "rewards": rewards,
            "turns": episode.num_turns,
        },
        transcript=episode.to_record(),
    )


__all__ = ["LocalChatHarness"]
