"""The load generator of the proxy benchmark: a minimal keep-alive HTTP/1.1 client on uvloop, closed-loop
and paced clients, measured windows (server, client and other processes' CPU), and the workloads (our
episodes and chat calls, plain chat calls to ``vllm serve``)."""

from __future__ import annotations

import asyncio
import json
import sys
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

from proxy_procs import MODEL, Proc  # noqa: E402

PROMPT = "Write one short line about the weather today."
LLM_MAX_TOKENS = 32
BUSY_CORES = 0.25  # other processes above this many cores during a window: it is measured again
now = time.perf_counter


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
        assert reader is not None and writer is not None  # opened together, closed together
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

    def __init__(self, port: int, secret: str, url: str | None = None) -> None:
        """``url``: where the server says it is (its rendezvous), if not 127.0.0.1 (the challenge names
        it)."""
        from ajet_hpc.client.handshake import fetch_run_token

        self.port, self.secret = port, fetch_run_token(url or f"http://127.0.0.1:{port}", secret)
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


def run_async(coroutine):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)


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
