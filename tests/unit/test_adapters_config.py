"""A server with adapters (``servers[].adapters``): its models as the run sees them (names for clients,
stores, rendezvous files, a job per server), and every combination it cannot run refused before anything
is submitted, naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_fit import QWEN_7B, write_model

from ajet_hpc.config import ConfigError, load_topology
from ajet_hpc.launch.cli import main
from ajet_hpc.launch.fit import fit_issues
from ajet_hpc.launch.plan import HetJobSpec, build_plan

LORA = {"lora": {"rank": 8}}


def swarm(**server: object) -> dict:
    base = {
        "name": "base",
        "model": "builtin:tiny",
        "engine": "vllm",
        "gpus_per_node": 0,
        "trainer": None,
        "adapters": [
            {"name": "proposer", "trainer": LORA},
            {"name": "solver"},
            {"name": "judge", "trainer": None},
        ],
    }
    clients = [
        {
            "name": "pairs",
            "agent": "ajet_hpc.environments.propose_solve.agent:solve",
            "tasks": "builtin:propose_solve",
            "servers": ["proposer", "solver"],
        }
    ]
    return {"run": {"name": "swarm"}, "servers": [{**base, **server}], "clients": clients}


def test_a_server_with_adapters_is_one_job_of_several_models() -> None:
    topology = load_topology(swarm())
    assert [m.name for m in topology.models] == ["base", "proposer", "solver", "judge"]
    proposer, solver, judge = (topology.server(n) for n in ("proposer", "solver", "judge"))
    assert (
        proposer.engine.model == "builtin:tiny"
        and proposer.trainer is not None
        and proposer.trainer.lora is not None
    )
    assert proposer.trainer.lora.rank == 8
    assert solver.trainer is not None and solver.trainer.lora is not None and solver.trainer.lora.rank == 16
    assert judge.trainer is None and topology.server("base").trainer is None
    assert {topology.host_of(n).name for n in ("base", "proposer", "solver", "judge")} == {"base"}
    host = topology.servers[0]
    assert [name for name, _ in host.lora_models()] == ["proposer", "solver"]
    assert host.lora_rank_limit() == 16 and host.lora_slots() == 2  # the largest rank; one slot per adapter
    assert [job.name for job in build_plan(topology)] == ["server-base", "clients-pairs"]
    (hetjob,) = build_plan(topology, hetjob=True)  # the group uses only models of this server: it rides along
    assert isinstance(hetjob, HetJobSpec) and [c.target for c in hetjob.components] == ["base", "pairs"]


@pytest.mark.parametrize(
    "change,field,words",
    [
        ({"trainer": {}}, "servers[0].trainer", "full fine-tuning would change the base"),
        (
            {"adapters": [{"name": "proposer", "trainer": {"lr": 0.1}}, {"name": "solver"}]},
            "servers[0].adapters[0].trainer.lora",
            "trains a LoRA adapter of the shared base",
        ),
        ({"engine": "transformers"}, "servers[0].engine", "use engine vllm"),
        ({"placement": "colocate", "gpus_per_node": 1}, "servers[0].placement", "use placement split"),
        ({"vllm": {"max_loras": 1}}, "servers[0].vllm.max_loras", "below the 2 LoRA models"),
        (
            {"vllm": {"max_lora_rank": 8}},
            "servers[0].adapters[1].trainer.lora.rank",
            "rank 16 is above servers[0].vllm.max_lora_rank=8",
        ),
        (
            {"adapters": [{"name": "proposer"}, {"name": "base"}, {"name": "solver"}]},
            "servers[0].adapters[1].name",
            "duplicate name 'base' (also servers[0])",
        ),
    ],
)
def test_what_a_server_with_adapters_cannot_run_is_refused_naming_the_field(
    change: dict, field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_topology(swarm(**change))
    assert any(issue.path == field and words in issue.message for issue in raised.value.issues), str(
        raised.value
    )


def test_clients_name_adapters_as_servers_and_unknown_names_list_every_model() -> None:
    data = swarm()
    data["clients"][0]["servers"] = ["proposer", "critic"]
    with pytest.raises(
        ConfigError,
        match=r"clients\[0\]\.servers\[1\]: unknown server 'critic'; servers are: base, "
        r"proposer, solver, judge",
    ):
        load_topology(data)


def test_a_target_module_an_adapter_names_but_the_model_lacks_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = swarm(
        adapters=[{"name": "proposer"}, {"name": "solver", "trainer": {"lora": {"target_modules": ["wq"]}}}]
    )
    data["run"]["dir"] = str(tmp_path / "run")
    data["cluster"] = {"backend": "local"}
    config = tmp_path / "topology.json"
    config.write_text(json.dumps(data))
    assert main([str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "servers[0].adapters[1].trainer.lora.target_modules" in err and "'wq'" in err
    assert "servers[0].adapters[0]" not in err  # the other adapter's modules exist


def test_the_fit_check_adds_up_the_trainers_of_every_adapter(tmp_path: Path) -> None:
    """Each trained adapter has its own ranks on the trainer GPUs, each with the frozen bf16 base: one
    rank-16 adapter of Qwen2.5-7B fits on an 80 GiB GPU beside its base (~15 GiB), six of them do not."""
    model = write_model(tmp_path / "qwen7b", QWEN_7B)

    def server(adapters: int) -> dict:
        return {
            "name": "base",
            "model": str(model),
            "gpus_per_node": 2,
            "trainer": None,
            "adapters": [{"name": f"a{i}"} for i in range(adapters)],
        }

    def issues(adapters: int) -> list:
        return fit_issues(load_topology({"run": {"name": "fit"}, "servers": [server(adapters)]}))

    assert issues(1) == []
    (issue,) = issues(6)
    assert issue.path == "servers[0].trainer.zero_stage" and "6 trained models" in issue.message


def test_a_frozen_adapter_is_served_from_its_folder_and_checked_before_submitting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``adapter: FOLDER`` with ``trainer: null`` serves that folder frozen (it takes a LoRA slot); a
    folder that is not there, of a rank above the engine's, or of layers the model lacks exits 2, and a
    trained adapter cannot start from a folder."""
    from ajet_hpc.config.lora import LoraConfig
    from ajet_hpc.engine.adapter import write_initial_adapter
    from ajet_hpc.engine.model_path import resolve_model

    model = resolve_model("builtin:tiny", tmp_path / "models")
    rank32 = write_initial_adapter(model, LoraConfig(rank=32), tmp_path / "rank32")
    frozen = {"name": "opponent", "trainer": None, "adapter": str(rank32)}
    host = load_topology(swarm(adapters=[{"name": "proposer"}, {"name": "solver"}, frozen])).servers[0]
    assert host.frozen_adapters() == [("opponent", str(rank32))] and host.lora_slots() == 3
    assert host.lora_rank_limit([32]) == 32  # the frozen adapter's rank, read from its folder

    with pytest.raises(
        ConfigError, match=r"adapters\[0\]\.adapter: adapter 'proposer' trains from version 0"
    ):
        load_topology(swarm(adapters=[{"name": "proposer", "adapter": str(rank32)}, {"name": "solver"}]))

    def launch(adapter: dict, **server: object) -> str:
        data = swarm(adapters=[{"name": "proposer"}, {"name": "solver"}, adapter], **server)
        data["run"]["dir"] = str(tmp_path / "run")
        data["cluster"] = {"backend": "local"}
        config = tmp_path / "topology.json"
        config.write_text(json.dumps(data))
        assert main([str(config), "--dry-run"]) == 2
        return capsys.readouterr().err

    err = launch({**frozen, "adapter": str(tmp_path / "nowhere")})
    assert "servers[0].adapters[2].adapter" in err and "no such folder" in err
    err = launch(frozen, vllm={"max_lora_rank": 16})
    assert (
        "servers[0].adapters[2].adapter" in err
        and "has rank 32, above servers[0].vllm.max_lora_rank=16" in err
    )
    foreign = write_initial_adapter(model, LoraConfig(rank=8), tmp_path / "foreign")
    config = json.loads((foreign / "adapter_config.json").read_text())
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["c_attn"]}))
    err = launch({**frozen, "adapter": str(foreign)})
    assert "adapts 'c_attn'" in err and "another base model" in err
