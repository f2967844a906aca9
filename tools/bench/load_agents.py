"""Load on loopback: many concurrent agents against one real server on the built-in tiny model.

``python tools/bench/load_agents.py --agents 500 --seconds 60 [--engine vllm|transformers] [--turns 2]``

The server is the real one (``python -m ajet_hpc.server RUN``, in its own process group, its episode store
``RUN/data/policy.h5`` attached), started on a run that ``python -m ajet_hpc.launch --no-submit`` wrote:
one server, no trainer, no clients. The agents are asyncio tasks in this process, each a loop of
episodes: begin (run secret) -> ``--turns`` chat calls with the real ``openai`` client (``AsyncOpenAI``, one
shared httpx client; each turn sends the conversation so far) -> end with a reward. At ``--seconds`` no
agent begins another episode; open ones finish. Then the server is stopped (SIGTERM) and its store read.

Correctness (the exit code): no answer >= 500 and no transport error; every episode whose end was answered
200 is in the store exactly once, and nothing else is. Figures: p50/p99 latency of the chat calls (and of
begin/end), episodes/s over the window. Ends with one line:
``RESULT agents=<n> episodes_per_s=<x> chat_p50_ms=<ms> chat_p99_ms=<ms> errors_5xx=<n> transport_errors=<n>
lost=<n> dup=<n>``.

The load generator shares the machine's cores with the server, so every rate is a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
import openai
import yaml
from openai.types.chat import ChatCompletionAssistantMessageParam, ChatCompletionMessageParam

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from proxy_procs import server_env  # noqa: E402  (the same environment as the proxy benchmark's servers)

from ajet_hpc.client.handshake import fetch_run_token  # noqa: E402
from ajet_hpc.storage import rendezvous  # noqa: E402
from ajet_hpc.storage.episode_store_reader import EpisodeReader  # noqa: E402
from ajet_hpc.storage.rundir import RunDir  # noqa: E402

MODEL = "policy"
now = time.perf_counter


# ------------------------------------------------------------------------------------------- credentials
def run_auth(url: str, secret: str) -> dict[str, str]:
    """How the episode API's caller (holder of the run secret) proves who it is, as headers for httpx: a
    run token from the server's challenge (``ajet_hpc.client.handshake``); the secret itself is never sent."""
    return {"Authorization": f"Bearer {fetch_run_token(url, secret)}"}


# ------------------------------------------------------------------------------------------ the run
def write_run(workdir: Path, engine: str, max_tokens: int) -> Path:
    run = workdir / "run"
    topology = {
        "run": {"name": "load", "dir": str(run)},
        "cluster": {"backend": "local"},
        "servers": [
            {
                "name": MODEL,
                "model": "builtin:tiny",
                "engine": engine,
                "trainer": None,
                "partition": "gpu",
                "gpus_per_node": 0,
                "cpus": 1,
                "mem": "2G",
                "time": "10:00",
                "serving": {"max_model_len": 1024, "max_tokens": max_tokens},
            }
        ],
        "clients": [],
    }
    return prepare_run(workdir, topology)


def prepare_run(workdir: Path, topology: dict) -> Path:
    """The run directory of ``topology`` (its ``run.dir``), written by ``python -m ajet_hpc.launch
    --no-submit`` as a user's launch writes it."""
    run = Path(topology["run"]["dir"])
    path = workdir / "topology-in.yaml"
    path.write_text(yaml.safe_dump(topology, sort_keys=False))
    done = subprocess.run(
        [sys.executable, "-m", "ajet_hpc.launch", str(path), "--no-submit"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=server_env(),
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"launch --no-submit failed:\n{done.stdout}\n{done.stderr}")
    return run


@dataclass
class Server:
    popen: subprocess.Popen
    log: Path
    url: str = ""

    def tail(self, lines: int = 25) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


def start_server(run: Path, timeout_s: float = 300, command: list[str] | None = None) -> Server:
    """``python -m ajet_hpc.server RUN`` (or ``command``), once it published its rendezvous."""
    log = run.parent / "server.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            command or [sys.executable, "-m", "ajet_hpc.server", str(run)],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=server_env(),
            start_new_session=True,
        )
    server = Server(popen, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise SystemExit(f"the server exited with code {popen.returncode}:\n{server.tail()}")
        found = rendezvous.read(RunDir.at(run).rendezvous_file(MODEL))
        if found is not None:
            server.url = found.url
            return server
        time.sleep(0.25)
    stop_server(server)
    raise SystemExit(f"the server did not publish its rendezvous within {timeout_s:.0f} s:\n{server.tail()}")


def stop_server(server: Server, grace_s: float = 60) -> int:
    """SIGTERM to the server's process group (it flushes its store), SIGKILL after ``grace_s``."""
    if server.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.popen.pid, signal.SIGTERM)
        try:
            server.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.popen.pid, signal.SIGKILL)
            server.popen.wait(10)
    with contextlib.suppress(ProcessLookupError):  # engine processes left behind, if any
        os.killpg(server.popen.pid, signal.SIGKILL)
    return server.popen.returncode


