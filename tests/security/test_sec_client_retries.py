"""A client runner whose agent's model call is answered with an HTTP 5xx (issue 14, item 7): it runs the
episode again a bounded number of times, with growing pauses, aborting each run at the server with the
error as reason; then it gives up that task and repeat and goes on (it used to run it again for ever).
And one whose end the server refuses (a reward beyond ``serving.max_abs_reward``, item 6) aborts the
episode with the server's message instead of leaving it open."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from server_harness import SECRET, Harness, admin_token
from support import topology_dict

from ajet_hpc.client.runner import SERVER_ERROR_ATTEMPTS, GroupTask
from ajet_hpc.config import load_topology
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.environments.episode import EpisodeContext, Outcome
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.client_store import read_results
from ajet_hpc.storage.rundir import RunDir

INJECTED = "engine exploded (injected by the test)"


class FailingModelProxy:
    """In front of a real server: forwards every call, except model calls, which it answers with a 500.

    A fake, on purpose: a real server cannot be made to fail its model calls on demand. Everything else the
    runner does (begin, abort, /health, the episodes it ended) goes to the real server behind it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.model_calls: list[float] = []  # monotonic times of the model calls answered with a 500
        app = FastAPI()
        app.add_api_route("/{path:path}", self.forward, methods=["GET", "POST"])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[sock])))
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    async def forward(self, path: str, request: Request) -> Response:
        if path.endswith("chat/completions"):
            self.model_calls.append(time.monotonic())
            error = {"message": INJECTED, "type": "server_error", "param": None, "code": None}
            return JSONResponse(status_code=500, content={"error": error})
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
        async with httpx.AsyncClient(timeout=60) as client:
            reply = await client.request(
                request.method,
                f"{self.upstream}/{path}",
                params=request.query_params,
                content=await request.body(),
                headers=headers,
            )
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    harness = Harness("transformers", resolve_model("builtin:tiny", tmp_path_factory.mktemp("models")))
    running = harness.serve()
    proxy = FailingModelProxy(running.url)
    # the URL the server names in its challenge proofs and hands to agents: every caller goes through the
    # proxy (a client would refuse the server at its own URL, a relay's proof naming another one)
    running.ctx.public_url = proxy.url
    yield running, proxy
    proxy.close()
    harness.close()


def open_episodes(url: str) -> int:
    reply = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {admin_token(url)}"}, timeout=30)
    return reply.json()["episodes_open"]


def huge_reward(ctx: EpisodeContext) -> float:
    """An agent (the runner imports it as ``test_sec_client_retries:huge_reward``) whose reward is beyond
    the server's default ``max_abs_reward`` of 1e6."""
    return 1e300


def surrogate_in_metadata(ctx: EpisodeContext) -> Outcome:
    """An agent whose outcome holds a lone surrogate (JSON text can carry one; UTF-8 cannot), on one task
    of two: the other commits as usual."""
    if ctx.task.id.endswith("-0"):
        return Outcome(reward=1.0, metadata={"answer": ["ok", "bad \ud800 text"]})
    return Outcome(reward=0.5, metadata={"answer": "fine"})


def make_run(tmp_path: Path, url: str, **client) -> RunDir:
    data = topology_dict(tmp_path / "run", array=1)
    data["clients"][0].update(max_tasks=2, server_wait_s=30, **client)
    run = RunDir(tmp_path / "run")
    run.prepare(load_topology(data))
    run.secret_file.write_text(SECRET + "\n")  # the harness's server holds this run secret
    port = int(url.rsplit(":", 1)[1])
    record = rendezvous.Rendezvous(
        name="policy", url=url, host="127.0.0.1", port=port, pid=1, job_id="1", node="local"
    )
    rendezvous.publish(run.rendezvous_file("policy"), dataclasses.replace(record, state="serving"))
    return run


def run_task(run: RunDir, task: GroupTask | None = None):
    """The runner's one array task, in a thread; None for a tally when it did not return within 60 s."""
    task = task or GroupTask(run, run.load_topology().clients[0], index=0, repeats=1)
    task.server_error_backoff_s = 0.2  # the defaults pause 2, 4, 8 s
    outcome: dict = {}
    worker = threading.Thread(target=lambda: outcome.update(tally=task.run()), daemon=True)
    worker.start()
    worker.join(60)  # a runner that retries for ever never gets here
    task.finished.set()  # stop it in any case, so that a failure leaves no thread running
    task.store.close()
    return outcome.get("tally")


@pytest.mark.slow
def test_a_5xx_model_call_is_retried_a_bounded_number_of_times_then_the_episode_is_aborted(
    server, tmp_path: Path, caplog
) -> None:
    real, proxy = server
    closed: list[tuple[str, str]] = []  # (state, reason) of each episode the real server closed
    real.ctx.episodes.on_closed(lambda episode: closed.append((episode.state, episode.reason or "")))
    tally = run_task(make_run(tmp_path, proxy.url))
    assert tally is not None, f"the runner still retries after {len(proxy.model_calls)} model calls"
    assert (tally.finished, tally.aborted) == (0, 2)  # both tasks given up; the runner went on to the second
    assert len(proxy.model_calls) == 2 * SERVER_ERROR_ATTEMPTS  # the built-in agent's client: max_retries=0
    first = proxy.model_calls[:SERVER_ERROR_ATTEMPTS]
    pauses = [b - a for a, b in itertools.pairwise(first)]
    assert all(pause >= 0.2 * 2**k for k, pause in enumerate(pauses)), pauses  # backoff, doubling
    assert open_episodes(proxy.url) == 0
    assert len(closed) == 2 * SERVER_ERROR_ATTEMPTS
    assert all(state == "aborted" and INJECTED in reason and "HTTP 500" in reason for state, reason in closed)
    assert f"aborted: a server answered with an error {SERVER_ERROR_ATTEMPTS} time(s)" in caplog.text
    assert INJECTED in caplog.text


