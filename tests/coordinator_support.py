"""A coordinator over a real engine, fed finished episodes straight into its collector, as the server's
recorder hands them (tests/component: test_coordinator_overlap, test_weight_sync)."""

from __future__ import annotations

from pathlib import Path

from support import topology_dict

from ajet_hpc.config import ServingConfig, load_topology
from ajet_hpc.server.app import ServerContext
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.tracking import ContextTracker
from ajet_hpc.trainer.coordinator import Coordinator

SECRET = "c0" * 32
REPEATS = 2  # one task group of two episodes per batch


def finished(tokenizer, task: str, repeat: int, version: int) -> Episode:
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


def coordinator_for(tmp_path: Path, engine, **trainer) -> Coordinator:
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
    ctx = ServerContext(
        name="policy", engine=engine, settings=ServingConfig(max_model_len=1024), secret=SECRET
    )
    return Coordinator(ctx, server, engine.model_path, tmp_path / "run", on_slurm=False)
