"""Swarm features on the dev Slurm cluster: two trainable models in one episode, mixed tasks by ratio."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from support import REPO, export, jobs_ended, ranks_trained_steps, run_module, wait_until

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.client_store import read_results
from ajet_hpc.storage.episode_store_reader import EpisodeReader

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]


def launch(config: str, run: Path, *overrides: str) -> dict[str, str]:
    done = run_module(
        "ajet_hpc.launch",
        str(REPO / "configs" / config),  # an absolute path stays as it is
        f"run.dir={run}",
        "cluster.backend=slurm",
        *overrides,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return {entry["name"]: entry["job_id"] for entry in json.loads((run / "jobs.json").read_text())}


def wait_for_the_end(jobs: dict[str, str], timeout_s: float) -> None:
    def over() -> bool:
        return all(
            s.state not in slurmcli.ACTIVE_STATES for job in jobs.values() for s in slurmcli.job_states([job])
        )

    wait_until(over, timeout_s, "every job of the run to end", poll_s=2)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_two_models_train_apart_on_shared_episodes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    steps = 3
    jobs = launch(
        "two_models.yaml",
        run,
        f"servers.proposer.trainer.total_steps={steps}",
        f"servers.solver.trainer.total_steps={steps}",
        "servers.proposer.trainer.tasks_per_batch=4",
        "servers.solver.trainer.tasks_per_batch=4",
        # two models' rewards and stores are the subject, not the engine: it loads in seconds
        "servers.proposer.engine=transformers",
        "servers.solver.engine=transformers",
    )
    try:
        assert set(jobs) == {"server-proposer", "server-solver", "clients-pairs"}

        def both_published() -> str | None:
            out = run_module("ajet_hpc.status", str(run)).stdout
            serving = [line for line in out.splitlines() if " training " in line and "policy v" in line]
            return out if len(serving) == 2 else None

        status = wait_until(
            both_published, 300, "both servers to train (python -m ajet_hpc.status)", poll_s=3
        )
        assert "server-proposer" in status and "server-solver" in status
        wait_for_the_end(jobs, 900)
    finally:
        subprocess.run(["scancel", *jobs.values()], check=False, capture_output=True)

    metrics = rows(run)
    for model in ("proposer", "solver"):
        mine = [row for row in metrics if row["model"] == model]
        assert [row["step"] for row in mine] == list(range(1, steps + 1)), model
        assert [row["policy_version"] for row in mine] == list(range(1, steps + 1)), model
        assert (run / "ckpt" / model / "ds" / "trainer_state.json").is_file()
        assert (run / "data" / f"{model}.h5").is_file()

    results = [
        r for path in sorted((run / "data" / "clients" / "pairs").glob("*.h5")) for r in read_results(path)
    ]
    assert results
    readers = {model: EpisodeReader(run / "data" / f"{model}.h5") for model in ("proposer", "solver")}
    try:
        checked = 0
        for result in results:
            assert set(result.episode_ids) == {"proposer", "solver"}
            for model, reader in readers.items():
                record = reader.episode(result.episode_ids[model])
                assert record.model == model and record.task_id == result.task_id
                assert record.reward == pytest.approx(result.rewards[model])
                assert len(record.timelines) == 1  # one call of this model per episode
            checked += 1
        differing = [r for r in results if r.rewards["proposer"] != r.rewards["solver"]]
        assert differing, "every episode rewarded both models alike: the per-model rewards are not exercised"
    finally:
        for reader in readers.values():
            reader.close()
    assert checked == len(results)


def test_two_adapters_of_one_server_resume_after_a_requeue(tmp_path: Path) -> None:
    """configs/propose_solve_lora.yaml on Slurm: one server job serves the proposer and the solver as two
    LoRA adapters of one base, each with its own trainer, and the agent addresses them by name as it does
    two servers; the bare base and a frozen adapter from a folder are more models of that server.
    ``scontrol requeue`` of that job mid-run: both adapters save the step they are at, the requeued job
    reloads both into its new engine before it serves, and every step of each adapter is trained and
    recorded exactly once. Both policy versions advance, each adapter's rewards are in the metrics, and
    each adapter exports on its own."""
    import yaml

    from ajet_hpc.config.lora import LoraConfig
    from ajet_hpc.engine.adapter import write_initial_adapter
    from ajet_hpc.engine.model_path import resolve_model
    from ajet_hpc.storage import rendezvous

    run = tmp_path / "run"
    steps = 8
    # an opponent that does not learn: an adapter folder of the base, served frozen beside the two
    base = resolve_model("builtin:tiny", tmp_path / "models")
    opponent = write_initial_adapter(base, LoraConfig(rank=8), tmp_path / "opponent")
    topology = yaml.safe_load((REPO / "configs" / "propose_solve_lora.yaml").read_text())
    topology["servers"][0]["models"].append({"name": "opponent", "trainer": None, "adapter": str(opponent)})
    config = tmp_path / "propose_solve_lora.yaml"
    config.write_text(yaml.safe_dump(topology))
    overrides = [
        f"servers.base.adapters.{name}.trainer.{key}={value}"
        for name in ("proposer", "solver")
        for key, value in (("total_steps", steps), ("tasks_per_batch", 4), ("save_every", 3))
    ]
    jobs = launch(str(config), run, "servers.base.time=30:00", *overrides)
    assert set(jobs) == {"server-base", "clients-pairs"}  # one server job for the four models

    def steps_of(model: str) -> list[int]:
        if not (run / "metrics.jsonl").is_file():
            return []
        return [row["step"] for row in rows(run) if row.get("model") == model and "step" in row]

    def server_log() -> str:
        return "".join(p.read_text() for p in sorted((run / "logs" / "server-base").glob("*_log.out")))

    try:
        wait_until(
            lambda: all(len(steps_of(m)) >= 2 for m in ("proposer", "solver")), 600, "2 steps of each adapter"
        )
        assert all(len(steps_of(m)) < steps for m in ("proposer", "solver")), "done before the requeue"
        subprocess.run(["scontrol", "requeue", jobs["server-base"]], check=True)
        wait_until(lambda: jobs_ended(*jobs.values()), 900, "the run to finish after the requeue")
    finally:
        subprocess.run(["scancel", *jobs.values()], check=False, capture_output=True)
    log = server_log()
    for model in ("proposer", "solver"):
        mine = [r for r in rows(run) if r.get("model") == model and "step" in r]
        assert steps_of(model) == list(range(1, steps + 1)), model  # every step recorded once
        assert [r["policy_version"] for r in mine] == list(range(1, steps + 1)), model
        assert all(r["weight_sync"] == "disk" and "reward_mean" in r for r in mine), model
        trained = ranks_trained_steps(run, model)
        assert sorted(trained) == list(range(1, steps + 1)) and set(trained.values()) == {1}, trained
        assert re.search(rf"resumed {model} at step [1-9]", log), model  # reloaded into the new engine
        assert f"{model} resumes from a checkpoint: new episodes wait" in log  # ... before it serves
        assert (run / "data" / f"{model}.h5").is_file()
        assert (run / "ckpt" / model / "ds" / "trainer_state.json").is_file()
        assert f"loaded adapter {model}" in log
    assert not (run / "ckpt" / "base").exists()  # the bare base does not train
    assert f"model opponent: the frozen adapter {opponent}" in log
    records = {
        name: rendezvous.read(run / "servers" / f"{name}.json")
        for name in ("base", "proposer", "solver", "opponent")
    }
    assert all(record is not None for record in records.values()), records
    assert len({r.port for r in records.values() if r}) == 1  # one port, one engine, four models
    assert {name: r.url.rsplit("/", 2)[-2:] for name, r in records.items() if r} == {
        name: ["m", name] for name in records
    }
    assert all(r.state == "finished" for r in records.values() if r)
    results = [r for path in (run / "data" / "clients" / "pairs").glob("*.h5") for r in read_results(path)]
    assert results and all(set(r.episode_ids) == {"proposer", "solver"} for r in results)
    assert log.count("vllm engine: loaded /") == 2  # one engine per start, both adapters on it
    # the clients left no episode for the server to wait on (a pair whose second begin was refused, one
    # model done, left none open either)
    assert "episodes still open after" not in log
    out = subprocess.run(["scontrol", "show", "job", jobs["server-base"]], capture_output=True, text=True)
    assert "Restarts=1" in out.stdout
    exported = tmp_path / "solver"
    export(run, exported, "--model", "solver", "--adapter", step=steps)
    assert (exported / "adapter_config.json").is_file()  # the solver's adapter alone


def test_mixed_tasks_hold_the_ratio_in_every_batch(tmp_path: Path) -> None:
    run = tmp_path / "run"
    steps = 3  # every batch is checked; steps 2 and 3 are collected while the step before trains
    jobs = launch(
        "mixed_tasks.yaml",
        run,
        f"servers.policy.trainer.total_steps={steps}",
        "servers.policy.trainer.repeats=2",
        "servers.policy.trainer.skip_equal_groups=false",
        "servers.policy.trainer.save_every=100",
        "servers.policy.engine=transformers",  # the batches' mix is the subject, not the engine
    )
    try:
        wait_for_the_end(jobs, 900)
    finally:
        subprocess.run(["scancel", *jobs.values()], check=False, capture_output=True)
    metrics = rows(run)
    assert [row["step"] for row in metrics] == list(range(1, steps + 1))
    for row in metrics:
        groups, short = row["client_groups"], row["mix_shortfall"]
        assert sum(groups.values()) + sum(short.values()) == 10
        assert abs(groups.get("math", 0) - 7) <= 1 and abs(groups.get("tools", 0) - 3) <= 1, row
    # the multi-turn tasks merged (keep_history): fewer samples than calls
    assert sum(row["samples"] for row in metrics) < sum(row["samples_before_merge"] for row in metrics)
