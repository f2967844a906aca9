"""A client group (``clients[]``): a Slurm job array whose tasks run an agent's episodes against servers,
and its eval group (``eval``, ``config.evaluation``)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from ajet_hpc.config.evaluation import EvalConfig, eval_group_name
from ajet_hpc.config.fields import MODEL_CONFIG, EntryPoint, EnvFile, Name
from ajet_hpc.config.resources import JobResources, Slot


class ClientGroupConfig(JobResources):
    """One group of agents: a Slurm job array whose tasks run episodes against the named servers."""

    model_config = MODEL_CONFIG
    RESOURCES: ClassVar[dict[str, Slot]] = {
        "partition": Slot("servers", "cpu", "Slurm partition of the client array."),
        "time": Slot(
            "ratio", "4:00:00", "Time limit per array task: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."
        ),
        "cpus": Slot("time", 1, "CPUs per array task (--cpus-per-task)."),
        "mem": Slot(
            "cpus", "2G", "Memory per array task: an integer with optional K/M/G/T suffix (MB without one)."
        ),
    }

    name: Name = Field(description="Client group name; names the group's files in the run.")
    agent: EntryPoint = Field(description="The agent to run, as 'module.path:function'.")
    tasks: str = Field(
        description="Task source: 'builtin:<name>', a path ending in '.jsonl', or 'module.path:callable'."
    )
    servers: list[Name] = Field(min_length=1, description="Names of the servers this group's agents use.")
    array: int = Field(default=1, ge=1, description="Number of array tasks.")
    in_flight: int = Field(default=1, ge=1, description="Episodes in flight per array task.")
    max_tasks: int | None = Field(
        default=None,
        ge=1,
        description="Use only the first max_tasks tasks of the source (split over the array); None: all.",
    )
    repeats: int | None = Field(
        default=None,
        ge=1,
        description="Episodes per task; None: the first server's trainer.repeats (1 when it only serves).",
    )
    env: EnvFile | None = Field(
        default=None, description="Environment spec file under envs/ the agent runs in, e.g. agent-basic.txt."
    )
    ratio: float | None = Field(
        default=None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Share of each training batch's tasks that come from this group (mixed-task training). "
        "Set it on every group of a trainable server or on none; the shares of a server sum to 1.",
    )
    epochs: int = Field(
        default=1,
        ge=1,
        description="Passes over the task source; in pass e > 0 a task's id becomes '<id>@<e>', so every "
        "(group, task id, repeat) stays unique over the run.",
    )
    server_wait_s: float | None = Field(
        default=3600.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest an array task waits for an absent server (no fresh rendezvous, no answer) "
        "before it stops with an error and releases its allocation; None waits for ever (a requeued server "
        "may sit in the queue for hours).",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Restarts of an array task's runner that died without finishing (killed, crashed, out "
        "of memory), in its allocation; each resumes from the task's store. Then the array task fails.",
    )
    max_resubmits: int = Field(
        default=2,
        ge=0,
        description="Times an array task that died whole (a node failure, the OOM killer, kill -9 of all "
        "its processes: Slurm says NODE_FAIL, OUT_OF_MEMORY, BOOT_FAIL or FAILED by a signal) is submitted "
        "again, by the keeper of the group's first server (Slurm only); it resumes from its store. 0: never.",
    )
    eval: EvalConfig | None = Field(
        default=None,
        description="Held-out evaluation during training: an eval group '<name>-eval' runs this group's "
        "agent on eval.tasks every eval.every_steps steps (docs/evaluation.md).",
    )

    def eval_group(self) -> ClientGroupConfig:
        """The client group that runs this group's evaluation (``eval``): its agent, runtime and resources,
        the held-out tasks once each (``samples_per_task`` repeats), its own array."""
        ev = self.eval
        if ev is None:
            raise ValueError(f"client group {self.name} has no eval block")
        return self.model_copy(
            update={
                "name": eval_group_name(self.name),
                "tasks": ev.tasks,
                "array": ev.array,
                "in_flight": ev.in_flight,
                "max_tasks": ev.max_tasks,
                "repeats": ev.samples_per_task,
                "epochs": 1,
                "ratio": None,
                "eval": None,
            }
        )
