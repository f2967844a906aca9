"""The form of a server before the engine block and ``models:`` (flat ``model``, ``engine``, ``trainer``,
``adapters``...) still loads, to the same resolved topology as its new form; errors in it name the paths it
was written with; overrides in either form reach a server written in either; mixing the forms is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ajet_hpc.config import ConfigError, RunConfig, Topology, apply_overrides, dump_topology, load_topology
from ajet_hpc.config.yaml_io import parse_yaml
from ajet_hpc.storage.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
OLD = REPO / "tests" / "fixtures" / "old_configs"
TOPOLOGIES = sorted(p.name for p in OLD.glob("*.yaml") if "\nservers:" in p.read_text())


def test_every_config_has_its_old_form_kept() -> None:
    assert sorted(p.name for p in OLD.glob("*.yaml")) == sorted(
        p.name for p in (REPO / "configs").glob("*.yaml")
    )
    assert len(TOPOLOGIES) >= 12


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_the_old_form_of_each_config_loads_to_the_same_topology(name: str) -> None:
    old, new = load_topology(OLD / name), load_topology(REPO / "configs" / name)
    assert old.model_dump() == new.model_dump()
    assert old == new  # the form a server was written in is not part of the config
    raw = parse_yaml((REPO / "configs" / name).read_text(), source=name)
    assert all("engine" in s and "models" in s for s in raw["servers"])  # configs/ are in the new form


def old_swarm(**change: object) -> dict:
    server = {
        "name": "base",
        "model": "builtin:tiny",
        "engine": "vllm",
        "gpus_per_node": 0,
        "trainer": None,
        "adapters": [{"name": "proposer", "trainer": {"lora": {"rank": 8}}}, {"name": "solver"}],
        **change,
    }
    return {"run": {"name": "s"}, "servers": [server]}


def new_swarm(**change: object) -> dict:
    server = {
        "name": "base",
        "gpus_per_node": 0,
        "engine": {"kind": "vllm", "model": "builtin:tiny"},
        "models": [
            {"name": "base", "trainer": None},
            {"name": "proposer", "trainer": {"lora": {"rank": 8}}},
            {"name": "solver", "trainer": {"lora": {}}},
        ],
        **change,
    }
    return {"run": {"name": "s"}, "servers": [server]}


def test_adapters_become_models_after_the_base_with_their_default_trainer() -> None:
    old, new = load_topology(old_swarm()), load_topology(new_swarm())
    assert dump_topology(old) == dump_topology(new)
    (server,) = old.servers
    assert [m.name for m in server.models] == ["base", "proposer", "solver"]
    solver = server.models[2].trainer
    assert server.models[0].trainer is None and solver is not None and solver.lora is not None
    assert solver.lora.rank == 16  # an old adapter without trainer trained a rank-16 adapter
    assert (server.engine.kind, server.engine.model) == ("vllm", "builtin:tiny")
    assert [m.name for m in old.models] == ["base", "proposer", "solver"]


def test_a_plain_server_of_the_new_form_is_one_model_named_as_the_job() -> None:
    data = {"run": {"name": "p"}, "servers": [{"name": "policy", "engine": {"model": "builtin:tiny"}}]}
    (server,) = load_topology(data).servers
    assert [m.name for m in server.models] == ["policy"] and server.trainer is not None
    old = {"run": {"name": "p"}, "servers": [{"name": "policy", "model": "builtin:tiny"}]}
    assert dump_topology(load_topology(old)) == dump_topology(load_topology(data))


@pytest.mark.parametrize(
    "change,old_path,new_path",
    [
        ({"trainer": {}}, "servers[0].trainer", "servers[0].models[0].trainer"),
        ({"engine_gpus": 2}, "servers[0].engine_gpus", "servers[0].engine.gpus"),
        ({"vllm": {"max_loras": 1}}, "servers[0].vllm.max_loras", "servers[0].engine.vllm.max_loras"),
    ],
)
def test_errors_name_the_paths_of_the_form_written(change: dict, old_path: str, new_path: str) -> None:
    with pytest.raises(ConfigError) as old:
        load_topology(old_swarm(**change))
    assert old_path in [i.path for i in old.value.issues], str(old.value)
    new_change = {"engine_gpus": {"engine": {"kind": "vllm", "model": "builtin:tiny", "gpus": 2}}}.get(
        next(iter(change)),
        {"engine": {"kind": "vllm", "model": "builtin:tiny", **change}}
        if "vllm" in change
        else {"models": [{"name": "base", "trainer": {}}, *new_swarm()["servers"][0]["models"][1:]]},
    )
    with pytest.raises(ConfigError) as new:
        load_topology(new_swarm(**new_change))
    assert new_path in [i.path for i in new.value.issues], str(new.value)


def test_pydantic_errors_of_the_old_form_name_its_paths() -> None:
    with pytest.raises(ConfigError) as raised:
        load_topology(old_swarm(adapters=[{"name": "proposer", "trainer": {"lr": -1, "lora": {}}}]))
    assert [i.path for i in raised.value.issues] == ["servers[0].adapters[0].trainer.lr"]
    with pytest.raises(ConfigError) as raised:
        load_topology(old_swarm(engine="tgi"))
    assert [i.path for i in raised.value.issues] == ["servers[0].engine"]


def test_mixing_the_forms_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as raised:
        load_topology(new_swarm(trainer=None, vllm={}))
    (issue,) = raised.value.issues
    assert issue.path == "servers[0]"
    assert "(vllm, trainer)" in issue.message and "(engine, models)" in issue.message


def test_the_first_model_carries_the_job_name_and_a_folder_needs_its_base() -> None:
    models = [{"name": "other"}]
    with pytest.raises(ConfigError, match=r"servers\[0\]\.models\[0\]\.name: the first model"):
        load_topology(new_swarm(models=models, engine={"kind": "vllm", "model": "builtin:tiny"}))
    frozen: list[dict[str, object]] = [{"name": "base", "trainer": None, "adapter": "x"}]
    with pytest.raises(ConfigError, match=r"servers\[0\]\.models\[0\]\.adapter: an adapter folder"):
        load_topology(new_swarm(models=frozen))


@pytest.mark.parametrize(
    "override,read",
    [
        ("servers.base.trainer=null", lambda t: t.server("base").trainer is None),
        ("servers.base.adapters.proposer.trainer.lr=0.5", lambda t: t.server("proposer").trainer.lr == 0.5),
        ("servers.base.adapters.1.trainer.lora.rank=8", lambda t: t.server("solver").trainer.lora.rank == 8),
        ("servers.base.models.proposer.trainer.lr=0.5", lambda t: t.server("proposer").trainer.lr == 0.5),
        ("servers.base.models[2].trainer.lora.rank=8", lambda t: t.server("solver").trainer.lora.rank == 8),
        ("servers.base.engine_gpus=1", lambda t: t.servers[0].engine.gpus == 1),
        ("servers.base.engine.gpus=1", lambda t: t.servers[0].engine.gpus == 1),
        ("servers.base.model=builtin:tiny-qwen", lambda t: t.servers[0].engine.model == "builtin:tiny-qwen"),
        (
            "servers.base.engine.model=builtin:tiny-qwen",
            lambda t: t.servers[0].engine.model == "builtin:tiny-qwen",
        ),
        ("servers.base.engine=auto", lambda t: t.servers[0].engine.kind == "auto"),
        ("servers.base.engine.kind=auto", lambda t: t.servers[0].engine.kind == "auto"),
        ("servers.base.vllm.max_num_seqs=3", lambda t: t.servers[0].engine.vllm.max_num_seqs == 3),
        ("servers.base.engine.vllm.max_num_seqs=3", lambda t: t.servers[0].engine.vllm.max_num_seqs == 3),
        (
            "servers.base.store.commit_max_episodes=3",
            lambda t: t.servers[0].models[0].store.commit_max_episodes == 3,
        ),
        ("servers.base.gpu_memory_gib=40.0", lambda t: t.servers[0].engine.gpu_memory_gib == 40.0),
    ],
)
def test_overrides_of_either_form_reach_a_server_of_either(override: str, read: object) -> None:
    for data in (old_swarm(), new_swarm()):
        topology = load_topology(apply_overrides(data, [override]))
        assert callable(read) and read(topology), (override, data["servers"][0].keys())


def test_an_override_that_only_the_new_form_says_rewrites_an_old_server() -> None:
    engine = "servers.base.engine={kind: vllm, model: builtin:tiny-qwen, gpus: 1}"
    topology = load_topology(apply_overrides(old_swarm(), [engine]))
    assert topology.servers[0].engine.model == "builtin:tiny-qwen"
    assert [m.name for m in topology.servers[0].models] == ["base", "proposer", "solver"]


def test_a_run_frozen_in_the_old_form_resumes(tmp_path: Path) -> None:
    old = load_topology(old_swarm())
    run = RunDir(tmp_path / "run")
    assert run.prepare(old) == "created"
    text = dump_topology(old)
    frozen_then = (OLD / "quickstart.yaml").read_text()  # a file in the old form, as an older version froze
    run.topology_file.write_text(frozen_then)
    assert run.prepare(load_topology(OLD / "quickstart.yaml")) == "resumed"
    assert run.prepare(load_topology(REPO / "configs" / "quickstart.yaml")) == "resumed"
    assert text != frozen_then


def test_an_override_of_a_model_reaches_a_new_server_written_without_models() -> None:
    data = {"run": {"name": "p"}, "servers": [{"name": "policy", "engine": {"model": "builtin:tiny"}}]}
    for override in ("servers.policy.models.policy.trainer.lr=0.5", "servers.policy.trainer.lr=0.5"):
        trainer = load_topology(apply_overrides(data, [override])).servers[0].trainer
        assert trainer is not None and trainer.lr == 0.5


def test_a_server_instance_keeps_the_form_it_was_read_in() -> None:
    server = load_topology(old_swarm()).servers[0]
    again = Topology(run=RunConfig(name="again"), servers=[server])
    assert again.servers[0].path(0, "engine.gpus") == "servers[0].engine_gpus"
    assert server.path(0, "models[1].trainer") == "servers[0].adapters[0].trainer"
    assert server.written("engine.vllm.max_loras") == "vllm.max_loras"
