"""Agent for ``builtin:propose_solve``: the proposer writes a sum, the solver answers it.

The group must use two servers named ``proposer`` and ``solver`` (``configs/two_models.yaml``). The
outcome rewards each model on its own terms (``Outcome.rewards``), so each server trains on its own
reward while the episode is one story.
"""

from __future__ import annotations

from ajet_hpc.environments.arithmetic.tasks import reward as answer_reward
from ajet_hpc.environments.episode import EpisodeContext, Outcome
from ajet_hpc.environments.propose_solve.tasks import parse_proposal, proposal_form


def solve(ctx: EpisodeContext) -> Outcome:
    proposer, solver = ctx.models["proposer"], ctx.models["solver"]
    proposal = proposer.client().chat.completions.create(
        model=proposer.name,
        messages=[{"role": "user", "content": "Write a sum of two digits:"}],
        max_tokens=4,
        temperature=1.0,
    )
    text = proposal.choices[0].message.content or ""
    digits = parse_proposal(text)
    a, b = digits if digits is not None else ctx.task.data["fallback"]
    answer = solver.client().chat.completions.create(
        model=solver.name,
        messages=[{"role": "user", "content": f"{a}+{b}="}],
        max_tokens=2,
        temperature=1.0,
    )
    solver_reward = answer_reward(answer.choices[0].message.content or "", str((a + b) % 10))
    proposer_reward = proposal_form(text) + (0.25 if digits is not None and solver_reward == 1.0 else 0.0)
    return Outcome(
        reward=solver_reward,
        rewards={"proposer": proposer_reward, "solver": solver_reward},
        metadata={"proposal": text, "well_formed": digits is not None},
    )
