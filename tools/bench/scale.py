#!/usr/bin/env python
"""What thousands of open episodes cost one server, and what one client task costs shared storage and Slurm.

    .venv/bin/python tools/bench/scale.py            # 256, 1,024 and 4,096 open episodes (~6 min)
    .venv/bin/python tools/bench/scale.py --smoke    # 16 and 48 open episodes, short windows (~1 min)
    --levels 256,1024,4096   open episodes at which the server is measured (ascending)
    --in-flight 64           episodes in flight per client array task
    --away-after-s 60 --away-window-s 60   the away measurement: from when, for how long
    --workdir DIR            keep the run there (default: a temporary folder, removed)

**The run.** ``python -m ajet_hpc.launch --no-submit`` writes a run as a user's launch would: one server
(built-in tiny model's tokenizer, a trainer of 1 rank, ``max_staleness`` 100) and one client group
(``scale_agent:hold``, ``in_flight`` episodes per array task; each task's shard is ``2 x in_flight /
repeats`` tasks of ``repeats`` episodes). The server is the real server process with a zero-cost engine
and no-op trainer ranks (``scale_server.py``: everything else, auth, recorder and store, collector,
coordinator and its file protocol, is the real code). The client tasks are the real runner: task 0 as its
own process (``python -m ajet_hpc.client``, the measured task, under ``strace``), the others many to a
process (``scale_clients.py``). Their first ``in_flight`` episodes make one chat call, then stay open until
the harness releases them.

**At each level** the harness starts the client tasks that bring the server's open episodes (``/v1/status``)
to that number, waits until the client processes are idle, reads the server's resident memory and open
sockets, then runs a probe: 64 closed-loop episodes of 4 chat calls (``proxy_load``'s lean HTTP client
on uvloop, so that the probe is not the bottleneck) for a warm-up second and a window: chat requests per
second, their p50/p99 latency, and the server's CPU per chat call (its begins and ends included). The
engine answers instantly, so the latency is what the server (and the probe's own client) adds. Memory per
open episode is the growth of the server's resident memory from the lowest level to the highest, less what
the probes in between added (the probe's episodes stay in the collector), over the episodes opened in
between: an upper bound, it includes each episode's messages.

**Release.** SIGUSR1 lets every held episode end (second chat call, end, client store commit); each task
then runs its second ``in_flight`` episodes straight through. Measured: client store commits per second
from the release until the last task ended, then the training steps that consume the episodes: the
coordinator's seconds per step (``coordinator_s`` of ``metrics.jsonl``).

**The measured client task.** ``strace -f`` records its path calls, fsyncs and commands
(``scale_trace.py``). Healthy: its metadata operations on the run directory per minute from when every
level was open until the release (while its server answers and its episodes wait). Its fsyncs per
committed episode from the release until it ended (its episodes ending: group commits, then its close),
and per minute while its episodes wait (the writer lease's heartbeat). Away: the server is killed
(SIGKILL; its rendezvous file stays, as after a node failure), a fresh task of the group starts under
strace and waits for it; its metadata operations per minute from ``--away-after-s`` on, for
``--away-window-s`` (the bound is for waits past their first minute; the first minute is reported
apart). Slurm commands: those both traced tasks ran.

Ends with one line::

    RESULT open_episodes=<n> chat_rps_<level>=<x>... p50_ms_<level>=<ms>... p99_ms_<level>=<ms>...
           api_ratio_<top>_vs_<bottom>=<x> mem_per_open_episode_kb=<kb> server_sockets_<top>=<n>
           store_commits_per_s=<x> coordinator_s_per_step=<s> metaops_per_task_min_healthy=<n>
           metaops_per_task_min_away=<n> metaops_per_task_first_min_away=<n>
           fsyncs_per_episode_client=<x> fsyncs_per_task_min_idle=<n> slurm_cmds_per_task=<n>

Everything runs on this machine, so the clients take CPU from the server: the rates are floors.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for folder in (REPO, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import scale_trace  # noqa: E402
from load_agents import prepare_run, run_auth, start_server, stop_server  # noqa: E402
from proxy_load import Conn, Load, OurApi, closed_loop, now, ours_llm_client, request_bytes, run_async  # noqa: E402
from proxy_procs import Proc, server_env  # noqa: E402
from scale_server import GC_STATS_ENV  # noqa: E402

from ajet_hpc.storage.client_store import read_results  # noqa: E402
from ajet_hpc.storage.rundir import RunDir  # noqa: E402
from ajet_hpc.trainer.coordinator import metrics  # noqa: E402
from ajet_hpc.trainer.protocol.work_dir import WorkDir  # noqa: E402

MODEL, GROUP, REPEATS = "policy", "swarm", 8
TASKS_PER_PROCESS = 16
PROBE_CLIENTS = 64
ROUNDS = 2
"""Episodes per task: ROUNDS x in_flight. The first in_flight are held; after the release the rest run at
once, so that the measured task commits under load."""


@dataclass
class Plan:
    levels: list[int]
    in_flight: int
    probe_s: float
    away_after_s: float
    away_window_s: float
    profile_dir: Path | None = None  # py-spy records of the server during each probe
    serving: dict[str, float] = field(default_factory=dict)  # the server's serving settings to change
    settle_s: float = 0.0  # a pause before each level's measurement

    @property
    def tasks(self) -> int:
        """Array tasks: those that hold the top level's episodes, and one more for the away measurement."""
        return self.levels[-1] // self.in_flight + 1

    @property
    def away_index(self) -> int:
        return self.tasks - 1

    @property
    def tasks_per_batch(self) -> int:
        """Tasks per step: the held episodes make (about) 8 steps."""
        return max(1, self.levels[-1] // REPEATS // 8)


@dataclass
class Level:
    open: int
    rss_kb: int
    sockets: int
    chat_rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    cpu_ms: float = 0.0  # the server's CPU per chat call during the probe (begin and end included)
    probe_rss_kb: int = 0  # what the probe added to the server's resident memory
    errors: int = 0
    gc_share: float = 0.0  # the share of the probe's time the server spent in its garbage collector
    full_gcs: int = 0  # full (generation 2) collections during the probe


@dataclass
class Report:
    levels: list[Level] = field(default_factory=list)
    commits_per_s: float = 0.0
    coordinator_s: float = float("nan")
    steps: int = 0
    dropped_groups: int = 0
    retried: int = 0  # episode attempts the clients ran again after a failed call (their logs)
    listen_overflows: int = 0  # handshakes the host's listen queues dropped during the run (all sockets)
    healthy: scale_trace.Counts = field(default_factory=scale_trace.Counts)
    healthy_min: float = 0.0
    busy: scale_trace.Counts = field(default_factory=scale_trace.Counts)  # task 0 from the release on
    whole: scale_trace.Counts = field(default_factory=scale_trace.Counts)
    committed_0: int = 0
    away: scale_trace.Counts = field(default_factory=scale_trace.Counts)
    away_first: scale_trace.Counts = field(default_factory=scale_trace.Counts)
    away_min: float = 0.0
    away_all: scale_trace.Counts = field(default_factory=scale_trace.Counts)


# ------------------------------------------------------------------------------------------ the run
def write_run(workdir: Path, plan: Plan) -> Path:
    tasks_per_index = ROUNDS * plan.in_flight // REPEATS
    topology = {
        "run": {"name": "scale", "dir": str(workdir / "run")},
        "cluster": {"backend": "local"},
        "servers": [
            {
                "name": MODEL,
                "model": "builtin:tiny",
                "engine": "transformers",
                "partition": "gpu",
                "gpus_per_node": 0,
                "cpus": 1,
                "mem": "4G",
                "time": "1:00:00",
                "serving": {"max_model_len": 1024, "max_tokens": 64, **plan.serving},
                "trainer": {
                    "ranks": 1,
                    "tasks_per_batch": plan.tasks_per_batch,
                    "repeats": REPEATS,
                    "total_steps": 100_000,  # the server must still serve when it is killed
                    "save_every": 1000,
                    "max_staleness": 100,
                    "weight_sync": "disk",
                },
            }
        ],
        "clients": [
            {
                "name": GROUP,
                "agent": "scale_agent:hold",
                "tasks": "scale_agent:tasks",
                "servers": [MODEL],
                "array": plan.tasks,
                "in_flight": plan.in_flight,
                "max_tasks": plan.tasks * tasks_per_index,
                "server_wait_s": 3600,
                "partition": "cpu",
                "cpus": 1,
                "mem": "1G",
                "time": "1:00:00",
            }
        ],
    }
    return prepare_run(workdir, topology)


class Processes:
    """The client processes, each in its own process group, stopped at the end whatever happens."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.all: list[subprocess.Popen] = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("ab") as out:
            popen = subprocess.Popen(
                command,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=server_env(),
                start_new_session=True,
            )
        self.all.append(popen)
        return popen

    def signal(self, sig: int, which: list[subprocess.Popen] | None = None) -> None:
        """``sig`` to every process of each group but strace: strace ends (writing out its record) when
        its command does; killed, it would lose the record's tail and leave its command's traced calls
        failing with ENOSYS (its seccomp filter stays)."""
        for popen in self.all if which is None else which:
            if popen.poll() is None:
                for pid in group_members(popen.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)

    def wait(self, which: list[subprocess.Popen], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for popen in which:
            try:
                popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def wait_quiet(self, limit_s: float, cores: float = 0.05) -> None:
        """Until the client processes use less than ``cores`` (over half a second), at most ``limit_s``:
        the probe measures the server, not the clients' start."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            before = self.cpu_seconds()
            time.sleep(0.5)
            if self.cpu_seconds() - before < cores * 0.5:
                return
        print(f"    (the client processes were still busy after {limit_s:.0f} s)", flush=True)

    def cpu_seconds(self) -> float:
        ticks = 0
        for popen in self.all:
            for pid in group_members(popen.pid):
                with contextlib.suppress(OSError, IndexError):
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        if not self.wait(self.all, 30):
            for popen in self.all:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` but strace."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            if int(rest[2]) == pgid and name != "strace":
                members.append(int(entry.name))
    return members


def runner(run: Path, index: int) -> list[str]:
    return [
        sys.executable,
        "-u",
        "-m",
        "ajet_hpc.client",
        str(run),
        "--group",
        GROUP,
        "--index",
        str(index),
        "--once",
    ]


def population(run: Path, first: int, count: int) -> list[tuple[str, list[str]]]:
    """Array tasks first .. first+count-1, TASKS_PER_PROCESS to a process."""
    commands = []
    for start in range(first, first + count, TASKS_PER_PROCESS):
        n = min(TASKS_PER_PROCESS, first + count - start)
        commands.append(
            (
                f"clients-{start}",
                [sys.executable, str(HERE / "scale_clients.py"), str(run), GROUP, str(start), str(n)],
            )
        )
    return commands


# ------------------------------------------------------------------------------------------ the server
def status(http: httpx.Client, url: str, auth: dict[str, str]) -> dict:
    reply = http.get(f"{url}/v1/status", headers=auth)
    reply.raise_for_status()
    return reply.json()


def wait_open(
    http: httpx.Client, url: str, auth: dict[str, str], wanted: int, timeout_s: float, clients: Processes
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now_open = status(http, url, auth)["episodes_open"]
        if now_open >= wanted:
            return
        for popen in clients.all:
            if popen.poll() is not None:
                raise SystemExit(f"a client process exited with {popen.returncode} (logs: {clients.logs})")
        time.sleep(0.5)
    raise SystemExit(f"{wanted} open episodes not reached in {timeout_s:.0f} s (at {now_open})")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SystemExit(f"no VmRSS for process {pid}")


def sockets(pid: int) -> int:
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            held += os.readlink(fd).startswith("socket:")
    return held


class ProbeApi(OurApi):
    """The probe's episodes as a client group's: each connection runs tasks of REPEATS repeats, so that they
    make complete task groups that leave the trainer's pool as real traffic does (their rewards are equal:
    skipped as groups with nothing to learn, as ``skip_equal_groups`` does). Episodes of one task id without
    end would pile up in the pool instead."""

    def __init__(self, port: int, secret: str, url: str, tag: str) -> None:
        super().__init__(port, secret, url)
        self.tag, self.begun = tag, itertools.count()

    async def begin(self, conn: Conn, load: Load) -> dict | None:
        n = next(self.begun)
        task = {"task_id": f"{self.tag}-{n // REPEATS}", "group": "probe", "repeat": n % REPEATS}
        t0 = now()
        status, body = await conn.send(request_bytes("POST", "/v1/episodes", self.port, task, self.secret))
        return json.loads(body) if load.add(t0, now(), "begin", status, body) else None


def profiled(pid: int, seconds: float, out: Path | None) -> subprocess.Popen | None:
    """``py-spy record`` of the server for ``seconds`` into ``out`` (raw stacks), when asked for."""
    if out is None:
        return None
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        raise SystemExit(f"--profile needs py-spy ({spy}): pip install py-spy")
    command = [
        str(spy),
        "record",
        "-p",
        str(pid),
        "-d",
        str(int(seconds)),
        "-r",
        "250",
        "-f",
        "raw",
        "-o",
        str(out),
    ]
    return subprocess.Popen(
        [*command, "--nonblocking", "--threads"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )


def top_frames(raw: Path, count: int = 12) -> list[str]:
    """The functions with most samples of their own in a py-spy raw record (thread frames left out),
    and the share of samples that passed through the collector and the coordinator."""
    own: dict[str, int] = {}
    through = {"collector": 0, "coordinator": 0, "gc": 0}
    total = 0
    if not raw.exists():
        return [f"(no profile at {raw})"]
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("thread ", "process "))]
        if not frames:
            continue
        total += int(n)
        own[frames[-1]] = own.get(frames[-1], 0) + int(n)
        for name in through:
            through[name] += int(n) if any(name in f for f in frames) else 0
    shares = ", ".join(f"{name} {100 * k / max(1, total):.1f}%" for name, k in through.items())
    top = sorted(own.items(), key=lambda item: -item[1])[:count]
    return [f"samples {total}; through {shares}"] + [f"{100 * k / total:5.1f}% {f[:150]}" for f, k in top]


def probe(server: Proc, secret: str, seconds: float, level: Level, profile: Path | None = None) -> None:
    """Closed-loop episodes of 4 chat calls on PROBE_CLIENTS keep-alive connections for a warm-up second
    and a ``seconds`` window (``proxy_load``'s lean HTTP client on uvloop: the probe must not be the
    bottleneck, as the ``openai`` client on one core would be)."""
    before = rss_kb(server.popen.pid)
    collections = gc_stats()
    started = time.monotonic()
    api = ProbeApi(server.port, secret, server.url, f"probe{level.open}")
    spy = profiled(server.popen.pid, seconds + 1, profile)
    (window,) = run_async(
        closed_loop(server, PROBE_CLIENTS, ours_llm_client(api, 4), 1.0, seconds, 1, "chat")
    )
    level.probe_rss_kb = rss_kb(server.popen.pid) - before
    took = time.monotonic() - started
    time.sleep(0.6)  # the server rewrites its figures every half second
    after = gc_stats()
    if collections and after:
        level.gc_share = sum(after[g]["seconds"] - collections[g]["seconds"] for g in "012") / took
        level.full_gcs = after["2"]["collections"] - collections["2"]["collections"]
    if spy is not None and profile is not None:
        spy.wait(60)
        for line in top_frames(profile):
            print(f"      {line}", flush=True)
    level.chat_rps, level.p50_ms, level.p99_ms = window.rps, window.pct(50), window.pct(99)
    level.cpu_ms, level.errors = window.cpu_ms, window.failed
    if window.failed or not window.requests:
        raise SystemExit(f"the probe at {level.open} open episodes: {window.failed} of its calls failed")


def listen_overflows() -> int:
    """The host's count of connections dropped because a listen queue was full (``TcpExtListenOverflows``)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=True):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split(), values.split(), strict=True))["ListenOverflows"])
    return 0


def gc_stats() -> dict[str, Any]:
    """The server's garbage collector's work so far (``scale_server.record_collections``), if it wrote any."""
    path = os.environ.get(GC_STATS_ENV)
    with contextlib.suppress(OSError, ValueError):
        return json.loads(Path(path).read_text()) if path else {}
    return {}


def kill_ranks(run: RunDir) -> None:
    """The no-op ranks of a killed server (their own process group, as the real ones)."""
    work = WorkDir(run.trainer_dir(MODEL))
    with contextlib.suppress(OSError, ValueError, KeyError, ProcessLookupError):
        pid = int(json.loads(work.ready.read_text())["pid"])
        os.killpg(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ the measurement
def measure(plan: Plan, workdir: Path) -> Report:
    run_path = write_run(workdir, plan)
    run = RunDir.at(run_path)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    secret = run.read_secret()
    os.environ[GC_STATS_ENV] = str(workdir / "server-gc.json")
    server = start_server(
        run_path, command=[sys.executable, str(HERE / "scale_server.py"), "serve", str(run_path)]
    )
    clients = Processes(logs)
    report = Report()
    overflows = listen_overflows()
    try:
        print(f"server up at {server.url} (pid {server.popen.pid}); its log: {server.log}", flush=True)
        auth = run_auth(server.url, secret)
        target = Proc("server", server.popen, int(server.url.rsplit(":", 1)[1]), server.log)
        trace0 = workdir / "task-0.strace"
        traced = clients.start("task-0", scale_trace.traced(runner(run_path, 0), trace0))
        held = [traced]
        opened = 1  # array tasks started
        with httpx.Client(timeout=30) as http:
            for level in plan.levels:
                count = level // plan.in_flight - opened
                for name, command in population(run_path, opened, count):
                    held.append(clients.start(name, command))
                opened += count
                started = time.monotonic()
                wait_open(http, server.url, auth, level, 120 + level / 10, clients)
                clients.wait_quiet(60)  # the last begins' answers reached their agents, threads settled
                time.sleep(plan.settle_s)  # e.g. past serving.keep_alive_s: idle connections closed
                if level == plan.levels[0]:
                    healthy_from = time.time()
                row = Level(level, rss_kb(server.popen.pid), sockets(server.popen.pid))
                profile = plan.profile_dir / f"server-{level}.txt" if plan.profile_dir else None
                probe(target, secret, plan.probe_s, row, profile)
                report.levels.append(row)
                took = time.monotonic() - started
                print(
                    f"{level:>6} open (in {took:.0f} s): server {row.rss_kb / 1024:.0f} MiB, "
                    f"{row.sockets} sockets; probe {row.chat_rps:.0f} chat/s p50 {row.p50_ms:.1f} ms "
                    f"p99 {row.p99_ms:.1f} ms, server {row.cpu_ms:.2f} ms CPU per call ({row.errors} errors),"
                    f" garbage collector {100 * row.gc_share:.1f}% of the time ({row.full_gcs} full)",
                    flush=True,
                )
            released = time.time()
            report.healthy = scale_trace.count(trace0, run.root, healthy_from, released)
            report.healthy_min = (released - healthy_from) / 60
            clients.signal(signal.SIGUSR1, held)
            if not clients.wait(held, 300):
                raise SystemExit(f"the client tasks did not end within 300 s of the release (logs: {logs})")
            ended = time.time()
            committed = [len(read_results(run.client_store(GROUP, i))) for i in range(opened)]
            report.committed_0 = committed[0]
            report.commits_per_s = sum(committed) / (ended - released)
            if sum(committed) != ROUNDS * plan.levels[-1]:
                raise SystemExit(
                    f"{sum(committed)} results committed, not {ROUNDS * plan.levels[-1]} (logs: {logs})"
                )
            print(f"released: {sum(committed)} results committed in {ended - released:.1f} s", flush=True)
            report.steps, report.dropped_groups, report.coordinator_s = wait_steps(run, plan)
            report.retried = sum(f.read_text(errors="replace").count("server away (") for f in logs.iterdir())
            report.busy = scale_trace.count(trace0, run.root, released)
            report.listen_overflows = listen_overflows() - overflows
            report.whole = scale_trace.count(trace0, run.root)
            # away: the server dies as on a node failure (its rendezvous file stays); a fresh task waits
            os.killpg(server.popen.pid, signal.SIGKILL)
            server.popen.wait(30)
            kill_ranks(run)
            trace_away = workdir / "task-away.strace"
            away_started = time.time()
            waiting = clients.start(
                "task-away", scale_trace.traced(runner(run_path, plan.away_index), trace_away)
            )
            time.sleep(plan.away_after_s + plan.away_window_s)
            if waiting.poll() is not None:
                raise SystemExit(f"the waiting task exited with {waiting.returncode} (logs: {logs})")
            clients.signal(signal.SIGTERM, [waiting])
            clients.wait([waiting], 30)
            since = away_started + plan.away_after_s
            report.away = scale_trace.count(trace_away, run.root, since, since + plan.away_window_s)
            report.away_first = scale_trace.count(trace_away, run.root, away_started, since)
            report.away_min = plan.away_window_s / 60
            report.away_all = scale_trace.count(trace_away, run.root)
    finally:
        clients.stop()
        stop_server(server)
        kill_ranks(run)
    return report


def wait_steps(run: RunDir, plan: Plan, quiet_s: float = 30.0) -> tuple[int, int, float]:
    """The training steps made once the released episodes are in (the held ones make ``expected``, the
    probes' whole task groups more), until no step came for ``quiet_s``: their number, the task groups
    dropped as unable to complete (reported by the steps' rows), and the coordinator's median seconds per
    step."""
    expected = ROUNDS * plan.levels[-1] // (plan.tasks_per_batch * REPEATS)
    rows: list[dict] = []
    last_change, seen = time.monotonic(), -1
    while time.monotonic() - last_change < quiet_s:
        rows = [
            r for r in metrics.read_rows(run.metrics_file) if r.get("model") == MODEL and "coordinator_s" in r
        ]
        if len(rows) != seen:
            last_change, seen = time.monotonic(), len(rows)
        time.sleep(1.0)
    if not rows:
        raise SystemExit("no training step")
    dropped = sum(int(r.get("dropped_incomplete") or 0) for r in rows)
    seconds = statistics.median(r["coordinator_s"] for r in rows)
    print(
        f"{len(rows)} steps of {plan.tasks_per_batch * REPEATS} episodes ({expected} from the held episodes "
        f"alone; {dropped} task groups dropped as unable to complete): coordinator {seconds:.3f} s/step",
        flush=True,
    )
    return len(rows), dropped, seconds


# ------------------------------------------------------------------------------------------ the report
def result_line(plan: Plan, report: Report) -> str:
    bottom, top = report.levels[0], report.levels[-1]
    probes = sum(level.probe_rss_kb for level in report.levels[:-1])
    per_episode_kb = (top.rss_kb - bottom.rss_kb - probes) / (top.open - bottom.open)
    fields: dict[str, float] = {"open_episodes": top.open}
    for name in ("chat_rps", "p50_ms", "p99_ms", "cpu_ms", "gc_share", "full_gcs"):
        digits = 3 if name == "gc_share" else 1
        fields.update({f"{name}_{row.open}": round(getattr(row, name), digits) for row in report.levels})
    fields.update(
        {
            f"api_ratio_{top.open}_vs_{bottom.open}": round(top.chat_rps / bottom.chat_rps, 3),
            "mem_per_open_episode_kb": round(per_episode_kb, 1),
            f"server_sockets_{top.open}": top.sockets,
            "store_commits_per_s": round(report.commits_per_s, 1),
            "coordinator_s_per_step": round(report.coordinator_s, 3),
            "steps": report.steps,
            "dropped_groups": report.dropped_groups,
            "client_retries": report.retried,
            "listen_overflows": report.listen_overflows,
            "metaops_per_task_min_healthy": round(report.healthy.metaops / report.healthy_min, 2),
            "metaops_per_task_min_away": round(report.away.metaops / report.away_min, 2),
            "metaops_per_task_first_min_away": report.away_first.metaops,
            "fsyncs_per_episode_client": round(report.busy.fsyncs / max(1, report.committed_0), 3),
            "fsyncs_per_task_min_idle": round(report.healthy.fsyncs / report.healthy_min, 2),
            "slurm_cmds_per_task": report.whole.slurm + report.away_all.slurm,
            "probe_errors": sum(level.errors for level in report.levels),
        }
    )
    return "RESULT " + " ".join(f"{key}={value}" for key, value in fields.items())


def parse_args(argv: list[str] | None) -> tuple[Plan, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="16 and 48 open episodes, short windows")
    parser.add_argument(
        "--levels", default=None, help="open episodes to measure at, ascending (256,1024,4096)"
    )
    parser.add_argument("--in-flight", type=int, default=None, help="episodes in flight per array task (64)")
    parser.add_argument("--probe-s", type=float, default=None, help="seconds of each probe (8)")
    parser.add_argument("--away-after-s", type=float, default=None, help="the away window starts after (60)")
    parser.add_argument("--away-window-s", type=float, default=None, help="the away window's length (60)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run here")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy records of each probe into DIR")
    parser.add_argument("--settle-s", type=float, default=0.0, help="pause before each level's measurement")
    parser.add_argument(
        "--serving", action="append", default=[], metavar="KEY=SECONDS", help="a serving setting (repeatable)"
    )
    args = parser.parse_args(argv)
    smoke = args.smoke
    plan = Plan(
        levels=[int(n) for n in (args.levels or ("16,48" if smoke else "256,1024,4096")).split(",")],
        in_flight=args.in_flight or (8 if smoke else 64),
        probe_s=args.probe_s or (2.0 if smoke else 8.0),
        away_after_s=args.away_after_s if args.away_after_s is not None else (2.0 if smoke else 60.0),
        away_window_s=args.away_window_s or (8.0 if smoke else 60.0),
        profile_dir=args.profile,
        settle_s=args.settle_s,
        serving={key: float(value) for key, _, value in (item.partition("=") for item in args.serving)},
    )
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    levels = plan.levels
    if len(levels) < 2 or levels != sorted(set(levels)):
        parser.error("--levels: at least two sizes, ascending")
    if plan.in_flight % REPEATS or any(level % plan.in_flight for level in levels):
        parser.error(f"--in-flight must be a multiple of {REPEATS} and divide every level")
    return plan, args.workdir


def main(argv: list[str] | None = None) -> int:
    plan, keep = parse_args(argv)
    if not scale_trace.available():
        raise SystemExit("strace is not installed: the per-task counts need it (apt-get install strace)")
    workdir = keep or Path(tempfile.mkdtemp(prefix="ajet-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = measure(plan, workdir)
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(result_line(plan, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
