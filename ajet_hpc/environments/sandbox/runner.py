"""Run model-written Python under limits, isolated by bubblewrap.

One run is one ``prlimit ... -- bwrap ... python -I -S -B /code/main.py``:

- ``prlimit`` (util-linux) sets the rlimits before anything runs: address space, CPU time, file size,
  processes, no core files. The process limit counts every process of the user, so it is the user's
  current count plus ``Limits.processes``; a client run as root runs each sandbox as a user id of its own
  (root ignores the limit), which also keeps concurrent sandboxes out of each other's count.
- ``bwrap`` gives the code new user, PID, network, IPC, UTS and cgroup namespaces (no network at all, only
  its own processes), no capabilities, a cleared environment and a file system of the interpreter and the
  system libraries read-only, its code read-only at ``/code``, and one size-limited tmpfs as its private
  dir ``/box`` (``/tmp`` points into it). Nothing of the run directory, the home directory or ``/etc``
  is there to read. When the run ends or its wall time is over, bwrap's PID namespace takes every process
  the code started with it.

Where bubblewrap is missing or cannot make namespaces (some clusters forbid unprivileged user namespaces),
the run falls back to the rlimits alone, as another user id when running as root, with a loud warning once
per process: then the code can read what that user can read and reach the network. ``AJET_SANDBOX=bwrap``
refuses the fallback (``SandboxUnavailable``), ``AJET_SANDBOX=rlimits`` asks for it. In the fallback as
root, the sandbox's user id must reach the interpreter: point ``AJET_SANDBOX_PYTHON`` at one outside a
private home (e.g. ``/usr/bin/python3``) when the client's is in root's home.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ajet_hpc.environments.sandbox.limits import MIB, Limits, Result

log = logging.getLogger(__name__)

ENV_VAR = "AJET_SANDBOX"
REASON_CHARS = 2048  # of stderr's end, read for the last line that goes into the reason
PYTHON_VAR = "AJET_SANDBOX_PYTHON"  # the interpreter model code runs with (default: the client's base one)
UID_BASE = 0x7A_0000  # sandbox user ids when running as root: far above any site's real users
_uid_counter = itertools.count()
_probe_lock = threading.Lock()
_isolation: str | None = None
_SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/sbin")


class SandboxUnavailable(RuntimeError):
    """``AJET_SANDBOX=bwrap`` and bubblewrap cannot run here; the message says why."""


def run_python(code: str, limits: Limits | None = None, stdin: str = "") -> Result:
    """Run ``code`` as a Python script under ``limits`` and return how it ended (never raises for
    anything the code does)."""
    limits = limits or Limits()
    isolation = isolation_in_use()
    with tempfile.TemporaryDirectory(prefix="ajet-sandbox-") as tmp:
        return _run(code, limits, stdin, Path(tmp), isolation)


def isolation_in_use() -> str:
    """``bwrap`` or ``rlimits``: decided once per process by running bubblewrap on an empty script."""
    global _isolation
    with _probe_lock:
        if _isolation is None:
            _isolation = _choose_isolation()
        return _isolation


def _choose_isolation() -> str:
    wanted = os.environ.get(ENV_VAR, "")
    if wanted not in ("", "bwrap", "rlimits"):
        raise SandboxUnavailable(f"{ENV_VAR}={wanted!r}: expected bwrap or rlimits")
    if wanted == "rlimits":
        return _fallback("it was asked for with AJET_SANDBOX=rlimits")
    if shutil.which("prlimit") is None:
        raise SandboxUnavailable("prlimit (util-linux) is not on PATH; the sandbox sets its limits with it")
    why = "bwrap is not on PATH (Debian: apt install bubblewrap)"
    if shutil.which("bwrap"):
        with tempfile.TemporaryDirectory(prefix="ajet-sandbox-") as tmp:
            probe = _run("pass", Limits(wall_s=30), "", Path(tmp), "bwrap")
        if probe.ok:
            return "bwrap"
        why = f"bwrap cannot run here: {probe.stderr.strip()[-300:] or probe.reason}"
    if wanted == "bwrap":
        raise SandboxUnavailable(why)
    return _fallback(why)


def _fallback(why: str) -> str:
    log.warning(
        "SANDBOX WITHOUT ISOLATION: %s. Model-written code now runs with rlimits only%s: it can read "
        "what that user can read and reach the network. Install bubblewrap to isolate it.",
        why,
        " as a separate user id" if os.geteuid() == 0 else ", as this user",
    )
    return "rlimits"


def _run(code: str, limits: Limits, stdin: str, tmp: Path, isolation: str) -> Result:
    (tmp / "code").mkdir()
    (tmp / "code" / "main.py").write_text(code, encoding="utf-8", errors="surrogateescape")
    (tmp / "stdin").write_text(stdin, encoding="utf-8", errors="surrogateescape")
    tmp.chmod(0o755)
    uid = _sandbox_uid()
    work = tmp / "work"
    python = [_interpreter(), "-I", "-S", "-B"]
    as_user = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    as_user += [] if uid is None else ["--inh-caps=-all", "--bounding-set=-all", "--"]
    if isolation == "bwrap":
        command = _limits_command(limits, uid) + _bwrap_command(limits, tmp, uid) + as_user + python
        command.append("/code/main.py")
        cwd = tmp
    else:  # no tmpfs of its own: a directory of the host, owned by the sandbox user
        work.mkdir()
        if uid is not None:
            os.chown(work, uid, uid)
        command = _limits_command(limits, uid) + as_user + python + [str(tmp / "code" / "main.py")]
        cwd = work
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
    started = time.monotonic()
    with (
        open(tmp / "stdin", "rb") as fin,
        open(tmp / "stdout", "wb") as fout,
        open(tmp / "stderr", "wb") as ferr,
    ):
        process = subprocess.Popen(
            command, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd, env=env, start_new_session=True
        )
        timed_out = False
        try:
            process.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(process.pid)  # stragglers of the rlimits fallback (bwrap's namespace takes its own)
        process.wait()
    wall = time.monotonic() - started
    stdout = _head(tmp / "stdout", limits.output_chars)
    stderr = _tail(tmp / "stderr", max(limits.output_chars, REASON_CHARS))
    reason = "wall_time" if timed_out else _reason(process.returncode, stderr, isolation)
    stderr = stderr[-limits.output_chars :]
    return Result(reason, stdout, stderr, process.returncode, wall, isolation)


def _limits_command(limits: Limits, uid: int | None) -> list[str]:
    processes = limits.processes + (0 if uid is not None else _tasks_of(os.geteuid()))
    memory = limits.memory_mb * MIB
    files = limits.file_mb * MIB
    return [
        "prlimit",
        f"--as={memory}:{memory}",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",  # SIGXCPU at the soft limit, SIGKILL a second later
        f"--fsize={files}:{files}",
        f"--nproc={processes}:{processes}",
        "--core=0:0",
        "--",
    ]


def _bwrap_command(limits: Limits, tmp: Path, uid: int | None) -> list[str]:
    """bwrap's part of the command. Run by root, bwrap mounts as root (so it reaches an interpreter in a
    private home, such as pyenv in root's) without a user namespace, and ``setpriv`` then drops the code to
    ``uid`` with no capabilities; run by a user, it makes a user namespace and drops every capability."""
    if uid is None:
        command = ["bwrap", "--unshare-all", "--cap-drop", "ALL"]
    else:
        command = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        command += ["--unshare-cgroup-try"]
    command += ["--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    command += ["--setenv", "HOME", "/box", "--setenv", "TMPDIR", "/box/tmp", "--setenv", "LANG", "C.UTF-8"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            command += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            command += ["--ro-bind", path, path]
    for path in _interpreter_dirs():
        command += ["--ro-bind", path, path]
    command += ["--proc", "/proc", "--dev", "/dev"]
    command += ["--size", str(limits.scratch_mb * MIB), "--perms", "1777", "--tmpfs", "/box"]
    command += ["--dir", "/box/tmp", "--chmod", "1777", "/box/tmp", "--symlink", "/box/tmp", "/tmp"]
    return [*command, "--ro-bind", str(tmp / "code"), "/code", "--chdir", "/box"]


def _interpreter() -> str:
    """``AJET_SANDBOX_PYTHON``, else the base interpreter (not a venv's): its installed packages are all
    the code may import."""
    chosen = os.environ.get(PYTHON_VAR) or getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(chosen)


def _interpreter_dirs() -> list[str]:
    """The interpreter's installation where it lies outside the system dirs (pyenv, conda, a module)."""
    python = _interpreter()
    prefix = os.path.dirname(os.path.dirname(python)) if os.environ.get(PYTHON_VAR) else sys.base_prefix
    dirs: list[str] = []
    for path in (os.path.realpath(prefix), os.path.dirname(python)):
        if not any(path == d or path.startswith(d + "/") for d in (*_SYSTEM_DIRS, *dirs)):
            dirs.append(path)
    return dirs


def _sandbox_uid() -> int | None:
    """A user id of this run's own when running as root; None otherwise (then the code runs as us)."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + (os.getpid() % 4096) * 256 + next(_uid_counter) % 256


def _tasks_of(uid: int) -> int:
    """How many processes (threads count: the kernel counts tasks) ``uid`` has now."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            count += int(fields.get("Threads", "1").strip() or 1)
    return count


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _head(path: Path, chars: int) -> str:
    with open(path, "rb") as f:
        return f.read(chars * 4).decode("utf-8", errors="replace")[:chars]


def _tail(path: Path, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - chars * 4))
        return f.read().decode("utf-8", errors="replace")[-chars:]


def _reason(returncode: int, stderr: str, isolation: str) -> str | None:
    if returncode == 0:
        return None
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    signum = -returncode if returncode < 0 else returncode - 128 if isolation == "bwrap" else 0
    if signum == signal.SIGXCPU:
        return "cpu_time"
    if signum == signal.SIGXFSZ or "File too large" in last:  # Python ignores SIGXFSZ: EFBIG
        return "file_size"
    if last.startswith("MemoryError") or "Cannot allocate memory" in last:
        reason = "memory"
    elif "Resource temporarily unavailable" in last or last.startswith("BlockingIOError"):
        reason = "processes"
    elif (0 < signum < 64 and returncode > 128) or returncode < 0:
        reason = f"signal {signal.Signals(signum).name}" if signum in signal.valid_signals() else "signal"
    else:
        reason = f"exit {returncode}"
    return f"{reason}: {last}" if last and not reason.startswith("signal") else reason
