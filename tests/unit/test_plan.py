"""The launcher's plan and the scripts it renders (pure: no Slurm needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import REPO, topology_dict, write_topology

from ajet_hpc.config import ClusterConfig, load_topology
from ajet_hpc.launch.backends.hetjob import hetjob_script
from ajet_hpc.launch.backends.slurm import SlurmBackend
from ajet_hpc.launch.cli import main
from ajet_hpc.launch.plan import HetJobSpec, JobSpec, build_plan
from ajet_hpc.storage.rundir import RunDir

GOLDEN = REPO / "tests" / "golden" / "hetjob.sbatch"


def two_group_topology(tmp_path: Path):
    data = topology_dict(tmp_path / "run")
    other = dict(data["clients"][0], name="other", array=2)
    data["servers"].append(dict(data["servers"][0], name="judge"))
    other["servers"] = ["policy", "judge"]
    data["clients"].append(other)
    return load_topology(data)


def test_plan_has_one_job_per_server_and_one_array_per_group(tmp_path: Path) -> None:
    plan = build_plan(two_group_topology(tmp_path))
    assert [job.name for job in plan] == ["server-policy", "server-judge", "clients-math", "clients-other"]
    arrays = {job.target: job.array for job in plan if isinstance(job, JobSpec) and job.kind == "clients"}
    assert arrays == {"math": 3, "other": 2}


def test_hetjob_plan_joins_a_server_with_the_groups_that_use_only_it(tmp_path: Path) -> None:
    plan = build_plan(two_group_topology(tmp_path), hetjob=True)
    het = [job for job in plan if isinstance(job, HetJobSpec)]
    assert len(het) == 1
    assert [c.name for c in het[0].components] == ["server-policy", "clients-math"]
    assert het[0].components[1].resources.ntasks == 3
    # a group that uses two servers stays an array; a server without riders stays a plain job
    assert {job.name for job in plan if isinstance(job, JobSpec)} == {"server-judge", "clients-other"}


def test_slurm_scripts_carry_partitions_array_and_signal(tmp_path: Path) -> None:
    topology = load_topology(topology_dict(tmp_path / "run"))
    run = RunDir.for_topology(topology)
    backend = SlurmBackend(python="python3")
    server, clients = (backend.render(job, run, topology.cluster) for job in build_plan(topology))
    assert "#SBATCH --partition=gpu" in server
    assert "#SBATCH --mem=500M" in server
    assert "#SBATCH --signal=USR2@30" in server
    assert "--gpus-per-node" not in server
    assert "#SBATCH --partition=cpu" in clients
    assert "#SBATCH --array=0-2%3" in clients
    assert "%A_%a_0_log.out" in clients


def test_cluster_options_reach_the_script(tmp_path: Path) -> None:
    data = topology_dict(
        tmp_path / "run",
        account="proj42",
        qos="high",
        setup=["module load cuda/12"],
        sbatch={"constraint": "h100"},
    )
    data["servers"][0]["gpus_per_node"] = 4
    topology = load_topology(data)
    job = build_plan(topology)[0]
    text = SlurmBackend(python="python3").render(job, RunDir.for_topology(topology), topology.cluster)
    for line in (
        "--account=proj42",
        "--qos=high",
        "--constraint=h100",
        "--gpus-per-node=4",
        "module load cuda/12",
    ):
        assert line in text


def test_hetjob_script_matches_golden_file() -> None:
    """The hetjob sbatch text is a pure function: diff it against the committed file.

    Regenerate after an intended change with UPDATE_GOLDEN=1.
    """
    topology = load_topology(topology_dict(Path("/shared/runs/demo"), setup=["module load cuda"]))
    run = RunDir(Path("/shared/runs/demo"))
    (het,) = [job for job in build_plan(topology, hetjob=True) if isinstance(job, HetJobSpec)]
    components = [(c, c.command(run.root, "python3")) for c in het.components]
    text = hetjob_script(f"ajet-demo-{het.name}", run.job_log_dir(het.name), components, topology.cluster)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_hetjob_script_quotes_values() -> None:
    topology = load_topology(topology_dict(Path("/shared/runs/demo")))
    (het,) = [job for job in build_plan(topology, hetjob=True) if isinstance(job, HetJobSpec)]
    components = [(c, ["python3", "-c", "print('a b')"]) for c in het.components]
    cluster = ClusterConfig(sbatch={"comment": "two words; rm -rf /"})
    text = hetjob_script("name with space", Path("/runs/x y"), components, cluster)
    assert "#SBATCH --job-name='name with space'" in text
    assert "#SBATCH --comment='two words; rm -rf /'" in text
    assert "'/runs/x y'/\"${SLURM_JOB_ID}+0_%t_log.out\"" in text
    assert "python3 -c 'print('\"'\"'a b'\"'\"')'" in text


def test_dry_run_prints_scripts_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_topology(tmp_path, topology_dict(tmp_path / "run", backend="slurm"))
    assert main([str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--partition=gpu" in out
    assert "#SBATCH --array=0-2" in out
    assert "nothing submitted or written" in out
    assert not (tmp_path / "run").exists()


def test_dry_run_hetjob(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_topology(tmp_path, topology_dict(tmp_path / "run", backend="slurm"))
    assert main([str(config), "--dry-run", "--hetjob"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH hetjob" in out
    assert "srun --het-group=1" in out
    assert not (tmp_path / "run").exists()


def test_no_submit_writes_the_run_and_prints_hand_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = topology_dict(tmp_path / "run")
    data["cluster"] |= {
        "account": "proj42",
        "qos": "high",
        "setup": ["module load cuda/12.4", "export HF_HOME=/scratch/hf"],
        "sbatch": {"constraint": "a100", "exclusive": "user"},
        "signal_delay_s": 300,
    }
    config = write_topology(tmp_path, data)
    assert main([str(config), "--no-submit"]) == 0
    out = capsys.readouterr().out
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("sbatch ")]
    assert [c.split()[-3] for c in commands] == ["sbatch/server.sbatch", "sbatch/clients.sbatch"]
    assert "--array=0-2" in commands[1]
    for command in commands:  # what submitit would give each job, on the hand-written path too
        for option in ("--account=proj42", "--qos=high", "--constraint=a100", "--exclusive=user"):
            assert option in command.split(), (option, command)
        assert "--signal=B:USR2@300" in command.split()
    setup = (tmp_path / "run" / "setup.sh").read_text()  # the scripts source it
    assert setup.splitlines()[1:] == ["module load cuda/12.4", "export HF_HOME=/scratch/hf"]
    assert (tmp_path / "run" / "topology.yaml").is_file()
    assert not (tmp_path / "run" / "jobs.json").exists()
