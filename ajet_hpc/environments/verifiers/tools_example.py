"""A multi-turn environment with a tool, written for ``verifiers`` (v1 API): the sums of ``builtin:tools``
answered with the calculator's ``add``, which verifiers serves over MCP itself (this module is also that
server's program). verifiers' chat program offers the tool, executes the model's calls through MCP, feeds
the results back and asks again until the model answers; the task's own ``@vf.reward`` scores the answer.
Used by ``configs/verifiers.yaml`` through the adapter ``ajet_hpc.environments.verifiers.adapter``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import verifiers.v1 as vf

from ajet_hpc.environments.calculator import tools as calculator
from ajet_hpc.environments.calculator.tasks import tasks as tool_questions
from ajet_hpc.environments.verifiers import adapter as verifiers_env


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is "add", as the built-in MCP server names it

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return calculator.add(a, b)


class SumData(vf.TaskData):
    answer: int


class SumTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset[Any]]:
        return [Calculator(config.tools)]

    @vf.reward(weight=1.0)
    async def right_number(self, trace: vf.Trace) -> float:
        return calculator.reward(trace.last_reply, {"answer": self.data.answer})


class SumConfig(vf.TasksetConfig):
    task: SumTaskConfig = SumTaskConfig()


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> Iterator[SumTask]:
        for question in tool_questions():
            if question.data["tools"] == ["add"]:
                data = SumData(
                    id=question.id,
                    system_prompt=calculator.SYSTEM,
                    prompt=question.data["question"],
                    answer=question.data["answer"],
                )
                yield SumTask(data, self.config.task)


def tasks() -> Iterator[dict[str, Any]]:
    """Task source ``ajet_hpc.environments.verifiers.tools_example:tasks``: this taskset's tasks for the
    adapter."""
    return verifiers_env.tasks(__name__)


__all__ = ["SumTaskset"]

if __name__ == "__main__":  # verifiers starts the toolset's MCP server as this module's program
    Calculator.run()
