#!/usr/bin/env python
"""Benchmark of the ajet_hpc server (the recording OpenAI proxy): ``python tools/bench/proxy.py [--quick]``.

Two measurements, then one line ``RESULT proxy_vs_vllm=<ratio> overhead_rps=<n> p50_added_ms=<ms>``:

1. **proxy vs vllm serve** — the built-in tiny model behind (a) our server with the VllmEngine and (b) vLLM's
   own OpenAI server (``python -m vllm.entrypoints.openai.api_server``), same vLLM settings (float32, eager,
   max_model_len, VLLM_CPU_KVCACHE_SPACE=1, seed 0, raw logprobs, prefix caching on). Both run as
   subprocesses on loopback; only one is under load at a time, alternating, with the same warm-up and the
   same wall window per leg. 64 closed-loop clients send the same greedy chat request (max_tokens 32); our
   side wraps them in episodes (begin → chat calls with the episode token → end, all inside the window).
   vLLM is measured twice: plain, and asked for logprobs (which our server always has vLLM compute).
   Reported: completion tokens/s of each side (median over legs), ours/vLLM (``proxy_vs_vllm``: the median
   of the per-pair ratios of the 3 leg pairs, each pair run back to back), and each server process's
   CPU per request.
2. **proxy overhead** — our real app (uvicorn, one worker) over `ZeroEngine` (answers instantly), 256
   clients: closed-loop requests/s and latency of GET /health, chat calls, the episode API (begin+end) and
   4-turn agent episodes; latency at 256 connections paced below saturation; latency of one client alone.

The load generator is a minimal keep-alive HTTP/1.1 client on uvloop in this process (one connection per
simulated client). It shares the machine's cores with the server, so every figure is a floor. CPU used by
other processes is measured in every window; a leg or phase during which they took >= BUSY_CORES is
measured again (RETRIES times at most). See tools/bench/README.md for the figures and what they mean.

``--profile`` prints the CPU cost of the pieces of a chat call (in-process) and runs the chat phase of (2)
with the server under cProfile (slower than an unprofiled run; look at the shares, not the rates).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (str(REPO), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

MODEL = "policy"  # the served model name, on both sides
MAX_MODEL_LEN = 1024
PROMPT = "Write one short line about the weather today."
LLM_MAX_TOKENS = 32
SECRET_ENV = "AJET_BENCH_SECRET"
SWITCH_ENV = "AJET_BENCH_SWITCH_INTERVAL"
BUSY_CORES = 0.25  # other processes above this many cores during a window: it is measured again
RETRIES = 2  # extra tries of a leg or phase the machine was busy during
now = time.perf_counter


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    cmd = [sys.executable, str(Path(__file__).resolve()), "_serve", engine, str(model_dir), str(port)]
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
    from ajet_hpc.server.app import ServerContext, create_app

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
    ctx = ServerContext(
        name=MODEL,
        engine=engine,
        settings=ServingConfig(max_model_len=MAX_MODEL_LEN, max_tokens=256),
        secret=os.environ[SECRET_ENV],
        job_id="bench",
        public_url=f"http://127.0.0.1:{args.port}",
    )
    # as ajet_hpc.server.process runs it: one worker, uvloop + httptools when installed, no access log
    config = uvicorn.Config(
        create_app(ctx), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
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


# ============================================================================== HTTP load generator
class Conn:
    """One keep-alive HTTP/1.1 connection: send prepared request bytes, read one response."""

    __slots__ = ("host", "port", "reader", "writer")

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        reused = self.writer is not None
        if not reused:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        reader, writer = self.reader, self.writer
        try:
            writer.write(raw)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                if not reused:
                    raise
                # the server closed the idle keep-alive connection: once more on a new one, as HTTP
                # clients do (nothing of a response arrived, so the request was not served)
                self.close()
                return await self.send(raw)
            status = int(head[9:12])
            lower = head.lower()
            at = lower.find(b"\r\ncontent-length:")
            if at >= 0:
                length = int(lower[at + 17 : lower.index(b"\r\n", at + 2)])
                body = await reader.readexactly(length) if length else b""
            elif b"\r\ntransfer-encoding: chunked" in lower:
                parts = []
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    parts.append(await reader.readexactly(size + 2))
                    if size == 0:
                        break
                body = b"".join(part[:-2] for part in parts)
            else:
                body = await reader.read()
                lower += b"\r\nconnection: close"
            if b"\r\nconnection: close" in lower:
                self.close()
            return status, body
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def request_bytes(method: str, path: str, port: int, body: object = None, token: str | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    data = b""
    if body is not None:
        data = json.dumps(body, separators=(",", ":")).encode()
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


@dataclass
class Load:
    """Completed requests of a run: (time done, latency s, kind, completion tokens, ok)."""

    records: list[tuple[float, float, str, int, bool]] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    first_errors: list[str] = field(default_factory=list)

    def add(self, t0: float, t1: float, kind: str, status: int, body: bytes, tokens: int = 0) -> bool:
        ok = status == 200
        self.records.append((t1, t1 - t0, kind, tokens, ok))
        if not ok:
            self.errors[f"{kind} HTTP {status}"] += 1
            if len(self.first_errors) < 3:
                self.first_errors.append(f"{kind}: HTTP {status} {body[:300]!r}")
        return ok

    def window(self, start: float, end: float, kind: str | None = None) -> list[tuple]:
        return [r for r in self.records if start <= r[0] < end and (kind is None or r[2] == kind)]


@dataclass
class Window:
    """What one measured window saw."""

    seconds: float
    requests: int
    failed: int
    tokens: int
    latencies_ms: list[float]
    server_cpu: float  # cores busy, averaged over the window
    client_cpu: float
    other_cpu: float = 0.0  # the idle server's cores, where another one is up
    foreign_cpu: float = 0.0  # cores busy with processes not of this benchmark (other users of the machine)
    api_cpu: float = 0.0  # of server_cpu: the server process itself (HTTP, API), not its engine processes

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds

    @property
    def busy(self) -> bool:
        """Whether other processes took a noticeable share of the CPUs during the window."""
        return self.foreign_cpu >= BUSY_CORES

    @property
    def cpu_ms(self) -> float:
        """Server CPU milliseconds per request (robust to other load on the machine, unlike rates)."""
        return self.server_cpu * 1000 / self.rps if self.requests else float("nan")

    def pct(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


def busy_cpu_seconds() -> float:
    """CPU seconds processes of the whole machine have run so far (user + nice + system, all cores; not
    interrupt time, which our own loopback traffic causes)."""
    import psutil

    times = psutil.cpu_times()
    return times.user + times.nice + times.system


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


ClientFn = Callable[[Conn, Load, float], Awaitable[None]]


async def closed_loop(
    proc: Proc,
    clients: int | list[Conn],
    client: ClientFn,
    warmup_s: float,
    window_s: float,
    windows: int,
    kind: str | None,
    others: tuple[Proc, ...] = (),
) -> list[Window]:
    """``clients`` closed-loop clients (a number, or their open connections) run ``client`` until the last
    window ends; the windows are cut from the records by completion time (steady state: no ramp-up, no
    tail)."""
    load = Load()
    conns = [Conn("127.0.0.1", proc.port) for _ in range(clients)] if isinstance(clients, int) else clients
    start = now()
    bounds = [start + warmup_s + i * window_s for i in range(windows + 1)]
    samples: list[tuple[float, ...]] = []

    async def sampler() -> None:
        for bound in bounds:
            await asyncio.sleep(max(0.0, bound - now()))
            own, children = proc.cpu_split()
            samples.append(
                (
                    own + children,
                    time.process_time(),
                    sum(other.cpu_seconds() for other in others),
                    busy_cpu_seconds(),
                    own,
                )
            )

    sampling = asyncio.create_task(sampler())
    await asyncio.gather(*(client(conn, load, bounds[-1]) for conn in conns))
    await sampling
    if isinstance(clients, int):
        for conn in conns:
            conn.close()
    if load.errors:
        print(f"    ! {sum(load.errors.values())} failed requests: {dict(load.errors)}", flush=True)
        for line in load.first_errors:
            print(f"      e.g. {line}", flush=True)
    out = []
    for i in range(windows):
        rows = load.window(bounds[i], bounds[i + 1], kind)
        good = [r for r in rows if r[4]]
        cpu = [(samples[i + 1][j] - samples[i][j]) / window_s for j in range(5)]
        out.append(
            Window(
                window_s,
                len(good),
                len(rows) - len(good),
                sum(r[3] for r in good),
                [r[1] * 1000 for r in good],
                cpu[0],
                cpu[1],
                cpu[2],
                max(0.0, cpu[3] - cpu[0] - cpu[1] - cpu[2]),
                cpu[4],
            )
        )
    return out


async def paced(
    proc: Proc, clients: int, rate: float, duration_s: float, raw: Callable[[int], bytes], kind: str
) -> tuple[Window, float]:
    """``clients`` connections sending at ``rate`` requests/s in all (each one on its own schedule). Returns
    the window and the share of requests that left more than 2 ms behind schedule (the load was too much)."""
    load = Load()
    interval = clients / rate
    late = 0
    conns = [Conn("127.0.0.1", proc.port) for _ in range(clients)]
    opened = await asyncio.gather(*(conn.send(request_bytes("GET", "/health", proc.port)) for conn in conns))
    assert all(status == 200 for status, _ in opened), "GET /health failed while opening connections"
    start = now() + 0.2
    cpu0 = (proc.cpu_seconds(), time.process_time(), busy_cpu_seconds())

    async def worker(i: int) -> None:
        nonlocal late
        conn, request = conns[i], raw(i)
        k = 0
        while True:
            scheduled = start + (i / clients + k) * interval
            if scheduled >= start + duration_s:
                break
            delay = scheduled - now()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.002:
                late += 1
            t0 = now()
            status, body = await conn.send(request)
            load.add(t0, now(), kind, status, body)
            k += 1
        conn.close()

    await asyncio.gather(*(worker(i) for i in range(clients)))
    cpu = [
        (proc.cpu_seconds() - cpu0[0]) / duration_s,
        (time.process_time() - cpu0[1]) / duration_s,
        (busy_cpu_seconds() - cpu0[2]) / duration_s,
    ]
    rows = [r for r in load.records if r[4]]
    latencies = [r[1] * 1000 for r in rows]
    foreign = max(0.0, cpu[2] - cpu[0] - cpu[1])
    window = Window(
        duration_s, len(rows), len(load.records) - len(rows), 0, latencies, cpu[0], cpu[1], 0, foreign
    )
    return window, late / max(1, len(load.records))


# ============================================================================== workloads
def chat_body(max_tokens: int, messages: list[dict] | None = None) -> dict:
    return {
        "model": MODEL,
        "messages": messages or [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def completion_tokens(body: bytes) -> int:
    try:
        return int(json.loads(body)["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 0


class OurApi:
    """Requests against our server: the episode API with a run token (the challenge proves the server holds
    the secret; the secret itself is never sent), chat calls with episode tokens."""

    def __init__(self, port: int, secret: str) -> None:
        from ajet_hpc.client.handshake import fetch_run_token

        self.port, self.secret = port, fetch_run_token(f"http://127.0.0.1:{port}", secret)
        self.begin_raw = request_bytes("POST", "/v1/episodes", port, {"task_id": "bench"}, self.secret)

    def end_raw(self, episode_id: str) -> bytes:
        return request_bytes(
            "POST", f"/v1/episodes/{episode_id}/end", self.port, {"reward": 1.0}, self.secret
        )

    def chat_raw(self, episode: dict, body: dict) -> bytes:
        path = f"/episodes/{episode['episode_id']}/v1/chat/completions"
        return request_bytes("POST", path, self.port, body, episode["api_key"])

    async def begin(self, conn: Conn, load: Load) -> dict | None:
        t0 = now()
        status, body = await conn.send(self.begin_raw)
        return json.loads(body) if load.add(t0, now(), "begin", status, body) else None

    async def end(self, conn: Conn, load: Load, episode: dict) -> None:
        t0 = now()
        status, body = await conn.send(self.end_raw(episode["episode_id"]))
        load.add(t0, now(), "end", status, body)


def ours_llm_client(api: OurApi, calls_per_episode: int) -> ClientFn:
    """Episodes of ``calls_per_episode`` identical chat calls (the LLM comparison, our side)."""
    body = chat_body(LLM_MAX_TOKENS)

    async def client(conn: Conn, load: Load, stop_at: float) -> None:
        while now() < stop_at:
            episode = await api.begin(conn, load)
            if episode is None:
                await asyncio.sleep(0.1)
                continue
            raw = api.chat_raw(episode, body)
            for _ in range(calls_per_episode):
                if now() >= stop_at:
                    break
                t0 = now()
                status, reply = await conn.send(raw)
                load.add(t0, now(), "chat", status, reply, completion_tokens(reply) if status == 200 else 0)
            await api.end(conn, load, episode)

    return client


def vllm_llm_client(port: int, logprobs: bool = False) -> ClientFn:
    """Plain chat calls to vllm serve; with ``logprobs`` also the sampled tokens' logprobs (which our
    server always has vLLM compute, to record them)."""
    body = chat_body(LLM_MAX_TOKENS) | ({"logprobs": True, "top_logprobs": 0} if logprobs else {})
    raw = request_bytes("POST", "/v1/chat/completions", port, body, "none")

    async def client(conn: Conn, load: Load, stop_at: float) -> None:
        while now() < stop_at:
            t0 = now()
            status, reply = await conn.send(raw)
            load.add(t0, now(), "chat", status, reply, completion_tokens(reply) if status == 200 else 0)

    return client


def repeat_client(raw: bytes, kind: str) -> ClientFn:
    async def client(conn: Conn, load: Load, stop_at: float) -> None:
        while now() < stop_at:
            t0 = now()
            status, body = await conn.send(raw)
            load.add(t0, now(), kind, status, body)

    return client


def episode_api_client(api: OurApi) -> ClientFn:
    async def client(conn: Conn, load: Load, stop_at: float) -> None:
        while now() < stop_at:
            episode = await api.begin(conn, load)
            if episode is not None:
                await api.end(conn, load, episode)

    return client


AGENT_TURNS = ["Plan the trip.", "Now list three stops.", "Which one first?", "Thanks, summarize."]


def agent_client(api: OurApi) -> ClientFn:
    """Agent-like episodes: begin, 4 chat turns on a growing conversation (earlier answers sent back, so the
    server splices their recorded tokens), end."""

    async def client(conn: Conn, load: Load, stop_at: float) -> None:
        while now() < stop_at:
            episode = await api.begin(conn, load)
            if episode is None:
                continue
            messages: list[dict] = [{"role": "system", "content": "You are a travel agent."}]
            for turn in AGENT_TURNS:
                messages.append({"role": "user", "content": turn})
                t0 = now()
                status, reply = await conn.send(api.chat_raw(episode, chat_body(16, messages)))
                if not load.add(t0, now(), "chat", status, reply):
                    break
                messages.append(json.loads(reply)["choices"][0]["message"])
            await api.end(conn, load, episode)

    return client


async def begin_episodes(api: OurApi, conns: list[Conn]) -> list[dict]:
    load = Load()
    episodes = await asyncio.gather(*(api.begin(conn, load) for conn in conns))
    if load.errors or any(e is None for e in episodes):
        raise SystemExit(f"could not begin the episodes: {load.first_errors}")
    return list(episodes)  # type: ignore[arg-type]


# ============================================================================== the two benchmarks
def run_async(coroutine):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


def fmt(value: float, digits: int = 1) -> str:
    return "nan" if value != value else f"{value:,.{digits}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def describe(w: Window) -> str:
    return (
        f"{fmt(w.rps, 0):>6s} req/s  p50 {fmt(w.pct(50))} ms  p99 {fmt(w.pct(99))} ms  "
        f"server {w.server_cpu:.2f} cores = {fmt(w.cpu_ms, 3)} ms CPU/req, client {w.client_cpu:.2f}, "
        f"other processes {w.foreign_cpu:.2f}"
    )


@dataclass
class Plan:
    llm_rounds: int  # legs per side, alternating ours / vLLM (ABBA...)
    llm_warmup_s: float
    llm_window_s: float
    llm_clients: int
    calls_per_episode: int
    zero_clients: int
    zero_warmup_s: float
    zero_window_s: float
    zero_windows: int
    paced_s: float
    single_requests: int


FULL = Plan(3, 4.0, 12.0, 64, 8, 256, 2.0, 5.0, 3, 8.0, 400)
QUICK = Plan(1, 3.0, 5.0, 64, 8, 256, 1.5, 3.0, 1, 3.0, 150)
CHAT_PHASE = "chat, 1 turn, open episode"


def bench_vllm(plan: Plan, model_dir: Path, workdir: Path, secret: str) -> dict:
    print("\n== 1. proxy vs vllm serve (tiny model, vLLM on CPU, float32, eager) ==", flush=True)
    t = time.monotonic()
    ours = start_ours("vllm", model_dir, workdir, secret)
    theirs = start_vllm(model_dir, workdir)
    for proc in (ours, theirs):
        wait_up(proc, 420)
    print(f"  both up after {time.monotonic() - t:.0f} s (started together; logs in {workdir})", flush=True)
    api = OurApi(ours.port, secret)

    async def probe() -> tuple[int, int, int]:
        """Our server takes fields it does not know (as OpenAI does) and ignores them: ignore_eos, too."""
        conn, load = Conn("127.0.0.1", ours.port), Load()
        episode = await api.begin(conn, load)
        if episode is None:
            raise SystemExit(f"our server refused to begin an episode: {load.first_errors}")
        body = {**chat_body(LLM_MAX_TOKENS), "ignore_eos": True}
        status, reply = await conn.send(api.chat_raw(episode, body))
        await api.end(conn, load, episode)
        conn.close()
        conn = Conn("127.0.0.1", theirs.port)
        raw = request_bytes("POST", "/v1/chat/completions", theirs.port, chat_body(LLM_MAX_TOKENS))
        status2, reply2 = await conn.send(raw)
        conn.close()
        if status2 != 200:
            raise SystemExit(f"vllm serve refused the chat request: HTTP {status2} {reply2[:300]!r}")
        return status, completion_tokens(reply), completion_tokens(reply2)

    status, ours_tokens, their_tokens = run_async(probe())
    print(
        f"  check: our server answers HTTP {status} to a chat request with the unknown field ignore_eos "
        f"(accepted, ignored); greedy, max_tokens={LLM_MAX_TOKENS}: {ours_tokens} tokens from ours, "
        f"{their_tokens} from vllm serve",
        flush=True,
    )
    sides = {
        "ours": (ours, ours_llm_client(api, plan.calls_per_episode), theirs),
        "vllm": (theirs, vllm_llm_client(theirs.port), ours),
        "vllm+lp": (theirs, vllm_llm_client(theirs.port, logprobs=True), ours),
    }
    results: dict[str, list[Window]] = {side: [] for side in sides}
    for leg in range(plan.llm_rounds):
        order = list(sides) if leg % 2 == 0 else list(reversed(sides))  # ABBA: a drift cancels out
        for side in order:
            proc, client, idle = sides[side]
            for attempt in range(RETRIES + 1):
                [window] = run_async(
                    closed_loop(
                        proc,
                        plan.llm_clients,
                        client,
                        plan.llm_warmup_s,
                        plan.llm_window_s,
                        1,
                        "chat",
                        (idle,),
                    )
                )
                if not window.busy or attempt == RETRIES:
                    break
                print(
                    f"  (other processes took {window.foreign_cpu:.2f} cores: leg measured again)", flush=True
                )
                wait_quiet(60)
            results[side].append(window)
            print(
                f"  leg {leg + 1} {side:7s}: {fmt(window.tps, 0):>6s} completion tok/s, "
                f"{fmt(window.rps):>5s} chat req/s, p50 {fmt(window.pct(50), 0)} ms, server "
                f"{window.server_cpu:.2f} cores (API process {window.api_cpu:.2f}), idle server "
                f"{window.other_cpu:.3f}, other processes {window.foreign_cpu:.2f}, {window.failed} failed",
                flush=True,
            )
    stop(ours)
    stop(theirs)

    def summary(side: str) -> dict:
        windows = results[side]
        requests = sum(w.requests for w in windows)
        return {
            "tps": statistics.median(w.tps for w in windows),
            "rps": statistics.median(w.rps for w in windows),
            "p50": statistics.median(w.pct(50) for w in windows),
            "tokens_per_request": sum(w.tokens for w in windows) / max(1, requests),
            "cpu": statistics.median(w.server_cpu for w in windows),
            "api_cpu": statistics.median(w.api_cpu for w in windows),
            "api_ms": statistics.median(w.api_cpu * 1000 / w.rps for w in windows if w.rps),
            "foreign": max(w.foreign_cpu for w in windows),
        }

    out = {side: summary(side) for side in results}
    out["paired"] = [o.tps / v.tps for o, v in zip(results["ours"], results["vllm"], strict=True) if v.tps]
    # the median of the per-pair ratios: each pair ran back to back, so slow drifts of the machine cancel
    out["ratio"] = statistics.median(out["paired"]) if out["paired"] else float("nan")
    out["ratio_of_medians"] = out["ours"]["tps"] / out["vllm"]["tps"] if out["vllm"]["tps"] else float("nan")
    lp = out["vllm+lp"]["tps"]
    out["ratio_lp"] = out["ours"]["tps"] / lp if lp else float("nan")
    out["idle_cpu"] = max(w.other_cpu for windows in results.values() for w in windows)
    out["failed"] = sum(w.failed for windows in results.values() for w in windows)
    out["busy_legs"] = sum(w.busy for windows in results.values() for w in windows)
    return out


def bench_zero(plan: Plan, model_dir: Path, workdir: Path, secret: str, profile: Path | None = None) -> dict:
    n = plan.zero_clients
    print(f"\n== 2. proxy overhead: our app over a zero-latency engine, {n} clients ==", flush=True)
    proc = start_ours("zero", model_dir, workdir, secret, profile)
    wait_up(proc, 180)
    api = OurApi(proc.port, secret)
    health_raw = request_bytes("GET", "/health", proc.port)
    rows: dict[str, list[Window]] = {}

    def closed(name: str, clients: int | list[Conn], client: ClientFn, kind: str | None) -> None:
        for attempt in range(RETRIES + 1):
            windows = run_async(
                closed_loop(
                    proc, clients, client, plan.zero_warmup_s, plan.zero_window_s, plan.zero_windows, kind
                )
            )
            if not all(w.busy for w in windows) or attempt == RETRIES:
                break
            print(f"  (other processes busy during {name}: measured again)", flush=True)
            wait_quiet(60)
        rows[name] = windows
        print(f"  {name:30s} {describe(median_window(windows))}", flush=True)

    async def chat_phase() -> None:
        """Each client holds one episode (begun before the windows) and repeats the same 1-turn call."""
        conns = [Conn("127.0.0.1", proc.port) for _ in range(n)]
        episodes = await begin_episodes(api, conns)
        raws = {id(conn): api.chat_raw(e, chat_body(16)) for conn, e in zip(conns, episodes, strict=True)}

        async def client(conn: Conn, load: Load, stop_at: float) -> None:
            raw = raws[id(conn)]
            while now() < stop_at:
                t0 = now()
                status, body = await conn.send(raw)
                load.add(t0, now(), "chat", status, body)

        for attempt in range(RETRIES + 1):
            rows[CHAT_PHASE] = await closed_loop(
                proc, conns, client, plan.zero_warmup_s, plan.zero_window_s, plan.zero_windows, "chat"
            )
            if not all(w.busy for w in rows[CHAT_PHASE]) or attempt == RETRIES:
                break
            print(f"  (other processes busy during {CHAT_PHASE}: measured again)", flush=True)
            wait_quiet(60)
        print(f"  {CHAT_PHASE:30s} {describe(median_window(rows[CHAT_PHASE]))}", flush=True)
        ended = Load()
        await asyncio.gather(*(api.end(c, ended, e) for c, e in zip(conns, episodes, strict=True)))
        for conn in conns:
            conn.close()
        if ended.errors:
            print(f"    ! ending the chat episodes failed: {ended.first_errors}", flush=True)

    single: dict[str, float] = {}
    paced_rows: dict[str, tuple[Window, float]] = {}
    rate = 0.0
    if profile is None:
        closed("GET /health", n, repeat_client(health_raw, "health"), "health")
    run_async(chat_phase())
    if profile is None:
        closed("episode API: begin + end", n, episode_api_client(api), None)
        closed("agent episodes: chat calls", n, agent_client(api), "chat")

        async def alone() -> None:
            """One client alone: the unloaded latency of each path."""
            conn = Conn("127.0.0.1", proc.port)
            [episode] = await begin_episodes(api, [conn])
            for name, raw in (("health", health_raw), ("chat", api.chat_raw(episode, chat_body(16)))):
                latencies = []
                for i in range(plan.single_requests + 20):
                    t0 = now()
                    status, body = await conn.send(raw)
                    if status != 200:
                        raise SystemExit(f"single-client {name} failed: HTTP {status} {body[:200]!r}")
                    if i >= 20:
                        latencies.append((now() - t0) * 1000)
                single[name] = statistics.median(latencies)
            await api.end(conn, Load(), episode)
            conn.close()

        run_async(alone())
        print(
            f"  1 client alone: p50 GET /health {single['health']:.2f} ms, chat {single['chat']:.2f} ms",
            flush=True,
        )
        rate = 0.5 * median_window(rows[CHAT_PHASE]).rps

        async def paced_phase() -> None:
            """n connections, paced below saturation (half the chat capacity measured above)."""
            conns = [Conn("127.0.0.1", proc.port) for _ in range(n)]
            episodes = await begin_episodes(api, conns)
            for conn in conns:
                conn.close()
            chat_raws = [api.chat_raw(e, chat_body(16)) for e in episodes]
            for name, raw in (("health", lambda i: health_raw), ("chat", lambda i: chat_raws[i])):
                for attempt in range(RETRIES + 1):
                    paced_rows[name] = await paced(proc, n, rate, plan.paced_s, raw, name)
                    if not paced_rows[name][0].busy or attempt == RETRIES:
                        break
                    print(f"  (other processes busy during paced {name}: measured again)", flush=True)
                    wait_quiet(60)
            conn = Conn("127.0.0.1", proc.port)
            for episode in episodes:
                await api.end(conn, Load(), episode)
            conn.close()

        run_async(paced_phase())
        for name, (w, late) in paced_rows.items():
            print(
                f"  paced, {n} connections @ {rate:.0f} req/s, {name:6s}: {fmt(w.rps, 0)} req/s done, "
                f"p50 {fmt(w.pct(50), 2)} ms, p99 {fmt(w.pct(99), 2)} ms, {late:.1%} sent late, server "
                f"{w.server_cpu:.2f} cores, other processes {w.foreign_cpu:.2f}",
                flush=True,
            )
    stop(proc)
    return {"rows": rows, "single": single, "paced": paced_rows, "rate": rate}


def breakdown(model_dir: Path, secret: str) -> list[tuple[str, float]]:
    """CPU microseconds per call of the pieces of a chat request, in this process, no HTTP (with the zero
    engine). CPU time, not wall time: other load on the machine barely moves it."""
    import fastapi.encoders
    from zero_engine import ZeroEngine

    from ajet_hpc.config import ServingConfig
    from ajet_hpc.server import protocol as p
    from ajet_hpc.server.app import ServerContext
    from ajet_hpc.server.auth import authorize_episode_call, issue_episode_token
    from ajet_hpc.tracking.context import ContextTracker

    engine = ZeroEngine(model_dir, MAX_MODEL_LEN)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    ctx = ServerContext(
        name=MODEL,
        engine=engine,
        settings=ServingConfig(max_model_len=MAX_MODEL_LEN, max_tokens=256),
        secret=secret,
    )
    tokenizer = engine.tokenizer
    episode = ctx.episodes.begin("bench", None, {})
    header = f"Bearer {issue_episode_token(secret, episode.episode_id, MODEL, 3600)}"
    raw = json.dumps(chat_body(16)).encode()
    request = p.ChatCompletionRequest.model_validate_json(raw)
    messages = [message.for_template() for message in request.messages]
    plan = episode.tracker.build_prompt(messages)
    response = loop.run_until_complete(ctx.service.chat(request, episode))
    [answer] = loop.run_until_complete(ctx.service.generate_all(plan, request, "x"))

    async def noop() -> None:
        pass

    agent = [{"role": "system", "content": "You are a travel agent."}, {"role": "user", "content": "Plan."}]
    agent_tracker = ContextTracker(tokenizer)
    reply = {"role": "assistant", "content": "Done."}
    agent_tracker.record(agent_tracker.build_prompt(agent), [8, 9], [-0.5, -0.5], reply, "stop", 0)
    agent3 = [*agent, reply, {"role": "user", "content": "Next?"}]
    agent_tracker.build_prompt(agent3)
    long_text = ("The quick brown fox jumps over the lazy dog. " * 45)[:2000]  # 2,000 tokens (1 per char)
    long_messages = [{"role": "user", "content": long_text}]
    long_plan = episode.tracker.build_prompt(long_messages)

    def end_one() -> None:
        ctx.episodes.end(ctx.episodes.begin("bench", None, {}).episode_id, 1.0, None, None, {})

    ops: list[tuple[str, Callable[[], object]]] = [
        (
            "auth: verify the episode token (HMAC, JSON)",
            lambda: authorize_episode_call(secret, header, None, MODEL),
        ),
        (
            "request body: json + pydantic validation",
            lambda: p.ChatCompletionRequest.model_validate_json(raw),
        ),
        (
            "chat template alone (apply_chat_template)",
            lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        ),
        ("tracker.build_prompt, 1 turn, warm episode", lambda: episode.tracker.build_prompt(messages)),
        (
            "tracker.build_prompt, 1 turn, new episode",
            lambda: ContextTracker(tokenizer).build_prompt(messages),
        ),
        ("tracker.build_prompt, turn 2 (1 answer spliced)", lambda: agent_tracker.build_prompt(agent3)),
        (
            "tracker.build_prompt, 1 turn of 2,000 tokens, warm",
            lambda: episode.tracker.build_prompt(long_messages),
        ),
        (
            "tracker.record (timeline copy)",
            lambda: (
                ContextTracker.record(episode.tracker, plan, [8, 9, 4], [-0.5] * 3, reply, "stop", 0)
                and episode.tracker._timelines.pop()
            ),
        ),
        (
            "tracker.record, 2,000-token prompt",
            lambda: (
                ContextTracker.record(episode.tracker, long_plan, [8, 9, 4], [-0.5] * 3, reply, "stop", 0)
                and episode.tracker._timelines.pop()
            ),
        ),
        ("loop.run_until_complete(no-op) (in the rows below)", lambda: loop.run_until_complete(noop())),
        ("asyncio.to_thread round trip (no-op)", lambda: loop.run_until_complete(asyncio.to_thread(int))),
        (
            "Service.generate_all (zero engine; task, gather)",
            lambda: loop.run_until_complete(ctx.service.generate_all(plan, request, "x")),
        ),
        ("Service.finish (decode the answer text)", lambda: ctx.service.finish(answer, [], False)),
        (
            "ChatCompletionResponse(...) (2 uuid4 inside)",
            lambda: p.ChatCompletionResponse(
                model=MODEL, choices=response.choices, usage=response.usage, policy_version=0
            ),
        ),
        (
            "Service.chat, whole (to_thread included)",
            lambda: (
                loop.run_until_complete(ctx.service.chat(request, episode))
                and episode.tracker._timelines.pop()
            ),
        ),
        (
            "response: jsonable_encoder + json.dumps (FastAPI, no response_model)",
            lambda: json.dumps(fastapi.encoders.jsonable_encoder(response)),
        ),
        ("response: model_dump_json()", lambda: response.model_dump_json()),
        ("episode begin + end, registry only (ContextTracker)", end_one),
        ("issue an episode token", lambda: issue_episode_token(secret, episode.episode_id, MODEL, 3600)),
    ]
    out = []
    for name, op in ops:
        for _ in range(50):
            op()
        count, spent, t0 = 0, 0.0, time.process_time()
        while spent < 0.3:
            for _ in range(50):
                op()
            count += 50
            spent = time.process_time() - t0
        out.append((name, spent / count * 1e6))
    loop.close()
    return out


def median_window(windows: list[Window]) -> Window:
    """The window of median throughput among those the machine was quiet during (all, if none was);
    latencies are that window's own."""
    windows = [w for w in windows if not w.busy] or windows
    return sorted(windows, key=lambda w: w.rps)[len(windows) // 2]


def print_breakdown(rows: list[tuple[str, float]]) -> None:
    print("\n== CPU cost of the pieces of a chat call (in-process, zero engine, CPU us per call) ==")
    print(table(["piece", "CPU us/call"], [[name, fmt(us, 1)] for name, us in rows]))


def foreign_load(seconds: float = 2.0) -> float:
    """Cores the machine spends busy over ``seconds``, apart from this process (nothing else of ours runs)."""
    busy, mine = busy_cpu_seconds(), time.process_time()
    time.sleep(seconds)
    return max(0.0, (busy_cpu_seconds() - busy) - (time.process_time() - mine)) / seconds


def wait_quiet(limit_s: float, threshold: float = 0.25) -> float:
    """Wait (at most ``limit_s``) until other processes use under ``threshold`` cores; returns their load."""
    deadline = time.monotonic() + limit_s
    load = foreign_load()
    while load >= threshold and time.monotonic() < deadline:
        print(f"  machine busy with other processes ({load:.2f} cores); waiting", flush=True)
        time.sleep(10)
        load = foreign_load()
    return load


def print_profile(path: Path, top: int = 30) -> None:
    import pstats

    print(
        f"\n== server profile (cProfile, wall clock: skewed when other processes run; chat phase; {path}) =="
    )
    stats = pstats.Stats(str(path))
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)


