"""Field types shared by the topology models: names, Slurm times and memory, entry points, model sources.

Each type is an ``Annotated`` alias whose validator says what form is expected, so every model that uses it
reports the same, fixable error. The parsing functions are public for the launcher.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ConfigDict

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny", "tiny-qwen")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_IDENT = r"[^\W\d]\w*"
_ENTRY_POINT = re.compile(rf"^{_IDENT}(?:\.{_IDENT})*:{_IDENT}$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
_MEMORY = re.compile(r"^([0-9]+)([KMGT]?)$")
_TIME_DAYS = re.compile(r"^([0-9]+)-([0-9]+)(?::([0-9]+))?(?::([0-9]+))?$")
_TIME_PLAIN = re.compile(r"^([0-9]+)(?::([0-9]+))?(?::([0-9]+))?$")
_MEMORY_MB = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}

# sbatch options the topology already sets, and where to set them instead.
RESERVED_SBATCH = {
    "account": "cluster.account",
    "qos": "cluster.qos",
    "partition": "servers[].partition / clients[].partition",
    "time": "servers[].time / clients[].time",
    "mem": "servers[].mem / clients[].mem",
    "cpus-per-task": "servers[].cpus / clients[].cpus",
    "nodes": "servers[].nodes",
    "gpus-per-node": "servers[].gpus_per_node",
    "array": "clients[].array",
    "signal": "cluster.signal_delay_s",
    "job-name": "the run and server/client names (set by the launcher)",
    "output": "the run directory's logs/ (set by the launcher)",
    "error": "the run directory's logs/ (set by the launcher)",
}


def slurm_time_minutes(text: str) -> int:
    """Minutes in a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``).

    Seconds round up to the next minute. Raises ``ValueError`` with the accepted forms on anything else, and
    on a zero limit (which Slurm reads as "no limit").
    """
    days = hours = minutes = seconds = 0
    if match := _TIME_DAYS.fullmatch(text):
        days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        minutes_bounded = True
        if hours >= 24:
            raise ValueError(f"hours must be below 24 after the day count in time {text!r}")
    elif match := _TIME_PLAIN.fullmatch(text):
        parts = [int(g) for g in match.groups() if g is not None]
        minutes_bounded = len(parts) == 3
        if len(parts) == 3:
            hours, minutes, seconds = parts
        else:
            minutes, seconds = [*parts, 0][:2]
    else:
        raise ValueError(
            f"invalid Slurm time {text!r}; use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
            "(e.g. '4:00:00')"
        )
    if seconds >= 60 or (minutes_bounded and minutes >= 60):
        raise ValueError(f"minutes and seconds must be below 60 in time {text!r}")
    total_s = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total_s == 0:
        raise ValueError(f"time {text!r} is zero; give a positive limit")
    return math.ceil(total_s / 60)


def slurm_memory_mb(text: str) -> int:
    """Megabytes in a Slurm memory size: a positive integer with an optional K/M/G/T suffix (none means MB).

    Slurm's ``0`` ("all the node's memory") is refused: per-CPU and per-job splits of it are meaningless.
    """
    match = _MEMORY.fullmatch(text)
    if not match or int(match.group(1)) == 0:
        raise ValueError(
            f"invalid Slurm memory {text!r}; use a positive integer with an optional K, M, G or T suffix"
        )
    return math.ceil(int(match.group(1)) * _MEMORY_MB[match.group(2)])


def _int_as_text(value: Any) -> Any:
    """Let YAML integers stand for Slurm values (``time: 90`` minutes, ``mem: 4096`` MB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _reject_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, not a boolean ({value!r})")
    return value


def _check_time(text: str) -> str:
    slurm_time_minutes(text)
    return text


def _check_memory(text: str) -> str:
    slurm_memory_mb(text)
    return text


def check_name(text: str) -> str:
    if not _NAME.fullmatch(text):
        raise ValueError(
            f"invalid name {text!r}; start with a letter or digit, then use only letters, digits, "
            "'_', '.' and '-'"
        )
    return text


def _check_partition(text: str) -> str:
    if not all(_NAME.fullmatch(part) for part in text.split(",")):
        raise ValueError(f"invalid partition {text!r}; give a partition name (or several, comma-separated)")
    return text


def check_entry_point(text: str) -> str:
    if not _ENTRY_POINT.fullmatch(text):
        raise ValueError(f"invalid entry point {text!r}; use 'module.path:function'")
    return text


def _check_model_source(text: str) -> str:
    if text.startswith(BUILTIN_PREFIX):
        if text.removeprefix(BUILTIN_PREFIX) not in BUILTIN_MODELS:
            builtins = ", ".join(BUILTIN_PREFIX + name for name in BUILTIN_MODELS)
            raise ValueError(f"unknown builtin model {text!r}; builtins are: {builtins}")
    elif not text.strip():
        raise ValueError("model must be 'builtin:tiny' or a local path, not blank")
    return text


def _check_env_file(text: str) -> str:
    if not _NAME.fullmatch(text):
        raise ValueError(
            f"invalid env {text!r}; give a file name under envs/ (no directories), e.g. agent-basic.txt"
        )
    return text


def _check_sbatch_value(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"sbatch option values must be strings or integers, not {type(value).__name__}")
    if isinstance(value, str) and ("\n" in value or "\r" in value):
        raise ValueError("sbatch option values must be a single line")
    return value


def _check_sbatch_key(key: str) -> str:
    if not _SBATCH_KEY.fullmatch(key):
        raise ValueError(
            f"invalid sbatch option {key!r}; use the long option name without dashes, e.g. 'constraint'"
        )
    if key in RESERVED_SBATCH:
        raise ValueError(f"sbatch option {key!r} is set by the topology; use {RESERVED_SBATCH[key]} instead")
    return key


Name = Annotated[str, AfterValidator(check_name)]
Partition = Annotated[str, AfterValidator(_check_partition)]
SlurmTime = Annotated[str, BeforeValidator(_int_as_text), AfterValidator(_check_time)]
SlurmMemory = Annotated[str, BeforeValidator(_int_as_text), AfterValidator(_check_memory)]
EntryPoint = Annotated[str, AfterValidator(check_entry_point)]
ModelSource = Annotated[str, AfterValidator(_check_model_source)]
EnvFile = Annotated[str, AfterValidator(_check_env_file)]
SbatchValue = Annotated[str | int, BeforeValidator(_check_sbatch_value)]
SbatchKey = Annotated[str, AfterValidator(_check_sbatch_key)]
SbatchOptions = dict[SbatchKey, SbatchValue]
NotBool = BeforeValidator(_reject_bool)

MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)
"""Every config model's: frozen, unknown keys refused, strict (an int is not ``"3"`` nor ``true``)."""