@pytest.mark.slow
def test_an_end_the_server_refuses_aborts_the_episode_with_the_servers_message(
    server, tmp_path: Path
) -> None:
    real, proxy = server  # the agent makes no model call: the proxy only forwards
    closed: list[tuple[str, str]] = []
    real.ctx.episodes.on_closed(lambda episode: closed.append((episode.state, episode.reason or "")))
    run = make_run(tmp_path, proxy.url, agent="test_sec_client_retries:huge_reward")
    tally = run_task(run)
    assert tally is not None and (tally.finished, tally.aborted) == (0, 2)
    assert [state for state, _ in closed] == ["aborted", "aborted"]  # not left open for episode_timeout_s
    assert all("reward is 1e+300, beyond this server's limit of ±1e+06" in reason for _, reason in closed)
    assert open_episodes(proxy.url) == 0


@pytest.mark.slow
def test_an_outcome_that_cannot_be_stored_aborts_its_episode_at_once_with_the_reason(
    server, tmp_path: Path
) -> None:
    """A lone surrogate in an outcome used to fail the store's commit (UnicodeEncodeError) after the
    episode's end could not be sent, leaving the episode open until its timeout; now the runner checks the
    result before the end and aborts the episode at once, naming where the surrogate is; the task goes on."""
    real, proxy = server
    closed: list[tuple[str, str]] = []
    real.ctx.episodes.on_closed(lambda episode: closed.append((episode.state, episode.reason or "")))
    run = make_run(tmp_path, proxy.url, agent="test_sec_client_retries:surrogate_in_metadata")
    tally = run_task(run)
    assert tally is not None and (tally.finished, tally.aborted) == (1, 1)
    (aborted,) = [reason for state, reason in closed if state == "aborted"]
    assert "outcome.metadata.answer[1] holds a lone surrogate" in aborted
    assert [state for state, _ in closed].count("finished") == 1 and open_episodes(proxy.url) == 0
    (result,) = read_results(run.client_store("math", 0))
    assert result.metadata == {"answer": "fine"}


@pytest.mark.slow
def test_a_server_that_cannot_prove_the_secret_stops_the_runner(server, tmp_path: Path) -> None:
    """Another run's server (or a planted rendezvous file): the challenge fails, the runner sends nothing
    and stops its task (exit "server gone") instead of trying it again for every episode."""
    real, proxy = server
    begun: list[str] = []
    real.ctx.episodes.on_closed(lambda episode: begun.append(episode.episode_id))
    run = make_run(tmp_path, proxy.url)
    run.secret_file.write_text("0" * 64 + "\n")  # not the secret the server holds
    begun_before, calls_before = open_episodes(proxy.url), len(proxy.model_calls)
    task = GroupTask(run, run.load_topology().clients[0], index=0, repeats=1)
    tally = run_task(run, task)
    assert tally is not None and (tally.finished, tally.aborted) == (0, 0)
    assert task.gone is not None and "does not hold the run secret" in str(task.gone)
    assert open_episodes(proxy.url) == begun_before and not begun  # no episode begun, none closed
    assert len(proxy.model_calls) == calls_before


@pytest.mark.slow
def test_a_server_whose_engine_stopped_is_waited_for_and_its_episodes_run_again(
    tmp_path: Path, caplog
) -> None:
    """A server going down (its job requeued) stops its engine while its API still answers: model calls
    then get 503 ``engine_not_running`` (they used to get 400, and the agents' episodes were lost as agent
    failures). The runner takes that server as away: it waits, runs the episodes again once the engine
    runs again, and aborts none. A real server and engine, stopped and started again by the test."""
    harness = Harness("transformers", resolve_model("builtin:tiny", tmp_path / "models"))
    try:
        running = harness.serve()
        harness._call(harness.engine.stop())
        token = admin_token(running.url)
        begun = httpx.post(
            f"{running.url}/v1/episodes",
            json={"task_id": "t", "group": "math"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ).json()
        call = httpx.post(
            f"{begun['base_url']}/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "2+2="}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {begun['api_key']}"},
            timeout=30,
        )
        assert call.status_code == 503 and call.json()["error"]["code"] == "engine_not_running", call.text
        restarted = threading.Timer(1.5, lambda: harness._call(harness.engine.start()))
        restarted.start()
        tally = run_task(make_run(tmp_path, running.url))
        restarted.join()
        assert tally is not None and (tally.finished, tally.aborted) == (2, 0), tally
        assert "engine is not running" in caplog.text and "waiting to run it again" in caplog.text
    finally:
        harness.close()
