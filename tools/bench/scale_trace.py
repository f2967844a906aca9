"""What one client task asks of the file system and of Slurm, counted with strace, for ``scale.py``.

``traced(command, out)`` wraps a command in ``strace -f`` (every thread and child, ``--seccomp-bpf`` so
that the untraced system calls cost nothing) recording, with wall-clock timestamps, the system calls that
take a path, the fsyncs (with the path behind the descriptor, ``-y``) and every ``execve``. ``count``
reads the record back for a time window:

- ``metaops``: path calls (open, stat, rename, unlink, mkdir, access, readlink, ...) on paths under a
  folder (the run directory, i.e. shared storage); a stat of an open descriptor (an empty path) is not
  one: it does not look up a name;
- ``fsyncs``: fsync, fdatasync and sync_file_range on files under that folder;
- ``slurm``: commands started whose program is a Slurm client (``squeue``, ``sbatch``, ``scontrol``...);
  ``execs``: every command started but the traced command itself.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

METADATA_CALLS = frozenset(
    [
        "open",
        "openat",
        "openat2",
        "creat",
        "stat",
        "lstat",
        "stat64",
        "lstat64",
        "newfstatat",
        "fstatat64",
        "statx",
        "access",
        "faccessat",
        "faccessat2",
        "readlink",
        "readlinkat",
        "rename",
        "renameat",
        "renameat2",
        "unlink",
        "unlinkat",
        "mkdir",
        "mkdirat",
        "rmdir",
        "link",
        "linkat",
        "symlink",
        "symlinkat",
        "chmod",
        "fchmodat",
        "chown",
        "lchown",
        "fchownat",
        "utime",
        "utimes",
        "utimensat",
        "futimesat",
        "truncate",
        "getxattr",
        "lgetxattr",
        "listxattr",
        "llistxattr",
        "setxattr",
        "lsetxattr",
        "removexattr",
        "lremovexattr",
        "statfs",
        "chdir",
        "mknod",
        "mknodat",
        "inotify_add_watch",
    ]
)
FSYNC_CALLS = frozenset({"fsync", "fdatasync", "sync_file_range"})
SLURM_COMMANDS = frozenset(
    [
        "squeue",
        "sbatch",
        "scontrol",
        "sacct",
        "scancel",
        "srun",
        "salloc",
        "sinfo",
        "sstat",
        "sprio",
        "sshare",
        "sacctmgr",
        "strigger",
    ]
)
_LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<t>\d+\.\d+)\s+(?P<call>\w+)\((?P<args>.*)$")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"^\d+<([^>]*)>")


def available() -> bool:
    return shutil.which("strace") is not None


def traced(command: list[str], out: Path) -> list[str]:
    calls = ",".join(["%file", *sorted(FSYNC_CALLS)])
    return [
        "strace",
        "-f",
        "-qq",
        "--seccomp-bpf",
        "-ttt",
        "-y",
        "-e",
        f"trace={calls}",
        "-o",
        str(out),
        *command,
    ]


@dataclass
class Counts:
    metaops: int = 0
    fsyncs: int = 0
    slurm: int = 0
    execs: int = 0


def count(trace: Path, under: Path, start: float = 0.0, end: float = float("inf")) -> Counts:
    """The calls recorded in ``trace`` between ``start`` and ``end`` (time.time()), as the module says."""
    root = str(under.resolve())
    inside = (root, root + "/")
    counts = Counts()
    first_exec = True
    for line in trace.read_text(errors="replace").splitlines():
        match = _LINE.match(line)
        if match is None or "resumed>" in line:  # a call's second half: counted at its first
            continue
        call, args = match["call"], match["args"]
        if call == "execve" and first_exec:  # the traced command itself
            first_exec = False
            continue
        if not start <= float(match["t"]) < end:
            continue
        if call == "execve":
            program = _STRING.search(args)
            counts.execs += 1
            if program is not None and Path(program[1]).name in SLURM_COMMANDS:
                counts.slurm += 1
        elif call in FSYNC_CALLS:
            fd = _FD_PATH.match(args)
            if fd is not None and fd[1].startswith(inside):
                counts.fsyncs += 1
        elif call in METADATA_CALLS:
            path = _STRING.search(args)
            if path is not None and path[1] and (path[1] == root or path[1].startswith(inside[1])):
                counts.metaops += 1
    return counts
