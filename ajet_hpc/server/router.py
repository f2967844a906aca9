"""Routes of a server: OpenAI-compatible model calls, the episode API, health and status.

Agents get ``base_url = <server>/episodes/<id>/v1`` and their episode token as ``api_key``; the same calls
at ``<server>/v1/...`` take the episode from the token. Everything but ``/health`` needs a bearer token.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from ajet_hpc.server import http_schemas as p
from ajet_hpc.server.auth import AuthError, authorize_episode_call, authorize_run_call, issue_episode_token
from ajet_hpc.server.context import ModelState
from ajet_hpc.server.episodes import Episode
from ajet_hpc.server.errors import BadRequest, Conflict, Unavailable
from ajet_hpc.server.eval_routes import eval_begin, with_sampling
from ajet_hpc.server.gate import AUTHORIZATION
from ajet_hpc.server.request_policy import check_chat_fields
from ajet_hpc.server.responses_api import ResponsesRequest, stream_events, to_chat, to_response

router = APIRouter()


def _ctx(request: Request):
    return request.app.state.ctx


def _authorization(request: Request) -> str | None:
    """The Authorization header as the gate read it (``gate.AUTHORIZATION``); from the headers otherwise.
    Not a FastAPI ``Header`` parameter: solving it cost a tenth of a begin/end call."""
    scope = request.scope
    return scope[AUTHORIZATION] if AUTHORIZATION in scope else request.headers.get("authorization")


def _json(model: BaseModel) -> Response:
    """A model answered as JSON directly: FastAPI's ``jsonable_encoder`` walks every field in Python first
    (a third of an episode begin)."""
    return Response(model.model_dump_json(), media_type="application/json")


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ctx = _ctx(request)
    return JSONResponse(
        {
            "status": "ok",
            "server": ctx.name,
            "job_id": ctx.job.job_id,
            "state": ctx.state,
            "reason": ctx.reason,
            "step": ctx.step,
            "policy_version": ctx.engine.policy_version,
        }
    )


@router.get("/v1/status")
async def status(request: Request) -> p.ServerStatus:
    ctx = _ctx(request)
    authorize_run_call(ctx.job.secret, _authorization(request))
    counts = ctx.episodes.counts
    return p.ServerStatus(
        server=ctx.name,
        model=ctx.name,
        engine=ctx.engine.name,
        state=ctx.state,
        reason=ctx.reason,
        step=ctx.step,
        last_step_at=ctx.last_step_at,
        policy_version=ctx.engine.policy_version,
        episodes_open=ctx.episodes.open_count,
        episodes_finished=counts["finished"],
        episodes_aborted=counts["aborted"],
        episodes_dropped=counts["dropped"],
        requests_in_flight=ctx.service.in_flight,
        requests_served=ctx.service.served,
        dropped_recent=list(ctx.episodes.dropped_recent),
    )


@router.post("/v1/episodes")
async def begin(request: Request, body: p.BeginEpisodeRequest):
    ctx = _ctx(request)
    authorize_run_call(ctx.job.secret, _authorization(request))
    await ctx.admission.wait()  # a strictly on-policy trainer is stepping
    if ctx.state is ModelState.FINISHED:
        raise Conflict(f"training of {ctx.name} is finished: no new episodes", code="training_finished")
    sampling = eval_begin(ctx, body)  # an eval group's episode: in the open round, sampled as it says
    episode = ctx.episodes.begin(body.task_id, body.group, body.metadata, body.repeat)
    episode.sampling = sampling
    token = issue_episode_token(ctx.job.secret, episode.episode_id, ctx.name, ctx.settings.token_ttl_s)
    base = ctx.public_url or str(request.base_url).rstrip("/")
    return _json(
        p.BeginEpisodeResponse(
            episode_id=episode.episode_id,
            base_url=f"{base}/episodes/{episode.episode_id}/v1",
            api_key=token,
            model=ctx.name,
            policy_version=ctx.engine.policy_version,
            expires_at=episode.started_at + ctx.settings.token_ttl_s,
        )
    )


@router.get("/v1/episodes/ended")
async def ended(request: Request, group: str) -> p.EndedEpisodes:
    """The keys of ``group`` this server ended, with their recorded results: a resuming client commits
    them instead of running them again."""
    ctx = _ctx(request)
    authorize_run_call(ctx.job.secret, _authorization(request))
    unwritten = ctx.recorder.unwritten_ids()
    return p.EndedEpisodes(
        group=group,
        ended=[
            p.EndedEpisode(
                task_id=key[1],
                repeat=key[2],
                episode_id=record.episode_id,
                reward=record.reward,
                ended_at=record.ended_at,
            )
            for key, record in ctx.episodes.ended_keys(group)
            if record.episode_id not in unwritten  # not in the store yet: not for a client to commit
        ],
    )


@router.get("/v1/episodes/{episode_id}")
async def show(request: Request, episode_id: str, timelines: bool = False):
    ctx = _ctx(request)
    authorize_run_call(ctx.job.secret, _authorization(request))
    episode = ctx.episodes.lookup(episode_id)
    out = episode.summary().model_dump()
    if timelines:
        out["timelines"] = [timeline.to_dict() for timeline in episode.timelines]
    return out


@router.post("/v1/episodes/{episode_id}/end")
async def end(request: Request, episode_id: str, body: p.EndEpisodeRequest):
    ctx = _ctx(request)
    authorize_run_call(ctx.job.secret, _authorization(request))
    beyond = body.beyond_limit(ctx.settings.max_abs_reward)  # before anything is recorded
    if beyond is not None:
        raise BadRequest(beyond[1], param=beyond[0], code="reward_out_of_range")
    summary = ctx.episodes.end(
        episode_id, body.reward, body.task_id, body.turn_rewards, body.metadata, body.group, body.repeat
    )
    if not await ctx.recorder.written():
        # Answer once the episode is committed in the server store: a client commits its result only
        # after this answer, so whatever a client holds, a restarted server knows too (exactly once). A
        # retried end (a duplicate) waits as well: its first answer may have been this 503.
        raise Unavailable(
            f"episode {episode_id} ended, but the server could not write it to its store yet (disk full? see "
            "the server's log); it keeps the episode and retries: end it again later",
            code="store_unavailable",
        )
    return _json(summary)


@router.post("/v1/episodes/{episode_id}/abort")
async def abort(request: Request, episode_id: str, body: p.AbortEpisodeRequest):
    ctx = _ctx(request)
    authorize_run_call(ctx.job.secret, _authorization(request))
    return _json(ctx.episodes.abort(episode_id, body.reason).summary())


def _episode(request: Request, episode_id: str | None):
    ctx = _ctx(request)
    claims = authorize_episode_call(ctx.job.secret, _authorization(request), episode_id, ctx.name)
    return ctx, ctx.episodes.get_open(claims.episode_id)


def _begin_call(episode: Episode) -> None:
    episode.calls_in_flight += 1


def _end_call(episode: Episode) -> None:
    """A call is over: the episode's idle clock restarts from now."""
    episode.calls_in_flight -= 1
    episode.last_activity = time.monotonic()


