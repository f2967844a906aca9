"""The eval side of a server's API: eval array tasks learn of rounds and report them done; eval episodes
are marked and sampled with their group's settings (``trainer/coordinator/evaluation.py`` holds the rounds).

- ``GET /v1/eval/round?group=G&index=I``: the step of the round array task ``I`` of eval group ``G`` has to
  run; waits up to ``ROUND_POLL_S`` for one; ``finished`` once training is over.
- ``POST /v1/eval/done``: that task ran its share of the round.
- A begin of an episode of an eval group must name the round's step (``metadata.eval_step``) and use a
  round task id (``s<step>/<task>``); a begin of any other group must not set ``eval_step``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from ajet_hpc.server import http_schemas as p
from ajet_hpc.server.auth import authorize_run_call
from ajet_hpc.server.episodes import Episode
from ajet_hpc.server.errors import BadRequest, Conflict, NotFound
from ajet_hpc.server.gate import AUTHORIZATION
from ajet_hpc.tracking.episode import EVAL_STEP, split_round_task_id
from ajet_hpc.trainer.coordinator.evaluation import EvalPlan, EvalRounds

router = APIRouter()


def _ctx_authorized(request: Request):
    ctx = request.app.state.ctx
    scope = request.scope
    header = scope[AUTHORIZATION] if AUTHORIZATION in scope else request.headers.get("authorization")
    authorize_run_call(ctx.job.secret, header)
    return ctx


def _plan(ctx: Any, group: str) -> tuple[EvalRounds, EvalPlan]:
    rounds: EvalRounds | None = ctx.evaluation
    plan = rounds.plan_of(group) if rounds is not None else None
    if rounds is None or plan is None:
        raise NotFound(
            f"model {ctx.name} runs no eval rounds of group {group!r}", param="group", code="no_eval_rounds"
        )
    return rounds, plan


@router.get("/v1/eval/round")
async def eval_round(request: Request, group: str, index: int) -> p.EvalRound:
    ctx = _ctx_authorized(request)
    rounds, plan = _plan(ctx, group)
    if not 0 <= index < plan.array:
        raise BadRequest(
            f"index {index} is outside eval group {group!r} (array of {plan.array})", param="index"
        )
    step = await rounds.wait_round(group, index)
    return p.EvalRound(group=group, step=step, finished=step is None and rounds.finished)


@router.post("/v1/eval/done")
async def eval_done(request: Request, body: p.EvalDoneRequest) -> p.EvalDone:
    ctx = _ctx_authorized(request)
    rounds, plan = _plan(ctx, body.group)
    if body.index >= plan.array:
        raise BadRequest(
            f"index {body.index} is outside eval group {body.group!r} (array of {plan.array})", param="index"
        )
    return p.EvalDone(accepted=await rounds.report_done(body.group, body.index, body.step, body.episodes))


def eval_begin(ctx: Any, body: p.BeginEpisodeRequest) -> dict[str, Any] | None:
    """For a begin of an eval group's episode: its sampling settings (the episode's ``sampling``), after
    checking that it belongs to the open round of this model's rounds (409 ``eval_round_closed``
    otherwise). None for a training episode, which must not carry ``metadata.eval_step``."""
    config = ctx.eval_configs.get(body.group) if body.group is not None else None
    step = body.metadata.get(EVAL_STEP)
    if config is None or body.group is None:
        if step is not None:
            raise BadRequest(
                f"metadata.{EVAL_STEP} marks eval episodes; group {body.group!r} is not an eval group",
                param=f"metadata.{EVAL_STEP}",
            )
        return None
    parsed = split_round_task_id(body.task_id or "")
    if isinstance(step, bool) or not isinstance(step, int) or parsed is None or parsed[0] != step:
        raise BadRequest(
            f"an episode of eval group {body.group!r} needs metadata.{EVAL_STEP} (the round's step) and a "
            f"task id 's<step>/<task>' of that step (got {step!r} and {body.task_id!r})",
            param=f"metadata.{EVAL_STEP}",
        )
    rounds: EvalRounds | None = ctx.evaluation
    group: str = body.group  # an eval group's name (eval_configs has it)
    if rounds is not None and rounds.plan_of(group) is not None:
        current = rounds.open.get(group)
        if current is None or current.step != step:
            raise Conflict(
                f"the eval round of {body.group!r} at step {step} is not open "
                f"({'none is' if current is None else f'the one at step {current.step} is'})",
                code="eval_round_closed",
            )
    sampling: dict[str, Any] = {"temperature": config.temperature}
    if config.max_tokens is not None:
        sampling["max_tokens"] = config.max_tokens
    return sampling


def with_sampling(body: Any, episode: Episode) -> Any:
    """A model call's request with its eval episode's sampling settings in place of its own."""
    if not episode.sampling:
        return body
    update = dict(episode.sampling)
    if "max_tokens" in update and "max_completion_tokens" in type(body).model_fields:
        update["max_completion_tokens"] = None
    return body.model_copy(update=update)
