"""The processes of the proxy benchmark: our server and ``vllm serve`` as subprocesses in their own
process groups (started, watched, stopped on any exit), and the server side itself (``proxy.py _serve``:
our real app over the VllmEngine or the ZeroEngine, optionally under cProfile)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (str(REPO), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from ajet_hpc.trainer.protocol.rank_env import free_port  # noqa: E402

MODEL = "policy"  # the served model name, on both sides
MAX_MODEL_LEN = 1024
SECRET_ENV = "AJET_BENCH_SECRET"
SWITCH_ENV = "AJET_BENCH_SWITCH_INTERVAL"
ENTRY = HERE / "proxy.py"  # ``proxy.py _serve ...`` runs our server


# ============================================================================== subprocesses
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of the process and all its descendants so far."""
        return sum(self.cpu_split())

    def cpu_split(self) -> tuple[float, float]:
        """CPU seconds so far of the server process itself (HTTP + API) and of its descendants (the vLLM
        engine core and worker)."""
        import psutil

        own = children = 0.0
        try:
            root = psutil.Process(self.popen.pid)
            times = root.cpu_times()
            own = times.user + times.system
            for proc in root.children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = proc.cpu_times()
                    children += times.user + times.system
        except psutil.NoSuchProcess:
            pass
        return own, children


_CHILDREN: list[Proc] = []


def spawn(name: str, cmd: list[str], log: Path, env: dict[str, str], port: int) -> Proc:
    """Start ``cmd`` in its own process group (so that stopping it stops its engine processes too)."""
    handle = log.open("wb")
    popen = subprocess.Popen(
        cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=REPO
    )
    handle.close()
    proc = Proc(name, popen, port, log)
    _CHILDREN.append(proc)
    return proc


def stop(proc: Proc, grace_s: float = 20.0) -> None:
    """SIGTERM to the process group we created, SIGKILL after ``grace_s``."""
    if proc in _CHILDREN:
        _CHILDREN.remove(proc)
    pgid = proc.popen.pid  # start_new_session: the group id is the child's pid
    if proc.popen.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(grace_s)
    # the leader is gone; its engine processes may not be
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    if proc.popen.poll() is None:
        proc.popen.kill()
        proc.popen.wait(5)


def stop_all() -> None:
    for proc in list(_CHILDREN):
        stop(proc, grace_s=10)


def _on_signal(signum, _frame) -> None:
    raise SystemExit(f"interrupted by {signal.Signals(signum).name}")


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_up(proc: Proc, timeout_s: float) -> float:
    """Seconds until GET /health answers 200; a clear error if the process dies or the port stays shut."""
    import httpx

    started = time.monotonic()
    last = "no answer yet"
    while time.monotonic() - started < timeout_s:
        code = proc.popen.poll()
        if code is not None:
            raise SystemExit(
                f"{proc.name}: the server process exited with code {code} before 127.0.0.1:{proc.port} came "
                f"up.\nLast lines of {proc.log}:\n{log_tail(proc.log)}"
            )
        try:
            reply = httpx.get(f"{proc.url}/health", timeout=2)
            if reply.status_code == 200:
                return time.monotonic() - started
            last = f"HTTP {reply.status_code}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    raise SystemExit(
        f"{proc.name}: 127.0.0.1:{proc.port} did not come up within {timeout_s:.0f} s (last: {last}).\n"
        f"Last lines of {proc.log}:\n{log_tail(proc.log)}"
    )


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    return env


def start_ours(engine: str, model_dir: Path, workdir: Path, secret: str, profile: Path | None = None) -> Proc:
    port = free_port()
    cmd = [sys.executable, str(ENTRY), "_serve", engine, str(model_dir), str(port)]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    env = server_env() | {SECRET_ENV: secret}
    return spawn(f"ours[{engine}]", cmd, workdir / f"ours-{engine}.log", env, port)


def start_vllm(model_dir: Path, workdir: Path) -> Proc:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--seed",
        "0",
        "--logprobs-mode",
        "raw_logprobs",
        "--enable-prefix-caching",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
    ]
    return spawn("vllm serve", cmd, workdir / "vllm-serve.log", server_env(), port)


