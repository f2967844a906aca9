"""In-process pieces of the proxy benchmark (``--profile``): the CPU cost of each piece of a chat call
with the zero engine, no HTTP, and the printout of the server's cProfile."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _path in (str(REPO), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from proxy_load import chat_body  # noqa: E402
from proxy_procs import MAX_MODEL_LEN, MODEL, NoStore  # noqa: E402
from proxy_report import fmt, table  # noqa: E402


def breakdown(model_dir: Path, secret: str) -> list[tuple[str, float]]:
    """CPU microseconds per call of the pieces of a chat request, in this process, no HTTP (with the zero
    engine). CPU time, not wall time: other load on the machine barely moves it."""
    import fastapi.encoders
    from zero_engine import ZeroEngine

    from ajet_hpc.config import ServingConfig
    from ajet_hpc.server import http_schemas as p
    from ajet_hpc.server.auth import authorize_episode_call, issue_episode_token
    from ajet_hpc.server.context import JobContext, ModelContext
    from ajet_hpc.tracking.context import ContextTracker

    engine = ZeroEngine(model_dir, MAX_MODEL_LEN)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    ctx = ModelContext(
        name=MODEL,
        job=JobContext(engine=engine, secret=secret),
        settings=ServingConfig(max_model_len=MAX_MODEL_LEN, max_tokens=256),
        recorder=NoStore(),
    )
    tokenizer = engine.tokenizer
    episode = ctx.episodes.begin("bench", None, {})
    tracker = episode.tracker
    assert tracker is not None, "a begun episode tracks its context"
    header = f"Bearer {issue_episode_token(secret, episode.episode_id, MODEL, 3600)}"
    raw = json.dumps(chat_body(16)).encode()
    request = p.ChatCompletionRequest.model_validate_json(raw)
    messages = [message.for_template() for message in request.messages]
    plan = tracker.build_prompt(messages)
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
    long_plan = tracker.build_prompt(long_messages)

    def end_one() -> None:
        ctx.episodes.end(ctx.episodes.begin("bench", None, {}).episode_id, 1.0, None, None, {})

    ops: list[tuple[str, Callable[[], object]]] = [
        (
            "auth: check the episode token (verified once, then cached)",
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
        ("tracker.build_prompt, 1 turn, warm episode", lambda: tracker.build_prompt(messages)),
        (
            "tracker.build_prompt, 1 turn, new episode",
            lambda: ContextTracker(tokenizer).build_prompt(messages),
        ),
        ("tracker.build_prompt, turn 2 (1 answer spliced)", lambda: agent_tracker.build_prompt(agent3)),
        (
            "tracker.build_prompt, 1 turn of 2,000 tokens, warm",
            lambda: tracker.build_prompt(long_messages),
        ),
        (
            "tracker.record (timeline copy)",
            lambda: (
                ContextTracker.record(tracker, plan, [8, 9, 4], [-0.5] * 3, reply, "stop", 0)
                and tracker._timelines.pop()
            ),
        ),
        (
            "tracker.record, 2,000-token prompt",
            lambda: (
                ContextTracker.record(tracker, long_plan, [8, 9, 4], [-0.5] * 3, reply, "stop", 0)
                and tracker._timelines.pop()
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
            lambda: loop.run_until_complete(ctx.service.chat(request, episode)) and tracker._timelines.pop(),
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


def print_breakdown(rows: list[tuple[str, float]]) -> None:
    print("\n== CPU cost of the pieces of a chat call (in-process, zero engine, CPU us per call) ==")
    print(table(["piece", "CPU us/call"], [[name, fmt(us, 1)] for name, us in rows]))


def print_profile(path: Path, top: int = 30) -> None:
    import pstats

    print(
        f"\n== server profile (cProfile, wall clock: skewed when other processes run; chat phase; {path}) =="
    )
    stats = pstats.Stats(str(path))
    stats.strip_dirs().sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
