"""What a sandboxed run may use, and what came of it."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """The limits of one run of model-written code.

    ``memory_mb`` bounds each process's address space (an allocation past it raises ``MemoryError``),
    ``cpu_s`` its CPU time (SIGXCPU), ``wall_s`` the whole run (every process killed), ``file_mb`` any file
    it writes, its output included (SIGXFSZ), ``processes`` how many processes it may have at once (a fork
    past it fails with EAGAIN), ``scratch_mb`` its private writable dir and ``/tmp`` together.
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    file_mb: int = 8
    processes: int = 16
    scratch_mb: int = 64
    output_chars: int = 4096  # kept in the result: the first of stdout, the last of stderr

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "file_mb", "processes", "scratch_mb", "output_chars"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"sandbox limit {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class Result:
    """One run's end. ``reason`` is None when the code exited 0, else what stopped it: ``wall_time``,
    ``cpu_time``, ``memory``, ``file_size``, ``processes``, ``signal <name>`` or ``exit <code>``, each
    followed by the last line of its stderr where there is one (e.g. ``exit 1: FileNotFoundError: ...``)."""

    reason: str | None
    stdout: str
    stderr: str
    returncode: int
    wall_s: float
    isolation: str  # "bwrap", or "rlimits" (no namespaces: a loud warning was logged)

    @property
    def ok(self) -> bool:
        return self.reason is None