async def _chat(request: Request, body: p.ChatCompletionRequest, episode_id: str | None):
    ctx, episode = _episode(request, episode_id)
    check_chat_fields(body)
    body = with_sampling(body, episode)
    _begin_call(episode)
    if not body.stream:
        try:
            answer = await ctx.service.chat(body, episode)
        finally:
            _end_call(episode)
        return _json(answer)
    try:
        plan = await ctx.service.chat_plan(body, episode)  # errors before the stream starts are 4xx
    except BaseException:
        _end_call(episode)
        raise
    stream = ctx.service.chat_stream(body, episode, plan)
    return StreamingResponse(_end_call_after(stream, episode), media_type="text/event-stream")


async def _end_call_after(stream: AsyncIterator[str], episode: Episode) -> AsyncIterator[str]:
    try:
        async for event in stream:
            yield event
    finally:
        _end_call(episode)


async def _completion(request: Request, body: p.CompletionRequest, episode_id: str | None):
    ctx, episode = _episode(request, episode_id)
    if body.stream:
        raise BadRequest(
            "stream is not supported on /v1/completions; use /v1/chat/completions", param="stream"
        )
    body = with_sampling(body, episode)
    _begin_call(episode)
    try:
        return await ctx.service.completion(body, episode)
    finally:
        _end_call(episode)


@router.post("/v1/chat/completions")
async def chat(request: Request, body: p.ChatCompletionRequest):
    return await _chat(request, body, None)


@router.post("/episodes/{episode_id}/v1/chat/completions")
async def episode_chat(request: Request, episode_id: str, body: p.ChatCompletionRequest):
    return await _chat(request, body, episode_id)


async def _responses(request: Request, body: ResponsesRequest, episode_id: str | None):
    ctx, episode = _episode(request, episode_id)
    chat_request = with_sampling(to_chat(body), episode)
    _begin_call(episode)
    try:
        answer = await ctx.service.chat(chat_request, episode)
    finally:
        _end_call(episode)
    response = to_response(body, answer)
    if body.stream:
        return StreamingResponse(iter(list(stream_events(response))), media_type="text/event-stream")
    return JSONResponse(response)


@router.post("/v1/responses")
async def responses(request: Request, body: ResponsesRequest):
    return await _responses(request, body, None)


@router.post("/episodes/{episode_id}/v1/responses")
async def episode_responses(request: Request, episode_id: str, body: ResponsesRequest):
    return await _responses(request, body, episode_id)


@router.post("/v1/completions")
async def completions(request: Request, body: p.CompletionRequest):
    return await _completion(request, body, None)


@router.post("/episodes/{episode_id}/v1/completions")
async def episode_completions(request: Request, episode_id: str, body: p.CompletionRequest):
    return await _completion(request, body, episode_id)


@router.get("/v1/models")
@router.get("/episodes/{episode_id}/v1/models")
async def models(request: Request, episode_id: str | None = None) -> p.ModelList:
    ctx = _ctx(request)
    try:
        authorize_run_call(ctx.job.secret, _authorization(request))
    except AuthError:
        authorize_episode_call(ctx.job.secret, _authorization(request), episode_id, ctx.name)
    card = p.ModelCard(id=ctx.name, created=int(ctx.job.started_at), policy_version=ctx.engine.policy_version)
    return p.ModelList(data=[card])
