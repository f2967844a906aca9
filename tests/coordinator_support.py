"""A coordinator over a real engine, fed finished episodes straight into its collector, as the server's
recorder hands them (tests/component: test_coordinator_overlap, test_weight_sync). Its host has a real
server store (the steps are recorded there, a restart reads it back)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from support import topology_dict
from transformers import PreTrainedTokenizerBase

from ajet_hpc.config import ServingConfig, load_topology
from ajet_hpc.engine.base import Engine
from ajet_hpc.engine.transformers_engine import TransformersEngine
from ajet_hpc.engine.vllm_engine import VllmEngine
from ajet_hpc.server.context import JobContext, ModelContext
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.server.recorder import EpisodeRecorder
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.tracking import ContextTracker
from ajet_hpc.trainer.coordinator.host import TrainerSetup
from ajet_hpc.trainer.coordinator.loop import Coordinator
from ajet_hpc.trainer.protocol.sync_plan import decide

SECRET = "c0" * 32
REPEATS = 2  # one task group of two episodes per batch


def finished(tokenizer: PreTrainedTokenizerBase, task: str, repeat: int, version: int) -> Episode:
    """A finished episode of one call served by policy ``version``, rewards unequal within its task."""
    tracker = ContextTracker(tokenizer)
    plan = tracker.build_prompt([{"role": "user", "content": f"{task}?"}])
    ids = tokenizer(f"{repeat}<|im_end|>", add_special_tokens=False)["input_ids"]
    reply = {"role": "assistant", "content": str(repeat)}
    tracker.record(plan, ids, [-0.5] * len(ids), reply, "stop", version)
    episode = Episode(episode_id=f"{task}-r{repeat}", model="policy", tracker=tracker)
    episode.task_id, episode.group, episode.repeat, episode.state = task, "math", repeat, FINISHED
    episode.reward = float(repeat)
    return episode


def coordinator_for(
    tmp_path: Path, engine: Engine, rank_env: Mapping[str, str] | None = None, **trainer: object
) -> Coordinator:
    """A coordinator of server ``policy`` hosted by a `ModelContext` over ``engine`` and its server store,
    its run folder ``tmp_path/run``, its weight sync decided as the server decides it; ``rank_env``: the
    ranks' environment (None: this process's)."""
    data = topology_dict(tmp_path / "run")
    data["servers"][0]["trainer"] = {
        "ranks": 1,
        "zero_stage": 2,
        "tasks_per_batch": 1,
        "repeats": REPEATS,
        "skip_equal_groups": False,
        "weight_sync": "disk",
        **trainer,
    }
    server = load_topology(data).servers[0]
    run = RunDir(tmp_path / "run")
    run.data_dir.mkdir(parents=True, exist_ok=True)
    ctx = ModelContext(
        name="policy",
        job=JobContext(engine=engine, secret=SECRET),
        settings=ServingConfig(max_model_len=1024),
        recorder=EpisodeRecorder(run.server_store("policy")),
    )
    assert isinstance(engine, VllmEngine | TransformersEngine), engine
    kind: Literal["vllm", "transformers"] = "vllm" if isinstance(engine, VllmEngine) else "transformers"
    placement = server.placement_plan()
    sync = decide(server.trainer, placement, kind)
    setup = TrainerSetup(
        server=server,
        model_path=engine.model_path,
        run=run,
        on_slurm=False,
        placement=placement,
        sync=sync,
        receiver=engine if sync.in_memory and isinstance(engine, VllmEngine) else None,
        rank_env=rank_env,
    )
    return Coordinator(ctx, setup)


def close_store(coordinator: Coordinator) -> None:
    """Close the server store of ``coordinator``'s host, as the server does when it stops
    (``server.app.running``): a next server process on the same run opens it again."""
    assert isinstance(coordinator.host, ModelContext)
    coordinator.host.recorder.close()