# ============================================================================== main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a shortened run (smoke check, < 2 minutes)")
    parser.add_argument("--skip-vllm", action="store_true", help="only the zero-engine overhead benchmark")
    parser.add_argument("--skip-zero", action="store_true", help="only the comparison with vllm serve")
    parser.add_argument(
        "--profile", action="store_true", help="CPU breakdown + the server under cProfile (chat phase only)"
    )
    parser.add_argument("--workdir", type=Path, help="model and server logs here (default: a temp dir)")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for other processes to leave the CPUs idle",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: even where inherited ignored
        signal.signal(signum, _on_signal)
    atexit.register(stop_all)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ajet-bench-proxy-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        from ajet_hpc.engine.model_path import resolve_model

        model_dir = resolve_model("builtin:tiny", workdir)
        secret = secrets.token_hex(32)
        print(
            f"ajet_hpc proxy benchmark ({'quick' if args.quick else 'full'}), "
            f"{time.strftime('%Y-%m-%d %H:%M')}, "
            f"{os.cpu_count()} CPUs, model {model_dir}\nload: one client process (this one): uvloop and a "
            "minimal keep-alive HTTP/1.1 client, one connection per simulated client. It shares the CPUs "
            "with the server: every figure is a floor.",
            flush=True,
        )
        load = wait_quiet(args.wait_quiet) if args.wait_quiet else foreign_load()
        warning = "  (WARNING: the machine is not idle; figures will be low)" if load >= 0.25 else ""
        print(f"other processes on the machine: {load:.2f} cores busy before the start{warning}", flush=True)
        if args.profile:
            print_breakdown(breakdown(model_dir, secret))
            prof = workdir / "server.prof"
            bench_zero(plan, model_dir, workdir, secret, profile=prof)
            print_profile(prof)
            return 0
        llm = None if args.skip_vllm else bench_vllm(plan, model_dir, workdir, secret)
        zero = None if args.skip_zero else bench_zero(plan, model_dir, workdir, secret)
        report(plan, llm, zero, time.monotonic() - started)
        return 0
    finally:
        stop_all()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def report(plan: Plan, llm: dict | None, zero: dict | None, elapsed: float) -> None:
    ratio = overhead = added = float("nan")
    print("\n" + "=" * 100)
    if llm is not None:
        ratio = llm["ratio"]
        print(
            f"1. proxy vs vllm serve: {plan.llm_clients} closed-loop clients, greedy chat, max_tokens "
            f"{LLM_MAX_TOKENS}; {plan.llm_rounds} legs of {plan.llm_window_s:g} s per side (alternating, "
            f"{plan.llm_warmup_s:g} s warm-up each), medians. Ours: episodes of {plan.calls_per_episode} "
            "chat calls, begin/end inside the window."
        )
        print(
            table(
                [
                    "side",
                    "completion tok/s",
                    "chat req/s",
                    "tokens/req",
                    "p50 ms",
                    "server cores",
                    "API proc cores",
                    "API CPU ms/req",
                    "other procs",
                ],
                [
                    [
                        name,
                        fmt(llm[key]["tps"], 0),
                        fmt(llm[key]["rps"]),
                        fmt(llm[key]["tokens_per_request"]),
                        fmt(llm[key]["p50"], 0),
                        fmt(llm[key]["cpu"], 2),
                        fmt(llm[key]["api_cpu"], 2),
                        fmt(llm[key]["api_ms"], 2),
                        fmt(llm[key]["foreign"], 2),
                    ]
                    for name, key in (
                        ("ours (VllmEngine)", "ours"),
                        ("vllm serve", "vllm"),
                        ("vllm serve, logprobs", "vllm+lp"),
                    )
                ],
            )
        )
        paired = ", ".join(f"{r:.3f}" for r in llm["paired"])
        print(
            f"ours/vLLM completion tokens/s, median of the {len(llm['paired'])} leg pairs = {ratio:.3f} "
            f"({'meets' if ratio >= 1.0 else 'MISSES'} the 1.0 target; ratio of the medians "
            f"{llm['ratio_of_medians']:.3f}); per leg pair: {paired}; the idle server used <= "
            f"{llm['idle_cpu']:.3f} cores during "
            f"the other's legs; {llm['failed']} failed requests; {llm['busy_legs']} legs with other "
            f"processes busy (>= {BUSY_CORES} cores) even after retries"
        )
        print(
            "ours / vllm serve asked for logprobs too (our server always has vLLM compute them): "
            f"{llm['ratio_lp']:.3f}"
        )
    if zero is not None:
        rows, single, paced_rows = zero["rows"], zero["single"], zero["paced"]
        print(
            f"\n2. proxy overhead, zero-latency engine, {plan.zero_clients} closed-loop clients, "
            f"{plan.zero_windows} x {plan.zero_window_s:g} s windows (the median one)"
        )
        body = []
        for name, windows in rows.items():
            w = median_window(windows)
            body.append(
                [
                    name,
                    fmt(w.rps, 0),
                    fmt(w.pct(50)),
                    fmt(w.pct(90)),
                    fmt(w.pct(99)),
                    f"{w.server_cpu:.2f}",
                    fmt(w.cpu_ms, 3),
                    f"{w.client_cpu:.2f}",
                    f"{w.foreign_cpu:.2f}",
                    str(sum(x.failed for x in windows)),
                ]
            )
        headers = ["phase", "req/s", "p50 ms", "p90 ms", "p99 ms", "server cores", "server CPU ms/req"]
        print(table([*headers, "client cores", "other procs", "failed"], body))
        chat = median_window(rows[CHAT_PHASE])
        overhead = chat.rps
        if "GET /health" in rows:
            health = median_window(rows["GET /health"])
            print(
                f"  server CPU per request: chat {chat.cpu_ms:.3f} ms, GET /health {health.cpu_ms:.3f} ms: "
                f"a chat call costs {chat.cpu_ms - health.cpu_ms:.3f} ms more"
            )
            print(
                f"  p50 chat - p50 /health, both saturated by {plan.zero_clients} closed-loop clients: "
                f"{chat.pct(50) - health.pct(50):.1f} ms (queueing: at saturation a request waits for "
                "~clients x time per request, so this is ~clients x the extra cost)"
            )
        if single:
            print(
                f"  p50 chat - p50 /health, 1 client alone: {single['chat'] - single['health']:.2f} ms "
                f"({single['chat']:.2f} - {single['health']:.2f})"
            )
        if paced_rows:
            (wh, late_h), (wc, late_c) = paced_rows["health"], paced_rows["chat"]
            added = wc.pct(50) - wh.pct(50)
            print(
                f"  p50 chat - p50 /health, {plan.zero_clients} connections paced at "
                f"{zero['rate']:.0f} req/s (half the chat capacity): {added:.2f} ms "
                f"({wc.pct(50):.2f} - {wh.pct(50):.2f}; late sends "
                f"{late_c:.1%} / {late_h:.1%})  <- p50_added_ms"
            )
        print(
            f"  targets: >= 1000 chat req/s at {plan.zero_clients} clients: "
            f"{'meets' if overhead >= 1000 else 'MISSES'}; <= 2 ms added p50: "
            f"{'meets' if added <= 2 else 'MISSES'}"
        )
    print(f"\nelapsed {elapsed:.0f} s")
    print(
        f"RESULT proxy_vs_vllm={ratio:.3f} overhead_rps={overhead:.0f} p50_added_ms={added:.2f}", flush=True
    )


if __name__ == "__main__":
    sys.exit(main())
