"""Assembling a server job before it serves: from its topology entry to an engine and the models it hosts,
each a `ModelContext` with its episode store and its trainer (a `Coordinator` with a `TrainerSetup`), all
decided here once, by one assembly for a plain server and a server with adapters alike.

``server.process.serve`` binds the port, calls `assemble`, then runs and tears down; nothing is set on a
context or the coordinator after this returns except the server's lifecycle callbacks (``on_finished``,
``on_failed``). The weight-sync decision (`sync_plan.decide`) is taken here, from the trainer config, the
placement and the engine kind, and goes to the engine's settings and to the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ajet_hpc.config import ServerConfig, Topology
from ajet_hpc.config.evaluation import EvalConfig, eval_group_name, evaluated_model
from ajet_hpc.config.placement import Placement, select_devices, visible_devices
from ajet_hpc.engine.adapter import adapter_rank, write_initial_adapter
from ajet_hpc.engine.base import Engine
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.select import create_engine, resolve_kind
from ajet_hpc.engine.shared import SharedModel
from ajet_hpc.engine.transformers_engine import job_cpus
from ajet_hpc.engine.vllm_engine import BARE_BASE, VllmEngine
from ajet_hpc.server.app import MODEL_PREFIX
from ajet_hpc.server.context import JobContext, ModelContext
from ajet_hpc.server.recorder import EpisodeRecorder
from ajet_hpc.slurm.environment import JobEnvironment
from ajet_hpc.storage import rendezvous, task_ends
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator.evaluation import EvalPlan, EvalRounds
from ajet_hpc.trainer.coordinator.experiment_trackers import Trackers
from ajet_hpc.trainer.coordinator.host import TrainerSetup
from ajet_hpc.trainer.coordinator.loop import Coordinator
from ajet_hpc.trainer.coordinator.recovery import stored_summaries
from ajet_hpc.trainer.protocol.sync_plan import SyncPlan, decide

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """Where this server process runs: its job, and the URL agents reach it at."""

    environment: JobEnvironment
    public_url: str


def assemble(
    run: RunDir, topology: Topology, config: ServerConfig, job: Job
) -> tuple[Engine, list[ModelContext]]:
    """The server job's engine, built (not started), and one context per model it hosts, each with its
    store open and its trainer attached: a plain server is one model at the job's URL; a server with
    several models (``servers[].models``) has one per model, at ``<url>/m/<name>``, each seeing the one vLLM
    engine through a `SharedModel`.

    Shows the engine only its GPUs (this process's ``CUDA_VISIBLE_DEVICES``) and keeps the job step's
    environment as it was for the trainer's ranks."""
    parts, kind = _job_parts(run, topology, config, job)
    models = config.hosted()
    engine, views = _engine(parts, kind, config)
    context = JobContext(engine=engine, secret=run.read_secret(), job_id=job.environment.job_id)
    contexts = []
    for model in models:
        own = dataclasses.replace(parts, placement=model.placement_plan())  # its trainer's ranks
        url = job.public_url if len(models) == 1 else f"{job.public_url}{MODEL_PREFIX}{model.name}"
        sync = decide(model.trainer, own.placement, kind)
        contexts.append(model_context(own, model, context, views.get(model.name), sync, url))
    return engine, contexts


def _engine(
    parts: _Parts, kind: Literal["vllm", "transformers"], config: ServerConfig
) -> tuple[Engine, dict[str, Engine]]:
    """The job's engine, and the view of it each model sees where the engine serves adapters (a model of
    full weights alone on its job sees the engine itself, and its engine takes its weight-sync backend).
    A vLLM engine with adapters serves each LoRA model's version-0 adapter (written here), each frozen
    one's folder and the bare base, one path whether the job has one model or several; the transformers
    engine serves a lone LoRA model's adapter through peft (`lora_settings`)."""
    if len(config.models) == 1 and (kind == "transformers" or not config.lora_models()):
        sync = decide(config.trainer, parts.placement, kind)
        settings = engine_settings(config, parts.placement, kind, sync)
        settings.update(lora_settings(config, parts.model_path))
        return create_engine(kind, parts.model_path, **settings), {}
    if kind != "vllm":
        raise SystemExit(
            f"server {config.name} has adapters: it needs the vllm engine, which is not installed"
        )
    settings = engine_settings(config, parts.placement, kind, decide(None, parts.placement, kind))
    trained = {
        name: str(write_initial_adapter(parts.model_path, lora, _node_local(f"ajet-{name}-lora-v0-")))
        for name, lora in config.lora_models()
    }
    frozen = {name: str(Path(folder).expanduser().resolve()) for name, folder in config.frozen_adapters()}
    limit = config.lora_rank_limit([adapter_rank(Path(folder)) for folder in frozen.values()])
    adapters = {**trained, **frozen}
    settings.update(lora_adapters=tuple(adapters.items()), max_loras=config.lora_slots(), max_lora_rank=limit)
    engine = create_engine(kind, parts.model_path, **settings)
    assert isinstance(engine, VllmEngine)
    views: dict[str, Engine] = {}
    for name, lora in config.lora_models():
        log.info("LoRA rank %d on %s: the engine serves adapter version 0 (the base)", lora.rank, name)
    for model in config.hosted():
        what = f"the frozen adapter {frozen[model.name]}" if model.name in frozen else "the bare base"
        what = "a LoRA adapter" if model.name in trained else what
        log.info(
            "model %s: %s of %s (%s)",
            model.name,
            what,
            config.engine.model,
            "trains" if model.trainer else "serves",
        )
        views[model.name] = SharedModel(engine, model.name if model.name in adapters else BARE_BASE)
    return engine, views


def _job_parts(
    run: RunDir, topology: Topology, server: ServerConfig, job: Job
) -> tuple[_Parts, Literal["vllm", "transformers"]]:
    """What every model of the server job shares, its placement logged and the engine shown only its
    GPUs; and the engine's kind."""
    placement = server.placement_plan()
    for line in placement.describe():
        log.info("placement: %s", line)
    step_env = bind_engine_gpus(placement, os.environ)
    model_path = resolve_model(server.engine.model, run.models_dir)
    return _Parts(run, topology, job, placement, model_path, step_env), resolve_kind(server.engine.kind)


@dataclass(frozen=True)
class _Parts:
    """What every model of a server job shares."""

    run: RunDir
    topology: Topology
    job: Job
    placement: Placement
    model_path: Path
    step_env: dict[str, str]


def model_context(
    parts: _Parts,
    config: ServerConfig,
    job: JobContext,
    view: Engine | None,
    sync: SyncPlan,
    url: str,
) -> ModelContext:
    """One model's context: its store open, its ended episodes restored, its trainer attached."""
    run, topology = parts.run, parts.topology
    # group commit: episodes ending together share one fsync (docs/storage.md)
    recorder = EpisodeRecorder.from_config(run.server_store(config.name), config.models[0].store)
    ctx = ModelContext(
        name=config.name, job=job, settings=config.serving, recorder=recorder, view=view, public_url=url
    )
    stored = stored_summaries(recorder.path)  # read once the writer holds the store's lease
    restored = ctx.episodes.restore_ended(stored)
    if restored:
        log.info("%d episode keys ended before this start (from %s)", restored, recorder.path)
    ctx.eval_configs = eval_configs(topology, config.name)
    if config.trainer is not None:
        ctx.evaluation = eval_rounds(ctx, topology, config, run)
        engine = ctx.engine
        setup = TrainerSetup(
            server=config,
            model_path=parts.model_path,
            run=run,
            on_slurm=parts.job.environment.on_slurm,
            placement=parts.placement,
            sync=sync,
            receiver=engine if sync.in_memory and isinstance(engine, VllmEngine) else None,
            mix=topology.mix_of(config.name),
            repeats_of=topology.repeats_feeding(config.name),
            ended_count=ctx.episodes.ended_count,
            sources_ended=lambda: sources_ended(run, topology, config.name),
            rank_env=parts.step_env,
            stored=stored,
            trackers=trackers_of(run, topology, config.name),
            evaluation=ctx.evaluation,
        )
        ctx.attach_trainer(Coordinator(ctx, setup))
    partners = topology.co_trained(config.name)
    if partners:
        ctx.partners_done = lambda: all(
            (found := rendezvous.read(run.rendezvous_file(name))) is not None
            and found.state in ("trained", "finished")
            for name in partners
        )
    return ctx


def eval_configs(topology: Topology, model: str) -> dict[str, EvalConfig]:
    """Eval group -> its eval settings, for every eval group whose agents use ``model``."""
    return {
        name: group.eval
        for name, group in ((eval_group_name(c.name), c) for c in topology.clients)
        if group.eval is not None and model in group.servers
    }


def eval_rounds(
    ctx: ModelContext, topology: Topology, config: ServerConfig, run: RunDir
) -> EvalRounds | None:
    """The eval rounds that follow ``config``'s steps (`trainer.coordinator.evaluation`), None when no
    group's eval block names this model."""
    plans = [
        EvalPlan(eval_group_name(c.name), c.name, c.eval, c.eval.array)
        for c in topology.clients
        if c.eval is not None and evaluated_model(topology, c) == config.name
    ]
    if not plans or config.trainer is None:
        return None
    return EvalRounds(
        config.name,
        plans,
        config.trainer.total_steps,
        run.metrics_file,
        ended_keys=ctx.episodes.ended_keys,
        written=ctx.recorder.written,
        trackers=lambda: ctx.coordinator.trackers if ctx.coordinator is not None else None,
    )


def engine_settings(
    config: ServerConfig, placement: Placement, kind: Literal["vllm", "transformers"], sync: SyncPlan
) -> dict[str, Any]:
    """The engine's settings from the server's fields: the ``vllm`` block unless the engine is
    transformers (then its threads: ``cpus``); the vLLM engine is built with the transfer backend of the
    sync plan."""
    vllm = config.engine.vllm
    common: dict[str, Any] = {"max_model_len": config.serving.max_model_len, "dtype": vllm.dtype}
    if kind == "transformers":  # torch's threads: the server's CPUs, also where no Slurm grants them
        return {**common, "cpu_threads": min(config.cpus, job_cpus())}
    return {
        **common,
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        "max_num_seqs": vllm.max_num_seqs,
        "enable_prefix_caching": vllm.enable_prefix_caching,
        "enforce_eager": vllm.enforce_eager,
        "tensor_parallel_size": placement.tensor_parallel,
        "enable_sleep_mode": placement.mode == "colocate",
        "weight_transfer_backend": sync.backend,
    }


def lora_settings(config: ServerConfig, model_path: Path) -> dict:
    """The transformers engine with ``trainer.lora``: it serves the adapter through peft, starting with the
    version-0 one written here to node-local storage (`ajet_hpc.engine.adapter`)."""
    lora = config.trainer.lora if config.trainer is not None else None
    if lora is None:
        return {}
    folder = _node_local(f"ajet-{config.name}-lora-v0-")
    settings: dict[str, Any] = {"lora_adapter": str(write_initial_adapter(model_path, lora, folder))}
    log.info("LoRA rank %d on %s: the engine serves adapter version 0 (the base)", lora.rank, config.name)
    return settings


def _node_local(prefix: str) -> Path:
    """A new folder on node-local storage (the job's ``SLURM_TMPDIR``, else the system's temp dir)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("SLURM_TMPDIR")))


def bind_engine_gpus(placement: Placement, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Show the engine (this process and the vLLM workers it spawns) only its GPUs; returns the job step's
    environment as it was, for the trainer's ranks."""
    step_env = dict(environ)
    if placement.on_gpu:
        visible = visible_devices(step_env, placement.gpus_per_node)
        environ["CUDA_VISIBLE_DEVICES"] = select_devices(visible, placement.engine_gpus, "the engine")
    return step_env


def sources_ended(run: RunDir, topology: Topology, server: str) -> str | None:
    """For the coordinator: a description once every client task feeding ``server`` has ended its work."""
    feeding = task_ends.feeding(run, topology, server)
    return feeding.describe() if feeding.all_ended else None


def trackers_of(run: RunDir, topology: Topology, server: str) -> Trackers | None:
    """The trackers beyond metrics.jsonl (``run.trackers``), None when metrics.jsonl is the only one."""
    if len(topology.run.trackers) <= 1:
        return None
    return Trackers(run.root, topology.run.name, server, topology.run.trackers)