# ============================================================================== server (subprocess side)
class NoStore:
    """A server store that stores nothing (``ajet_hpc.server.app.ServerStore``): the proxy benchmark measures
    the API alone, without the HDF5 commit each end waits for in a real server (that cost is
    ``tools/bench/store.py``'s; docs/reliability.md, "Costs"). Every episode counts as written at once."""

    path = Path("/dev/null")

    def submit(self, episode: object) -> None:
        pass

    def submit_step(self, record: object) -> None:
        pass

    def on_written(self, callback: Callable[[Any], None]) -> None:
        pass

    async def written(self) -> bool:
        return True

    def unwritten_ids(self) -> frozenset[str]:
        return frozenset()

    def flush(self, timeout_s: float = 60.0) -> bool:
        return True

    def close(self) -> None:
        pass


def _server_class():
    """The server class ajet_hpc.server.process runs (uvicorn minus re-raising SIGTERM after shutdown),
    so that the profile is written on the way out."""
    from ajet_hpc.server.process import GracefulServer

    return GracefulServer


def serve_main(argv: list[str]) -> int:
    """``proxy.py _serve {vllm,zero} MODEL_DIR PORT [--profile FILE]``: our real app on 127.0.0.1:PORT."""
    parser = argparse.ArgumentParser(prog="proxy.py _serve")
    parser.add_argument("engine", choices=["vllm", "zero"])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("port", type=int)
    parser.add_argument("--profile", type=Path)
    args = parser.parse_args(argv)

    import uvicorn

    from ajet_hpc.config import ServingConfig
    from ajet_hpc.engine.base import Engine

    if os.environ.get(SWITCH_ENV):  # diagnostic knob (see the README): the GIL switch interval, seconds
        sys.setswitchinterval(float(os.environ[SWITCH_ENV]))
    from ajet_hpc.server.app import create_app
    from ajet_hpc.server.context import JobContext, ModelContext

    engine: Engine
    if args.engine == "vllm":
        from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

        engine = VllmEngine(
            args.model_dir,
            VllmSettings(
                dtype="float32",
                max_model_len=MAX_MODEL_LEN,
                enforce_eager=True,
                enable_prefix_caching=True,
                seed=0,
                cpu_kv_cache_gib=1,
            ),
        )
    else:
        from zero_engine import ZeroEngine

        engine = ZeroEngine(args.model_dir, MAX_MODEL_LEN)
        asyncio.run(engine.start())  # loads the tokenizer (the app's start then finds it started)
        # the runtime check reads every member, the tokenizer too: only a started engine passes it
        assert isinstance(engine, Engine), "ZeroEngine does not satisfy ajet_hpc.engine.base.Engine"
    ctx = ModelContext(
        name=MODEL,
        job=JobContext(engine=engine, secret=os.environ[SECRET_ENV], job_id="bench"),
        settings=ServingConfig(max_model_len=MAX_MODEL_LEN, max_tokens=256),
        recorder=NoStore(),
        public_url=f"http://127.0.0.1:{args.port}",
    )
    # as ajet_hpc.server.process runs it: one worker, uvloop + httptools when installed, no access log
    config = uvicorn.Config(
        create_app(ctx, freeze_heap=True),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
    )
    server = _server_class()(config)
    if args.profile is None:
        server.run()
        return 0

    import cProfile
    import pstats
    import threading

    profiles: list[cProfile.Profile] = []

    def profile_thread(_frame, _event, _arg):  # first event in each new thread: a profiler of its own
        sys.setprofile(None)
        profile = cProfile.Profile()
        profiles.append(profile)
        profile.enable()

    threading.setprofile(profile_thread)
    main_profile = cProfile.Profile()
    main_profile.enable()
    try:
        server.run()
    finally:
        main_profile.disable()
        stats = pstats.Stats(main_profile)
        for profile in profiles:
            stats.add(profile)
        stats.dump_stats(str(args.profile))
    return 0
