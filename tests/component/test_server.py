"""The server against real engines on the tiny model: the openai client, raw HTTP, recording, auth, errors.

The model is the tiny one taught a five-call calculator conversation (tests/scripted_model.py), so greedy
decoding really emits tool calls; nothing here mocks an engine. The recorded conversation also runs on
tiny-qwen (Qwen2.5's byte-level BPE vocabulary and chat format, tied embeddings).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam, ChatCompletionToolUnionParam
from scripted_model import SCRIPT, SYSTEM, TOOLS
from server_harness import SECRET, RunningServer, admin_token
from transformers import AutoModelForCausalLM

from ajet_hpc.server.auth import issue_episode_token
from ajet_hpc.tracking.timeline import MODEL

pytestmark = pytest.mark.slow


SERVED = [("transformers", "tiny"), ("vllm", "tiny"), ("transformers", "tiny-qwen"), ("vllm", "tiny-qwen")]


@pytest.fixture(params=SERVED, ids=[f"{engine}-{model}" for engine, model in SERVED])
def scripted_server(request: pytest.FixtureRequest) -> tuple[RunningServer, Path]:
    """A server on each engine and built-in model, and the scripted model it serves."""
    engine, model = request.param
    prefix = "qwen_" if model == "tiny-qwen" else ""
    server = request.getfixturevalue(f"{prefix}{'hf' if engine == 'transformers' else 'vllm'}_server")
    return server, request.getfixturevalue("scripted_qwen_model" if prefix else "scripted_model")


def _reply_matches(message, expected: dict) -> None:
    if expected.get("tool_calls"):
        assert message.tool_calls and len(message.tool_calls) == 1, message
        got = message.tool_calls[0].function
        want = expected["tool_calls"][0]["function"]
        assert got.name == want["name"] and json.loads(got.arguments) == json.loads(want["arguments"])
    else:
        assert message.content == expected["content"] and not message.tool_calls


def _stream_message(stream: Iterable[ChatCompletionChunk]) -> tuple[dict[str, Any], str | None]:
    content, finish = "", None
    calls: list[dict[str, Any]] = []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += [call.model_dump(exclude_none=True) for call in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in calls]
    return message, finish


def _as_message(message: dict[str, Any]) -> ChatCompletionMessageParam:
    """A message of the script (plain JSON) as the openai client types the messages it sends."""
    return cast(ChatCompletionMessageParam, message)


def run_script(server, stream: bool) -> tuple[str, list[dict]]:
    """The agent side: five calls through one episode with the real openai client."""
    begun = server.begin(task_id="add-two-sums", group="calc")
    client = openai.OpenAI(base_url=begun["base_url"], api_key=begun["api_key"], max_retries=0)
    messages: list[ChatCompletionMessageParam] = [_as_message(SYSTEM)]
    tools = cast(list[ChatCompletionToolUnionParam], TOOLS)  # plain JSON tool schemas
    replies = []
    for sent, expected in SCRIPT:
        messages.append(_as_message(sent))
        if stream:
            chunks = client.chat.completions.create(
                model="policy", messages=messages, tools=tools, temperature=0, max_tokens=60, stream=True
            )
            reply, finish = _stream_message(chunks)
            message = openai.types.chat.ChatCompletionMessage.model_validate(reply)
        else:
            completion = client.chat.completions.create(
                model="policy", messages=messages, tools=tools, temperature=0, max_tokens=60, logprobs=True
            )
            message, finish = completion.choices[0].message, completion.choices[0].finish_reason
            assert completion.usage is not None and completion.usage.completion_tokens > 0
            reply = message.model_dump(exclude_none=True)
        _reply_matches(message, expected)
        assert finish == ("tool_calls" if expected.get("tool_calls") else "stop")
        messages.append(_as_message(reply))
        replies.append(reply)
    return begun["episode_id"], replies


def rescore(model_path, timeline: dict) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.tensor([timeline["prompt_ids"] + timeline["response_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    start = len(timeline["prompt_ids"])
    targets = ids[0, start:]
    return logp[start - 1 :].gather(1, targets[:, None])[:, 0]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_five_turn_tool_conversation_is_recorded_token_for_token(
    scripted_server: tuple[RunningServer, Path], stream: bool
) -> None:
    server, scripted_model = scripted_server
    episode_id, replies = run_script(server, stream)
    assert server.end(episode_id, 1.0, turn_rewards=[0, 0.5, 0, 0.5, 1]).status_code == 200
    record = server.episode(episode_id)
    assert record["state"] == "finished" and record["calls"] == 5 and record["drift"] == 0
    timelines = record["timelines"]
    tokenizer = server.ctx.engine.tokenizer
    for index, (timeline, reply) in enumerate(zip(timelines, replies, strict=True)):
        served = tokenizer.decode(timeline["response_ids"], skip_special_tokens=True)
        assert isinstance(served, str)  # one sequence decodes to one string
        if reply.get("tool_calls"):
            assert served.startswith("<tool_call>") and reply["tool_calls"][0]["function"]["name"] in served
        else:
            assert served == reply["content"]
        response_len = len(timeline["response_ids"])
        assert timeline["loss_mask"][-response_len:] == [1] * response_len
        assert sum(timeline["loss_mask"]) == response_len
        assert timeline["token_authors"][-response_len:] == [MODEL] * response_len
        if index:  # token-in, token-out: the previous answer's sampled ids sit verbatim in this prompt
            previous = timelines[index - 1]
            assert timeline["prompt_ids"][: len(previous["prompt_ids"])] == previous["prompt_ids"]
            start, end = timeline["reused_spans"][-1]
            assert timeline["prompt_ids"][start:end] == previous["response_ids"]
    for timeline in timelines:
        expected = rescore(scripted_model, timeline)
        got = torch.tensor(timeline["response_logprobs"])
        assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()


def test_64_concurrent_episodes_on_vllm(vllm_server) -> None:
    before = vllm_server.status()

    async def one(client: httpx.AsyncClient, index: int) -> int:
        begun = (
            await client.post("/v1/episodes", json={"task_id": f"t{index}"}, headers=vllm_server.admin)
        ).json()
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": f"count {index}"}],
            "max_tokens": 12,
        }
        reply = await client.post(
            f"{begun['base_url']}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {begun['api_key']}"},
        )
        reply.raise_for_status()
        ended = await client.post(
            f"/v1/episodes/{begun['episode_id']}/end", json={"reward": index / 64}, headers=vllm_server.admin
        )
        ended.raise_for_status()
        return reply.json()["usage"]["completion_tokens"]

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    tokens = asyncio.run(main())
    assert len(tokens) == 64 and all(0 < t <= 12 for t in tokens)
    after = vllm_server.status()
    assert after["episodes_finished"] - before["episodes_finished"] == 64
    assert after["requests_served"] - before["requests_served"] == 64
    assert after["episodes_open"] == before["episodes_open"]


def test_idle_episode_is_dropped_reported_and_late_end_refused(hf_harness) -> None:
    server = hf_harness.serve(episode_timeout_s=0.5)
    begun = server.begin(task_id="slow-task")
    deadline = time.monotonic() + 30
    while server.status()["episodes_dropped"] < 1:
        assert time.monotonic() < deadline, "the idle episode was never dropped"
        time.sleep(0.2)
    status = server.status()
    assert [e["episode_id"] for e in status["dropped_recent"]] == [begun["episode_id"]]
    assert status["dropped_recent"][0]["task_id"] == "slow-task"
    late = server.end(begun["episode_id"], 1.0)
    assert late.status_code == 409 and "dropped" in late.json()["error"]["message"]
    chat = httpx.post(
        f"{begun['base_url']}/chat/completions",
        headers={"Authorization": f"Bearer {begun['api_key']}"},
        json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 409


# ----------------------------------------------------------------------------------------------- auth
def _chat(url: str, token: str | None, model: str = "policy") -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=60)


def test_auth_missing_token_is_401(hf_server) -> None:
    begun = hf_server.begin()
    reply = _chat(begun["base_url"], None)
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{hf_server.url}/v1/episodes", json={}).status_code == 401


def test_auth_forged_token_is_401(hf_server) -> None:
    begun = hf_server.begin()
    forged = issue_episode_token("not-the-secret", begun["episode_id"], "policy", 60)
    assert _chat(begun["base_url"], forged).status_code == 401
    tampered = begun["api_key"][:-2] + ("AA" if not begun["api_key"].endswith("AA") else "BB")
    assert _chat(begun["base_url"], tampered).status_code == 401


def test_auth_expired_token_is_401(hf_server) -> None:
    begun = hf_server.begin()
    expired = issue_episode_token(SECRET, begun["episode_id"], "policy", 1, now=time.time() - 3600)
    reply = _chat(begun["base_url"], expired)
    assert reply.status_code == 401 and "expired" in reply.json()["error"]["message"]


def test_auth_other_episodes_token_is_403(hf_server) -> None:
    first, second = hf_server.begin(), hf_server.begin()
    assert _chat(first["base_url"], second["api_key"]).status_code == 403
    assert _chat(first["base_url"], first["api_key"]).status_code == 200


def test_auth_other_models_token_is_403(hf_server) -> None:
    begun = hf_server.begin()
    judge = issue_episode_token(SECRET, begun["episode_id"], "judge", 60)
    assert _chat(begun["base_url"], judge).status_code == 403


def test_auth_run_token_cannot_chat_the_secret_is_never_taken_and_episode_token_cannot_begin(
    hf_server,
) -> None:
    begun = hf_server.begin()
    assert _chat(begun["base_url"], admin_token(hf_server.url)).status_code == 403
    for call in (
        _chat(begun["base_url"], SECRET),
        httpx.post(f"{hf_server.url}/v1/episodes", json={}, headers={"Authorization": f"Bearer {SECRET}"}),
    ):
        assert call.status_code == 401 and "never accepted over HTTP" in call.json()["error"]["message"]
    headers = {"Authorization": f"Bearer {begun['api_key']}"}
    assert httpx.post(f"{hf_server.url}/v1/episodes", json={}, headers=headers).status_code == 403
    assert httpx.get(f"{hf_server.url}/v1/status", headers=headers).status_code == 403


def test_token_never_logged(hf_server, caplog: pytest.LogCaptureFixture) -> None:
    begun = hf_server.begin()
    _chat(begun["base_url"], "ep1.garbage.garbage")
    _chat(begun["base_url"], begun["api_key"])
    assert begun["api_key"] not in caplog.text and SECRET not in caplog.text


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_gets_openai_errors_and_harms_nobody(hf_server) -> None:
    bystander = hf_server.begin()
    begun = hf_server.begin()
    url, headers = f"{begun['base_url']}/chat/completions", {"Authorization": f"Bearer {begun['api_key']}"}
    ok = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        (b"{not json", 400, None),
        (json.dumps({**ok, "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({**ok, "messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({**ok, "n": 99}).encode(), 400, "n"),
        (json.dumps({**ok, "max_tokens": 100000}).encode(), 400, "max_tokens"),
        (json.dumps({**ok, "messages": [{"role": "user", "content": "x" * 5000}]}).encode(), 400, "messages"),
        (json.dumps({**ok, "model": "gpt-4"}).encode(), 404, "model"),
    ]
    for body, status, param in cases:
        reply = httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"})
        assert reply.status_code == status, (body[:60], reply.text)
        error = reply.json()["error"]
        assert error["message"] and error["type"]
        if param:
            assert error["param"] and error["param"].startswith(param), error
    too_long = httpx.post(
        url, json={**ok, "messages": [{"role": "user", "content": "x" * 5000}]}, headers=headers
    )
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    unknown = httpx.post(
        f"{hf_server.url}/v1/episodes/ep-nope/end", json={"reward": 1}, headers=hf_server.admin
    )
    assert unknown.status_code == 404
    nan = httpx.post(
        f"{hf_server.url}/v1/episodes/{begun['episode_id']}/end",
        content=b'{"reward": NaN}',
        headers={**hf_server.admin, "Content-Type": "application/json"},
    )
    assert nan.status_code == 400
    # the server lives on and the other episode is untouched
    assert _chat(bystander["base_url"], bystander["api_key"]).status_code == 200
    assert hf_server.end(bystander["episode_id"], 0.5).status_code == 200


def test_raw_sse_stream_format(hf_server) -> None:
    begun = hf_server.begin()
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        f"{begun['base_url']}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {begun['api_key']}"},
    ) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["choices"] == []
    assert any(c["choices"] and c["choices"][0].get("finish_reason") == "length" for c in chunks)


def test_text_completions_and_models(hf_server) -> None:
    begun = hf_server.begin()
    client = openai.OpenAI(base_url=begun["base_url"], api_key=begun["api_key"], max_retries=0)
    completion = client.completions.create(model="policy", prompt="2+3=", max_tokens=4, temperature=0)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4 and completion.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == ["policy"]
    assert hf_server.episode(begun["episode_id"])["calls"] == 1


def test_builtin_guess_agent_records_one_linear_conversation(hf_server) -> None:
    """The multi-turn built-in task through the real agent function: every call after the first reuses
    the sampled ids of the previous answers (one linear conversation)."""
    from ajet_hpc.environments.episode import EpisodeContext, ModelHandle, Task
    from ajet_hpc.environments.guess.agent import solve

    begun = hf_server.begin(task_id="guess-0")
    handle = ModelHandle("policy", begun["base_url"], begun["api_key"])
    outcome = solve(EpisodeContext(task=Task("guess-0", {"secret": 7}), models={"policy": handle}, repeat=0))
    assert 0.0 <= outcome.reward <= 1.0
    assert hf_server.end(begun["episode_id"], outcome.reward).status_code == 200
    timelines = hf_server.episode(begun["episode_id"])["timelines"]
    assert timelines and len(timelines) <= 4  # one call per guess, at most four guesses
    for previous, current in itertools.pairwise(timelines):
        start, end = current["reused_spans"][-1]
        assert current["prompt_ids"][start:end] == previous["response_ids"]


_HEAP_PROBE = """
import asyncio, gc, sys
from ajet_hpc.config import ServingConfig
from ajet_hpc.engine.select import create_engine
from ajet_hpc.server.app import create_app
from ajet_hpc.server.context import JobContext, ModelContext
from ajet_hpc.server.recorder import EpisodeRecorder

