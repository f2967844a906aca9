"""Client runtimes: the Python environment a client group's agents run in, built from its ``env:`` file.

A requirements file (``*.txt``) becomes a venv, a conda environment file (``*.yml``/``*.yaml``) a conda
environment. The launcher builds each one once, on the login node, before it submits anything, into a cache
keyed by the file's content and the launcher's interpreter: ``RUN/envs/<stem>-<hash12>/`` or, with
``cluster.env_cache``, a folder that runs share. The client array then starts with the runtime's python.

The runtime is layered over the launcher's environment: a ``.pth`` file in its site-packages adds the
launcher's site-packages *after* its own, so the runner's dependencies (ajet_hpc, submitit, openai, h5py)
import as on the server while whatever the env file installs shadows them for the agent. ``venv
--system-site-packages`` would not do: run from a venv it exposes the base interpreter's packages, not the
venv's. Nothing is ever installed into the launcher's environment (pip leaves alone what lies outside the
runtime's prefix).

A build runs under a lock file (two launches never build the same runtime at once) in the runtime's final
folder (venv scripts and conda packages record their absolute path, so a build cannot be renamed into
place); it counts as complete only once its marker file is written, last. A failed build is removed; an
interrupted one is found without its marker and rebuilt.

A cached runtime is code that every client task runs, so it is reused only when this user owns it and no
one else can change it: every folder and file of the runtime owned by the user and
not writable by group or others (``untrusted_reason``); anything else is refused with the path and the
fix. Builds run under umask 022 so that they pass that check on a cluster whose default umask is 002.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import itertools
import os
import platform
import shutil
import site
import stat
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ajet_hpc.config import ClusterConfig, ConfigError, Topology
from ajet_hpc.storage.files import write_json_atomic
from ajet_hpc.storage.rundir import RunDir

Progress = Callable[[str], None]
Kind = Literal["venv", "conda"]
MARKER = "ajet-runtime.json"  # written last: a runtime without it is incomplete
LAYER_PTH = "ajet-base-env.pth"
TAIL_LINES = 20
_KINDS: dict[str, Kind] = {".txt": "venv", ".yml": "conda", ".yaml": "conda"}
_SHOWN = ("Collecting ", "Processing ", "Successfully installed", "Installing pip packages")


class RuntimeBuildError(RuntimeError):
    """A client runtime could not be built; the message names the groups, the env file and the output."""


@dataclass(frozen=True)
class Runtime:
    """One client runtime: where it lives and what it is built from (shared by groups with the same file)."""

    groups: tuple[str, ...]
    env_file: Path
    kind: Kind
    key: str  # sha256 hex of the file's content and the launcher's interpreter
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def complete(self) -> bool:
        return (self.path / MARKER).is_file()

    @property
    def lock_file(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    @property
    def log_file(self) -> Path:
        return self.path.with_name(self.path.name + ".build.log")

    def who(self) -> str:
        names = ", ".join(repr(g) for g in self.groups)
        return f"client group{'s' if len(self.groups) > 1 else ''} {names} (env {self.env_file})"


def interpreter_identity() -> str:
    """What a runtime depends on besides its file: the interpreter's version and the environment it layers."""
    return f"{sys.implementation.name}-{platform.python_version()}-{platform.machine()} {sys.prefix}"


def runtime_key(content: bytes, kind: Kind, interpreter: str | None = None) -> str:
    """The cache key of a runtime: sha256 of its kind, the launcher's interpreter and the file's bytes."""
    digest = hashlib.sha256()
    for part in (b"ajet-runtime-1", kind.encode(), (interpreter or interpreter_identity()).encode()):
        digest.update(part + b"\0")
    digest.update(content)
    return digest.hexdigest()


def env_kind(env_file: str) -> Kind | None:
    return _KINDS.get(Path(env_file).suffix.lower())


def cache_dir(cluster: ClusterConfig, run: RunDir, cwd: Path | None = None) -> Path:
    """Where runtimes are built: ``cluster.env_cache`` (relative to ``cwd``) or ``RUN/envs``."""
    if cluster.env_cache is None:
        return run.root / "envs"
    return ((Path.cwd() if cwd is None else cwd) / Path(cluster.env_cache).expanduser()).absolute()


