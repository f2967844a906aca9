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
measured again (``Plan.retries`` times at most). See tools/bench/README.md for the figures and what they mean.

Parts: ``proxy_procs.py`` (the server subprocesses and the server side, ``proxy.py _serve``),
``proxy_load.py`` (load generator, measured windows, workloads), ``proxy_micro.py`` (``--profile``'s
in-process breakdown), ``proxy_report.py`` (plans, tables, the RESULT line); this file runs the two
measurements. ``--smoke`` runs the tiniest plan (8 clients, sub-second windows, no retries): a check that
every part still runs (tests/component/test_bench_smoke.py), not a measurement.

``--profile`` prints the CPU cost of the pieces of a chat call (in-process) and runs the chat phase of (2)
with the server under cProfile (slower than an unprofiled run; look at the shares, not the rates).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (str(REPO), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from proxy_load import (  # noqa: E402
    LLM_MAX_TOKENS,
    ClientFn,
    Conn,
    Load,
    OurApi,
    Window,
    agent_client,
    begin_episodes,
    chat_body,
    closed_loop,
    completion_tokens,
    episode_api_client,
    foreign_load,
    now,
    ours_llm_client,
    paced,
    repeat_client,
    request_bytes,
    run_async,
    vllm_llm_client,
    wait_quiet,
)
from proxy_micro import breakdown, print_breakdown, print_profile  # noqa: E402
from proxy_procs import (  # noqa: E402
    _on_signal,
    serve_main,
    start_ours,
    start_vllm,
    stop,
    stop_all,
    wait_up,
)
from proxy_report import CHAT_PHASE, FULL, QUICK, SMOKE, Plan, describe, fmt, median_window, report  # noqa: E402


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
            for attempt in range(plan.retries + 1):
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
                if not window.busy or attempt == plan.retries:
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

    def summary(side: str) -> dict[str, float]:
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

    # each side's summary, then the figures across the sides (``paired``: the ratio of each pair of windows)
    out: dict[str, Any] = {side: summary(side) for side in results}
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
        for attempt in range(plan.retries + 1):
            windows = run_async(
                closed_loop(
                    proc, clients, client, plan.zero_warmup_s, plan.zero_window_s, plan.zero_windows, kind
                )
            )
            if not all(w.busy for w in windows) or attempt == plan.retries:
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

        for attempt in range(plan.retries + 1):
            rows[CHAT_PHASE] = await closed_loop(
                proc, conns, client, plan.zero_warmup_s, plan.zero_window_s, plan.zero_windows, "chat"
            )
            if not all(w.busy for w in rows[CHAT_PHASE]) or attempt == plan.retries:
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
                for attempt in range(plan.retries + 1):
                    paced_rows[name] = await paced(proc, n, rate, plan.paced_s, raw, name)
                    if not paced_rows[name][0].busy or attempt == plan.retries:
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


# ============================================================================== main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a shortened run (smoke check, < 2 minutes)")
    parser.add_argument(
        "--smoke", action="store_true", help="the tiniest run (8 clients, sub-second windows): does it run"
    )
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
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL

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
            f"ajet_hpc proxy benchmark ({'smoke' if args.smoke else 'quick' if args.quick else 'full'}), "
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


if __name__ == "__main__":
    sys.exit(main())