engine = create_engine("transformers", sys.argv[1], max_model_len=256)
recorder = EpisodeRecorder(sys.argv[3])
ctx = ModelContext(
    name="policy", job=JobContext(engine, "5e" * 32), settings=ServingConfig(), recorder=recorder
)
app = create_app(ctx, manage_engine=False, freeze_heap=sys.argv[2] == "freeze")

async def main():
    before = gc.get_freeze_count()
    async with app.lifespan():
        aging = any(task.get_name() == "heap-ager" for task in asyncio.all_tasks())
        print(before, gc.get_freeze_count(), aging)

asyncio.run(main())
"""


@pytest.mark.parametrize("freeze", [True, False], ids=["server-process", "in-process-app"])
def test_the_server_process_freezes_its_startup_heap(tiny_model: Path, tmp_path: Path, freeze: bool) -> None:
    """The server's own process (``ajet_hpc.server.process`` passes ``freeze_heap``) moves the startup heap
    (libraries, engine, tokenizer) out of the garbage collector's sight once started, as ``vllm serve``
    does, and runs the heap ager; an app made in another process (tests, embedding) leaves that process's
    collector alone. Run in a subprocess: a freeze would outlive the test."""
    import subprocess
    import sys

    probe = [
        sys.executable,
        "-c",
        _HEAP_PROBE,
        str(tiny_model),
        "freeze" if freeze else "keep",
        str(tmp_path / "policy.h5"),
    ]
    done = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, aging = done.stdout.split()[-3:]
    assert int(before) == 0
    assert int(after) > 10_000 if freeze else int(after) == 0  # torch and transformers alone: ~10^5 objects
    assert aging == str(freeze)  # what lives on is frozen as it ages (server/heap.py) in the server's process
