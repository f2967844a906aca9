"""``ajet-hpc eval RUN [--step N] [--group G]``: evaluate a saved checkpoint offline, as a round would.

The checkpoint of step ``N`` (default: the newest) of the model that group ``G``'s eval block follows is
exported (``ajet-hpc export``, merged) to ``RUN/eval/<model>-step-N/model``; a server that only serves it
starts in this process (the same assembly, engine, recording and eval sampling as a server job), the
group's agent runs every held-out task ``samples_per_task`` times against it (the eval group's own code,
``client.eval_runner``), and the episodes are scored from the server store of that folder, which stays
there to read (``ajet-hpc inspect RUN/eval/<model>-step-N``). It prints the table of an eval round:
mean reward, pass@k, per task. Running it again on the same step reuses the episodes already stored.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ajet_hpc.algo.pass_at_k import RoundScore, score_round
from ajet_hpc.client.eval_runner import EvalGroupTask
from ajet_hpc.config import ClientGroupConfig, ConfigError, Topology
from ajet_hpc.config.evaluation import eval_group_name, evaluated_model
from ajet_hpc.offline.model_export import ExportError, checkpoint_tag, export
from ajet_hpc.server.app import create_app
from ajet_hpc.server.assembly import Job, assemble
from ajet_hpc.server.process import Heartbeat, uvicorn_server
from ajet_hpc.slurm import environment
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.rundir import RunDir, RunDirError
from ajet_hpc.tracking.episode import EpisodeState, split_round_task_id
from ajet_hpc.trainer.protocol.work_dir import WorkDir

log = logging.getLogger(__name__)

SERVER_WAIT_S = 900.0
"""Longest the eval waits for its server to start (the engine loads the exported model)."""


class EvalError(Exception):
    """The run has no such eval group or checkpoint, or the group cannot be evaluated offline."""


def eval_target(topology: Topology, group: str | None) -> tuple[ClientGroupConfig, str]:
    """The client group with an eval block (``group``, or the run's only one) and the model it follows."""
    with_eval = [c for c in topology.clients if c.eval is not None]
    names = ", ".join(c.name for c in with_eval) or "(none)"
    if group is None:
        if len(with_eval) != 1:
            raise EvalError(
                f"the run has {len(with_eval)} client groups with an eval block ({names}): "
                "name one with --group"
            )
        chosen = with_eval[0]
    else:
        found = [c for c in with_eval if group in (c.name, eval_group_name(c.name))]
        if not found:
            raise EvalError(f"no client group {group!r} with an eval block; groups with one: {names}")
        chosen = found[0]
    model = evaluated_model(topology, chosen)
    if model is None:
        raise EvalError(f"none of group {chosen.name!r}'s servers trains: there is no checkpoint to evaluate")
    others = [name for name in chosen.servers if name != model]
    if others:
        raise EvalError(
            f"group {chosen.name!r} also uses {', '.join(others)}: offline eval serves one model; evaluate "
            "it during training (its eval rounds)"
        )
    return chosen, model


def recount(store: Path, group: str, step: int) -> dict[str, list[float]]:
    """Held-out task id -> rewards of the finished episodes of ``group``'s round at ``step`` in a server
    store (the first episode of each key)."""
    rewards: dict[str, list[float]] = {}
    seen: set[tuple[str, object]] = set()
    if not store.exists():
        return rewards
    with EpisodeReader(store) as reader:
        for s in reader.summaries():
            parsed = split_round_task_id(s.get("task_id") or "")
            repeat = (s.get("metadata") or {}).get("repeat")
            if s["group"] != group or s["state"] != EpisodeState.FINISHED or parsed is None:
                continue
            if parsed[0] != step or (s["task_id"], repeat) in seen:
                continue
            seen.add((s["task_id"], repeat))
            rewards.setdefault(parsed[1], []).append(float(s["reward"]))
    return rewards


def evaluate(run_dir: Path, step: int | None = None, group: str | None = None) -> tuple[str, int, RoundScore]:
    """Evaluate the checkpoint (see the module doc); returns (model, step, score)."""
    run = RunDir(Path(run_dir))
    if not run.exists():
        raise EvalError(f"{run.root} is not a run directory (no {run.topology_file.name})")
    topology = run.load_topology()
    parent, model = eval_target(topology, group)
    assert parent.eval is not None
    _, at = checkpoint_tag(WorkDir(run.trainer_dir(model)), step)
    scratch = RunDir(run.root / "eval" / f"{model}-step-{at}")
    folder = scratch.root / "model"
    if not (folder / "config.json").is_file():
        partial = folder.with_name("model.partial")
        if partial.exists():
            _remove_tree(partial)
        export(run.root, partial, model=model, step=at)
        partial.rename(folder)
    scratch.prepare(topology, force=True)  # its own secret, stores and logs; the run's topology
    view = topology.server(model)  # the model alone on its job's engine, served frozen from the export
    served = view.model_copy(
        update={
            "engine": view.engine.model_copy(update={"model": str(folder)}),
            "models": [view.models[0].model_copy(update={"trainer": None})],
        }
    )
    eval_group = topology.client(eval_group_name(parent.name)).model_copy(
        update={"array": 1, "server_wait_s": SERVER_WAIT_S}
    )
    with _serving(scratch, topology, served):
        worker = EvalGroupTask(scratch, topology, eval_group, 0)
        try:
            worker.connect(model)
            worker.run_round(at, report=False)
        finally:
            worker.store.close()
    rewards = recount(scratch.server_store(model), eval_group.name, at)
    return model, at, score_round(rewards, parent.eval.success_threshold, parent.eval.samples_per_task)


@contextmanager
def _serving(run: RunDir, topology: Topology, config) -> Iterator[None]:
    """A server of ``config`` (no trainer) in this process on a free local port, published in ``run``'s
    rendezvous until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    job = environment.current()
    _, (ctx,) = assemble(run, topology, config, Job(job, public_url=f"http://127.0.0.1:{port}"))
    server = uvicorn_server(create_app(ctx), config)
    record = rendezvous.Rendezvous(
        name=ctx.name,
        url=ctx.public_url,
        host="127.0.0.1",
        port=port,
        pid=os.getpid(),
        job_id=job.job_id,
        node=job.node,
        started_at=ctx.job.started_at,
    )
    heartbeat = Heartbeat(run.rendezvous_file(ctx.name), record, server, ctx)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="eval-server", daemon=True)
    thread.start()
    heartbeat.start()
    try:
        yield
    finally:
        heartbeat.stop()
        server.should_exit = True
        thread.join(timeout=120)
        sock.close()
        run.rendezvous_file(ctx.name).unlink(missing_ok=True)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def table(model: str, step: int, score: RoundScore) -> str:
    """The eval table: the round's figures, then one line per task."""
    ks = ", ".join(f"pass@{k} {v:.3f}" for k, v in score.pass_at.items())
    mean = "-" if score.reward_mean is None else f"{score.reward_mean:.3f}"
    lines = [
        f"{model} step {step}: {score.episodes} episodes of {len(score.tasks)} tasks, reward {mean}, {ks}"
    ]
    lines.append(f"{'task':<24} {'n':>3} {'passed':>6} {'reward':>7}")
    for task, s in sorted(score.tasks.items()):
        lines.append(f"{task:<24} {s.samples:>3} {s.passed:>6} {s.reward_mean:>7.3f}")
    return "\n".join(lines)


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run directory")
    parser.add_argument("--step", type=int, help="the checkpoint's step; default: the newest committed one")
    parser.add_argument("--group", help="the client group whose eval block to run; default: the only one")
    return parser


def main(argv: list[str] | None = None, prog: str = "ajet-hpc eval") -> int:
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        model, step, score = evaluate(args.run, args.step, args.group)
    except (EvalError, ExportError, ConfigError, RunDirError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    print(table(model, step, score))
    return 0
