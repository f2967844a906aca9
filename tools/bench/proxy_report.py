"""What the proxy benchmark runs (its plans) and prints (windows, tables, the RESULT line)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (str(REPO), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from proxy_load import BUSY_CORES, LLM_MAX_TOKENS, Window  # noqa: E402

from ajet_hpc.offline.views import table as _table  # noqa: E402


def table(headers: list[str], rows: list[list[str]]) -> str:
    """The package's plain table (``ajet_hpc.offline.views``), figures right-aligned."""
    return _table(headers, rows, right=headers[1:])


def fmt(value: float, digits: int = 1) -> str:
    return "nan" if value != value else f"{value:,.{digits}f}"


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
    retries: int = 2  # extra tries of a leg or phase the machine was busy during


FULL = Plan(3, 4.0, 12.0, 64, 8, 256, 2.0, 5.0, 3, 8.0, 400)
QUICK = Plan(1, 3.0, 5.0, 64, 8, 256, 1.5, 3.0, 1, 3.0, 150)
SMOKE = Plan(1, 0.5, 1.0, 4, 2, 8, 0.2, 0.5, 1, 0.5, 5, retries=0)  # does every part still run (tests)
CHAT_PHASE = "chat, 1 turn, open episode"


def median_window(windows: list[Window]) -> Window:
    """The window of median throughput among those the machine was quiet during (all, if none was);
    latencies are that window's own."""
    windows = [w for w in windows if not w.busy] or windows
    return sorted(windows, key=lambda w: w.rps)[len(windows) // 2]


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
