"""The run and the cluster: a run's identity and run directory, and how its jobs are submitted."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from ajet_hpc.config.fields import MODEL_CONFIG, Name, SbatchOptions

# an account or qos name goes into an #SBATCH line: one word, no whitespace, quotes or shell characters
_SLURM_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.+@-]*$"


TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]


def _jsonl_only() -> list[TrackerName]:
    return ["jsonl"]


class RunConfig(BaseModel):
    """Identity of the run and where its run directory lives."""

    model_config = MODEL_CONFIG

    name: Name = Field(description="Run name; used in job names and as the default run directory name.")
    dir: str | None = Field(
        default=None,
        min_length=1,
        description="Run directory on shared storage; default runs/<name> relative to the working directory.",
    )
    trackers: list[TrackerName] = Field(
        default_factory=_jsonl_only,
        description="Where each server also logs its metrics rows: 'jsonl' (RUN/metrics.jsonl, always), "
        "'tensorboard' (RUN/tensorboard), 'wandb' (offline by default: RUN/wandb), 'mlflow' (file store "
        "RUN/mlruns). The libraries are extras: pip install 'ajet_hpc[wandb]'.",
    )

    @field_validator("trackers")
    @classmethod
    def _jsonl_always(cls, value: list[str]) -> list[str]:
        return ["jsonl", *(name for name in dict.fromkeys(value) if name != "jsonl")]

    def resolve_dir(self, cwd: Path | None = None) -> Path:
        """The absolute run directory; a relative one is taken from ``cwd`` (default: working directory)."""
        base = Path.cwd() if cwd is None else cwd
        path = Path(self.dir).expanduser() if self.dir is not None else Path("runs") / self.name
        return (base / path).absolute()


class ClusterConfig(BaseModel):
    """How jobs are submitted: backend, accounting, and options shared by every job."""

    model_config = MODEL_CONFIG

    backend: Literal["auto", "slurm", "local"] = Field(
        default="auto",
        description="Where jobs run: 'slurm', 'local' processes, or 'auto' (Slurm when sbatch is available).",
    )
    account: str | None = Field(
        default=None,
        min_length=1,
        pattern=_SLURM_NAME,
        description="Slurm account (--account) for every job: letters, digits and _ . + - @ only.",
    )
    qos: str | None = Field(
        default=None,
        min_length=1,
        pattern=_SLURM_NAME,
        description="Slurm quality of service (--qos) for every job: letters, digits and _ . + - @ only.",
    )
    setup: list[str] = Field(
        default_factory=list, description="Shell lines run before each job starts, e.g. 'module load cuda'."
    )
    sbatch: SbatchOptions = Field(
        default_factory=dict,
        description="Extra sbatch options for every job, keys without dashes, e.g. {constraint: a100}.",
    )
    hetjob: bool = Field(
        default=False,
        description=(
            "Submit each server together with the client groups that use only that server "
            "as one heterogeneous Slurm job."
        ),
    )
    signal_delay_s: int = Field(
        default=120,
        ge=10,
        description="Seconds before the time limit at which Slurm sends the checkpoint signal.",
    )
    kill_wait_s: int = Field(
        default=30,
        ge=3,
        description="Seconds from Slurm's SIGTERM to its SIGKILL: the cluster's KillWait (scontrol show "
        "config), plus the partition's GraceTime where preemption sends SIGTERM. A server saves on SIGTERM "
        "within two thirds of it and stops in the rest.",
    )
    env_cache: str | None = Field(
        default=None,
        min_length=1,
        description="Folder on shared storage where client runtimes (a group's env file built into a venv "
        "or conda environment) are built once and reused by every run; default RUN/envs. A relative path is "
        "taken from the launch directory.",
    )
    share_group: str | None = Field(
        default=None,
        min_length=1,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
        description="Unix group that may read the run directory (created 0750 and owned by this group); "
        "default: the run directory is 0700, private to its owner.",
    )
