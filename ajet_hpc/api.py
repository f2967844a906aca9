"""The public API: what an agent, a task source, a reward or a tool written outside this project imports.

An agent is a plain function ``solve(ctx: EpisodeContext) -> float | Outcome`` that a client group names as
``agent: module.path:solve``; a task source is ``tasks: module.path:callable`` (an iterable of ``Task`` or
of dicts) or one of the forms in ``open_source``. Every name here is re-exported from the module of
``ajet_hpc/environments/`` that defines it, so ``ajet_hpc.api.Outcome is
ajet_hpc.environments.episode.Outcome``. Names here stay put when modules move; a module path that moved
keeps importing for a while with a ``FutureWarning`` naming its new path (``ajet_hpc/moved.py``).

- The episode: ``EpisodeContext`` (``ctx.task``, ``ctx.model`` / ``ctx.models``, ``ctx.repeat``),
  ``ModelHandle`` (an OpenAI endpoint scoped to the episode: ``ctx.model.client()``), ``Task``, and
  ``Outcome`` (reward, per-turn or per-model rewards, metadata, transcript).
- Task sources: ``open_source(spec)`` reads any ``tasks:`` spec, ``TaskSourceError`` says why one cannot be
  read; ``reasoning_gym_score(task.data, answer)`` is a reasoning-gym dataset's own verifier.
- Rewards: ``math_reward(answer, gold)`` (math-verify, runtime ``envs/math.txt``).
- The sandbox for model-written code: ``run_python(code, limits)`` with ``Limits``, its ``Result``,
  ``SandboxUnavailable`` and ``isolation_in_use()``.
- Tools over MCP: ``McpToolbox`` (one MCP server's tools), ``run_tool_loop`` (call, run the tools, call
  again until the model answers), ``openai_tool``, ``McpToolError`` (runtime ``envs/mcp.txt``).

docs/environments.md ("The public API") shows them in use.
"""

from ajet_hpc.environments.episode import EpisodeContext, ModelHandle, Outcome, Task
from ajet_hpc.environments.mcp_tools import McpToolbox, McpToolError, ToolLoop, openai_tool, run_tool_loop
from ajet_hpc.environments.reasoning_gym.source import score as reasoning_gym_score
from ajet_hpc.environments.rewards.math_answer import math_reward
from ajet_hpc.environments.sandbox import Limits, Result, SandboxUnavailable, isolation_in_use, run_python
from ajet_hpc.environments.sources import TaskSourceError, open_source

__all__ = [
    "EpisodeContext",
    "Limits",
    "McpToolError",
    "McpToolbox",
    "ModelHandle",
    "Outcome",
    "Result",
    "SandboxUnavailable",
    "Task",
    "TaskSourceError",
    "ToolLoop",
    "isolation_in_use",
    "math_reward",
    "open_source",
    "openai_tool",
    "reasoning_gym_score",
    "run_python",
    "run_tool_loop",
]