# ------------------------------------------------------------------------------------------ the agents
@dataclass
class Tally:
    chat_ms: list[float] = field(default_factory=list)
    begin_ms: list[float] = field(default_factory=list)
    end_ms: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)  # (call, status) -> count; status "error: <type>"
    errors: list[str] = field(default_factory=list)  # the first few failures, for the report
    ended: list[str] = field(default_factory=list)  # episodes whose end was answered 200
    begun: int = 0

    started: float = field(default_factory=now)

    def note(self, call: str, status: int | str, detail: str = "") -> None:
        self.statuses[call, status] += 1
        failed = not isinstance(status, int) or status >= 400
        if failed and len(self.errors) < 20:
            self.errors.append(f"{call} at {now() - self.started:.1f} s: {status} {detail[:300]}")

    @property
    def server_errors(self) -> int:
        """Answers >= 500."""
        return sum(n for (_, status), n in self.statuses.items() if isinstance(status, int) and status >= 500)

    @property
    def transport_errors(self) -> int:
        """Calls that got no HTTP answer (connection reset or closed, timeout)."""
        return sum(n for (_, status), n in self.statuses.items() if not isinstance(status, int))

    @property
    def client_errors(self) -> int:
        return sum(
            n for (_, status), n in self.statuses.items() if isinstance(status, int) and 400 <= status < 500
        )


async def agent(
    index: int,
    http: httpx.AsyncClient,
    llm: openai.AsyncOpenAI,
    auth: dict[str, str],
    stop_at: float,
    turns: int,
    tally: Tally,
) -> None:
    episode = 0
    while now() < stop_at:
        episode += 1
        started = now()
        try:
            reply = await http.post(
                "/v1/episodes", json={"task_id": f"a{index}-{episode}", "group": "load"}, headers=auth
            )
        except httpx.HTTPError as exc:
            tally.note("begin", f"error: {type(exc).__name__}", str(exc))
            continue
        tally.note("begin", reply.status_code, reply.text if reply.status_code != 200 else "")
        if reply.status_code != 200:
            continue
        tally.begin_ms.append((now() - started) * 1e3)
        tally.begun += 1
        begun = reply.json()
        chat = llm.with_options(base_url=begun["base_url"], api_key=begun["api_key"])
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": f"agent {index}, episode {episode}: count to three"}
        ]
        for turn in range(turns):
            started = now()
            try:
                completion = await chat.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=8, temperature=1.0
                )
            except openai.APIStatusError as exc:
                tally.note("chat", exc.status_code, str(exc))
                break
            except openai.APIError as exc:
                tally.note("chat", f"error: {type(exc).__name__}", str(exc))
                break
            tally.note("chat", 200)
            tally.chat_ms.append((now() - started) * 1e3)
            # the reply as the next request's assistant message (the fields of both are OpenAI's)
            reply_message = completion.choices[0].message.model_dump(exclude_none=True)
            messages.append(cast(ChatCompletionAssistantMessageParam, reply_message))
            messages.append({"role": "user", "content": f"and now turn {turn + 2}"})
        started = now()
        reward = (index + episode) % 5 / 4
        try:
            reply = await http.post(
                f"/v1/episodes/{begun['episode_id']}/end", json={"reward": reward}, headers=auth
            )
        except httpx.HTTPError as exc:
            tally.note("end", f"error: {type(exc).__name__}", str(exc))
            continue
        tally.note("end", reply.status_code, reply.text if reply.status_code != 200 else "")
        if reply.status_code == 200:
            tally.end_ms.append((now() - started) * 1e3)
            tally.ended.append(begun["episode_id"])


async def drive(url: str, secret: str, agents: int, seconds: float, turns: int) -> tuple[Tally, float]:
    """Run the agents; returns the tally and the window: from the start to the last episode's end."""
    auth = run_auth(url, secret)
    # An idle keep-alive connection is dropped here after 2 s, before uvicorn drops it (after 5 s): with the
    # same 5 s on both sides (httpx's default), a request sent just as the server closes the connection
    # fails with a ReadError, a race of HTTP/1.1 keep-alive, not a server fault (docs/reliability.md, Load).
    limits = httpx.Limits(
        max_connections=agents + 16, max_keepalive_connections=agents + 16, keepalive_expiry=2.0
    )
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as http:
        # openai's annotations type http_client as httpx2.AsyncClient; it takes httpx's too (at runtime:
        # is_legacy_httpx_async_client)
        llm = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", http_client=http, max_retries=0)  # type: ignore[arg-type]
        started = tally.started = now()
        stop_at = started + seconds
        await asyncio.gather(*(agent(i, http, llm, auth, stop_at, turns, tally) for i in range(agents)))
        window = now() - started
    return tally, window