def plan_runtimes(topology: Topology, run: RunDir, envs_dir: Path) -> dict[str, Runtime]:
    """The runtime of every client group with an ``env`` (group name -> runtime), building nothing.

    Reads the env files (``ConfigError`` with the field path when one is missing or of an unknown kind).
    """
    cache = cache_dir(topology.cluster, run)
    by_path: dict[Path, Runtime] = {}
    chosen: dict[str, Path] = {}
    for i, group in enumerate(topology.clients):
        if group.env is None:
            continue
        where = f"clients[{i}].env"
        kind = env_kind(group.env)
        if kind is None:
            raise ConfigError.at(
                where,
                f"cannot build {group.env!r}: give a requirements file (*.txt, for a venv) or a conda "
                "environment file (*.yml, *.yaml)",
            )
        env_file = (envs_dir / group.env).absolute()
        try:
            content = env_file.read_bytes()
        except OSError as exc:
            raise ConfigError.at(
                where,
                f"cannot read environment file {env_file} ({exc.strerror}); launch from the "
                "directory that holds envs/",
            ) from exc
        key = runtime_key(content, kind)
        path = cache / f"{env_file.stem}-{key[:12]}"
        known = by_path.get(path)
        groups = (*known.groups, group.name) if known else (group.name,)
        by_path[path] = Runtime(groups=groups, env_file=env_file, kind=kind, key=key, path=path)
        chosen[group.name] = path
    return {name: by_path[path] for name, path in chosen.items()}


def pythons(runtimes: Mapping[str, Runtime]) -> dict[str, str]:
    """Group name -> the python its client jobs start with."""
    return {group: str(runtime.python) for group, runtime in runtimes.items()}


def describe(runtimes: Mapping[str, Runtime]) -> list[str]:
    """One line per runtime for a dry run: reused as it is, or built (and where)."""
    lines = []
    for runtime in _distinct(runtimes):
        state = "ready, reused" if runtime.complete else "would be built"
        lines.append(f"client runtime ({runtime.kind}) for {runtime.who()}: {runtime.path} ({state})")
    return lines


def ensure_all(runtimes: Mapping[str, Runtime], progress: Progress = print) -> None:
    """Build every runtime that is not complete yet (each once, however many groups share it)."""
    for runtime in _distinct(runtimes):
        ensure(runtime, progress)


def ensure(runtime: Runtime, progress: Progress = print) -> Path:
    """The runtime's python, after building the runtime unless a complete one is cached."""
    if runtime.complete:
        _refuse_untrusted(runtime)
        progress(f"client runtime for {runtime.who()}: reusing {runtime.path}")
        return runtime.python
    with _locked(runtime.lock_file, progress):
        if runtime.complete:
            _refuse_untrusted(runtime)
            progress(f"client runtime for {runtime.who()}: built meanwhile by another launch, {runtime.path}")
            return runtime.python
        if runtime.path.exists():
            progress(f"  removing the incomplete runtime left by an interrupted build: {runtime.path}")
            shutil.rmtree(runtime.path)
        progress(f"client runtime for {runtime.who()}: building a {runtime.kind} in {runtime.path}")
        started = time.monotonic()
        umask = os.umask(0o022)  # nobody but this user may change what the client tasks will run
        try:
            _build(runtime, progress)
        except BaseException:
            shutil.rmtree(runtime.path, ignore_errors=True)
            raise
        finally:
            os.umask(umask)
        write_json_atomic(
            runtime.path / MARKER,
            {
                "env_file": str(runtime.env_file),
                "kind": runtime.kind,
                "key": runtime.key,
                "interpreter": interpreter_identity(),
                "built_at": time.time(),
            },
        )
        progress(f"  runtime ready in {time.monotonic() - started:.0f}s: {runtime.python}")
    return runtime.python


def untrusted_reason(path: Path, uid: int | None = None) -> str | None:
    """Why ``path`` (a folder: itself and everything under it, links not followed) may not be trusted, or
    None: an entry owned by another user, or writable by group or others."""
    uid = os.getuid() if uid is None else uid
    if not path.exists():
        return None
    walked = os.walk(path)
    entries = (os.path.join(folder, name) for folder, dirs, files in walked for name in (*dirs, *files))
    for entry in itertools.chain([str(path)], entries):
        info = os.lstat(entry)
        if info.st_uid != uid:
            return f"{entry} is owned by uid {info.st_uid}, not by you (uid {uid})"
        if not stat.S_ISLNK(info.st_mode) and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{entry} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _refuse_untrusted(runtime: Runtime) -> None:
    reason = untrusted_reason(runtime.path)
    if reason is not None:
        raise RuntimeBuildError(
            f"{runtime.who()}: refusing the cached runtime {runtime.path}: {reason}. Another user could put "
            "code into it that every client task runs; remove it (or `chmod -R go-w` it if you own all of "
            "it) and launch again, or point cluster.env_cache to a folder of your own"
        )


def _distinct(runtimes: Mapping[str, Runtime]) -> list[Runtime]:
    return list({runtime.path: runtime for runtime in runtimes.values()}.values())


@contextlib.contextmanager
def _locked(lock_file: Path, progress: Progress) -> Iterator[None]:
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"  waiting for another launch that builds this runtime (lock {lock_file})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:  # a file system mounted without locks (Lustre without -o flock)
            progress(f"  warning: cannot lock {lock_file} ({exc.strerror}); building without the lock")
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def launcher_has_pip() -> bool:
    """Whether the launcher's interpreter has pip, asked of its installed distributions, not of the import
    system: on Python < 3.12 setuptools' distutils shim answers ``importlib.util.find_spec("pip")`` by
    switching the process to the standard library's distutils for good, and a later ``import setuptools``
    (torch's ``cpp_extension``, imported by vLLM in the launch's LoRA check) then fails its assertion."""
    try:
        importlib.metadata.distribution("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _build(runtime: Runtime, progress: Progress) -> None:
    runtime.log_file.unlink(missing_ok=True)
    if runtime.kind == "venv":
        with_pip = not launcher_has_pip()  # else the launcher's pip serves, via the layer
        venv = [sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(runtime.path)]
        _run(runtime, "python -m venv", venv, progress)
        _layer(runtime)
        install = [str(runtime.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        _run(runtime, "pip install", [*install, "-r", str(runtime.env_file)], progress)
    else:
        tool = shutil.which("mamba") or shutil.which("conda")
        if tool is None:
            raise RuntimeBuildError(
                f"{runtime.who()}: a conda environment file needs `conda` or `mamba` on PATH, and neither "
                "is; load it first (e.g. `module load miniforge`) or use a requirements file (*.txt)"
            )
        create = [tool, "env", "create", "-p", str(runtime.path), "-f", str(runtime.env_file)]
        _run(runtime, f"{Path(tool).name} env create", create, progress)
        if not runtime.python.exists():
            raise RuntimeBuildError(
                f"{runtime.who()}: the conda environment has no python; add `python="
                f"{sys.version_info.major}.{sys.version_info.minor}` to its dependencies"
            )
        _layer(runtime)


def _layer(runtime: Runtime) -> None:
    """Put the launcher's site-packages behind the runtime's own (a ``.pth`` file in its site-packages)."""
    probe = (
        "import sys, sysconfig\nprint('%d.%d' % sys.version_info[:2])\nprint(sysconfig.get_path('purelib'))"
    )
    done = subprocess.run([str(runtime.python), "-c", probe], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeBuildError(f"{runtime.who()}: its python does not start: {done.stderr.strip()[-2000:]}")
    version, purelib = done.stdout.split("\n")[:2]
    ours = f"{sys.version_info.major}.{sys.version_info.minor}"
    if version != ours:
        raise RuntimeBuildError(
            f"{runtime.who()}: the environment has python {version}, the launcher {ours}; the client runner "
            f"needs the launcher's packages, so pin `python={ours}` in the environment file"
        )
    lines = [f"import site; site.addsitedir({folder!r})" for folder in site.getsitepackages()]
    Path(purelib).mkdir(parents=True, exist_ok=True)
    (Path(purelib) / LAYER_PTH).write_text("\n".join(lines) + "\n")


def _run(runtime: Runtime, what: str, command: list[str], progress: Progress) -> None:
    """Run one build step, its output appended to the build log; a failure shows the last lines."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    runtime.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(runtime.log_file, "a") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                command,
                cwd=runtime.env_file.parent,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        except OSError as exc:
            raise RuntimeBuildError(f"{runtime.who()}: cannot run {what}: {exc}") from exc
        assert proc.stdout is not None
        with proc:
            for line in proc.stdout:
                log.write(line)
                tail.append(line.rstrip())
                if line.startswith(_SHOWN):
                    progress(f"    {line.rstrip()}")
    if proc.returncode != 0:
        shown = "\n".join(f"    {line}" for line in tail)
        raise RuntimeBuildError(
            f"{runtime.who()}: building its runtime failed, {what} exited with {proc.returncode}; "
            f"its last lines (all in {runtime.log_file}):\n{shown}"
        )