# ------------------------------------------------------------------------------------------ the check
@dataclass
class Report:
    agents: int
    seconds: float
    window_s: float
    tally: Tally
    stored: Counter  # episode id -> times in the store
    server_exit: int

    @property
    def lost(self) -> list[str]:
        return [e for e in self.tally.ended if self.stored[e] == 0]

    @property
    def duplicated(self) -> list[str]:
        return [e for e, n in self.stored.items() if n > 1]

    @property
    def unexpected(self) -> list[str]:
        """Stored, though no end of it was answered 200."""
        ended = set(self.tally.ended)
        return [e for e in self.stored if e not in ended]

    @property
    def episodes_per_s(self) -> float:
        return len(self.tally.ended) / self.window_s if self.window_s else 0.0

    def ok(self) -> bool:
        tally = self.tally
        return not (
            tally.server_errors
            or tally.transport_errors
            or tally.client_errors
            or self.lost
            or self.duplicated
            or self.unexpected
            or self.server_exit
        )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def run(
    agents: int, seconds: float, engine: str = "transformers", turns: int = 2, workdir: Path | None = None
) -> Report:
    """The whole measurement in ``workdir`` (a temporary folder by default)."""
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="load-agents-")))
        workdir.mkdir(parents=True, exist_ok=True)
        run_dir = write_run(workdir, engine, max_tokens=16)
        server = start_server(run_dir)
        try:
            secret = RunDir.at(run_dir).read_secret()
            tally, window = asyncio.run(drive(server.url, secret, agents, seconds, turns))
        finally:
            code = stop_server(server)
        with EpisodeReader(run_dir / "data" / f"{MODEL}.h5") as reader:
            stored = Counter(summary["episode_id"] for summary in reader.summaries())
        if tally.server_errors or tally.transport_errors:
            print(f"--- last lines of {server.log}:\n{server.tail()}")
        return Report(agents, seconds, window, tally, stored, code)


def show(report: Report) -> None:
    tally, extra = report.tally, report.window_s - report.seconds
    print(
        f"{report.agents} agents, {report.seconds:.0f} s (+ {extra:.1f} s for open episodes to end): "
        f"{tally.begun} episodes begun, {len(tally.ended)} ended"
    )
    print(f"  episodes/s (ended / window)     {report.episodes_per_s:8.1f}")
    print(f"  chat calls/s                    {len(tally.chat_ms) / report.window_s:8.1f}")
    for name, values in (("chat", tally.chat_ms), ("begin", tally.begin_ms), ("end", tally.end_ms)):
        print(
            f"  {name:5} latency  p50 {percentile(values, 50):8.1f} ms   "
            f"p99 {percentile(values, 99):8.1f} ms   "
            f"max {max(values, default=float('nan')):8.1f} ms   ({len(values)} calls)"
        )
    print(f"  statuses: {dict(sorted(tally.statuses.items(), key=str))}")
    print(
        f"  store: {sum(report.stored.values())} records, {len(report.stored)} episodes; "
        f"lost {len(report.lost)}, "
        f"duplicated {len(report.duplicated)}, stored without an accepted end {len(report.unexpected)}; "
        f"server exit code {report.server_exit}"
    )
    for line in tally.errors:
        print(f"  ! {line}")
    print(
        f"RESULT agents={report.agents} episodes_per_s={report.episodes_per_s:.1f} "
        f"chat_p50_ms={percentile(tally.chat_ms, 50):.1f} chat_p99_ms={percentile(tally.chat_ms, 99):.1f} "
        f"errors_5xx={tally.server_errors} transport_errors={tally.transport_errors} "
        f"lost={len(report.lost)} dup={len(report.duplicated)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, default=500, help="concurrent agents (default 500)")
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="how long agents begin episodes (default 60)"
    )
    parser.add_argument("--turns", type=int, default=2, help="chat calls per episode (default 2)")
    parser.add_argument("--engine", choices=["vllm", "transformers"], default="vllm")
    parser.add_argument("--workdir", type=Path, help="keep the run (store, server log) here")
    args = parser.parse_args(argv)
    report = run(args.agents, args.seconds, args.engine, args.turns, args.workdir)
    show(report)
    return 0 if report.ok() else 1


if __name__ == "__main__":
    raise SystemExit(main())
