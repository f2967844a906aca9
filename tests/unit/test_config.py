"""Unit tests of ajet_hpc.config: models, Slurm field parsing, overrides, loading, errors with field paths."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from ajet_hpc.config import (
    ClientGroupConfig,
    ClusterConfig,
    ConfigError,
    ConfigIssue,
    RunConfig,
    ServerConfig,
    Topology,
    TrainerConfig,
    apply_overrides,
    check_partitions,
    dump_topology,
    format_path,
    load_topology,
    slurm_memory_mb,
    slurm_time_minutes,
)

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
DELETE = object()


def base() -> dict[str, Any]:
    """The smallest valid topology with one client group, as raw data."""
    return {
        "run": {"name": "t"},
        "servers": [{"name": "policy", "model": "builtin:tiny"}],
        "clients": [
            {
                "name": "math",
                "agent": "pkg.agents:solve",
                "tasks": "builtin:arithmetic",
                "servers": ["policy"],
            }
        ],
    }


def edited(*edits: tuple[tuple[str | int, ...], Any]) -> dict[str, Any]:
    """``base()`` with each ``(location, value)`` set.

    ``DELETE`` removes the key, an index one past the end of a list appends, missing mappings are created.
    """
    data = base()
    for loc, value in edits:
        *parents, last = loc
        node: Any = data
        for key in parents:
            node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
        if value is DELETE:
            del node[last]
        elif isinstance(node, list) and last == len(node):
            node.append(value)
        else:
            node[last] = value
    return data


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return path


# ----------------------------------------------------------------------------------------------------
# Valid topologies and defaults


def test_quickstart_loads() -> None:
    topo = load_topology(QUICKSTART)
    assert topo.run.name == "quickstart"
    assert topo.cluster.backend == "local"
    policy = topo.server("policy")
    assert (policy.engine.model, policy.engine.kind, policy.partition) == ("builtin:tiny", "auto", "gpu")
    assert (policy.gpus_per_node, policy.cpus, policy.mem, policy.time, policy.time_min) == (
        0,
        2,
        "4G",
        "0:30:00",
        30,
    )
    assert policy.trainer == TrainerConfig(
        zero_stage=2, ranks=2, lr=0.003, tasks_per_batch=8, repeats=8, total_steps=20, save_every=5
    )
    math = topo.client("math")
    assert math.agent == "ajet_hpc.environments.arithmetic.agent:solve"
    assert math.tasks == "builtin:arithmetic"
    assert math.servers == ["policy"]
    assert (math.partition, math.array, math.in_flight, math.cpus, math.mem, math.time_min) == (
        "cpu",
        3,
        4,
        1,
        "1G",
        30,
    )


def test_defaults() -> None:
    topo = load_topology(base())
    assert topo.run.dir is None
    assert topo.cluster == ClusterConfig()
    assert (topo.cluster.backend, topo.cluster.account, topo.cluster.qos) == ("auto", None, None)
    assert (topo.cluster.setup, topo.cluster.sbatch, topo.cluster.hetjob) == ([], {}, False)
    assert topo.cluster.signal_delay_s == 120
    server = topo.servers[0]
    assert (server.engine.kind, server.partition, server.nodes, server.gpus_per_node, server.cpus) == (
        "auto",
        "gpu",
        1,
        2,
        4,
    )
    assert (server.placement, server.engine.gpus, server.engine.vllm.gpu_memory_utilization) == (
        "split",
        1,
        0.85,
    )
    assert (server.mem, server.time, server.time_min, server.port) == ("16G", "4:00:00", 240, 0)
    trainer = server.trainer
    assert trainer is not None
    assert (trainer.algorithm, trainer.zero_stage, trainer.ranks, trainer.lr) == ("grpo", 2, 1, 1e-5)
    assert (trainer.tasks_per_batch, trainer.repeats, trainer.max_staleness) == (8, 4, 1)
    assert (trainer.total_steps, trainer.save_every, trainer.seed) == (100, 10, 0)
    client = topo.clients[0]
    assert (client.partition, client.array, client.in_flight, client.env) == ("cpu", 1, 1, None)
    assert (client.time, client.cpus, client.mem) == ("4:00:00", 1, "2G")
    assert load_topology(edited((("clients",), DELETE))).clients == []


def test_every_field_has_a_description() -> None:
    models: list[type[pydantic.BaseModel]] = [
        RunConfig,
        ClusterConfig,
        TrainerConfig,
        ServerConfig,
        ClientGroupConfig,
        Topology,
    ]
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_models_are_frozen() -> None:
    topo = load_topology(base())
    with pytest.raises(pydantic.ValidationError):
        topo.servers[0].nodes = 3


def test_direct_construction_checks_consistency() -> None:
    server = ServerConfig.model_validate({"name": "a", "model": "builtin:tiny"})
    client = ClientGroupConfig(name="c", agent="m:f", tasks="t.jsonl", servers=["a"])
    assert Topology(run=RunConfig(name="x"), servers=[server], clients=[client]).clients == [client]
    with pytest.raises(ConfigError, match=r"clients\[0\]\.servers\[0\]: unknown server 'b'"):
        Topology(
            run=RunConfig(name="x"), servers=[server], clients=[client.model_copy(update={"servers": ["b"]})]
        )


def test_lookup_helpers() -> None:
    topo = load_topology(base())
    assert topo.server("policy") is topo.servers[0]
    assert topo.client("math") is topo.clients[0]
    with pytest.raises(KeyError, match="servers are: policy"):
        topo.server("nope")
    with pytest.raises(KeyError, match="client groups are: math"):
        topo.client("nope")


def test_run_dir_resolution(tmp_path: Path) -> None:
    assert RunConfig(name="r").resolve_dir(tmp_path) == tmp_path / "runs" / "r"
    assert RunConfig(name="r", dir="elsewhere/x").resolve_dir(tmp_path) == tmp_path / "elsewhere" / "x"
    assert RunConfig(name="r", dir="/abs/run").resolve_dir(tmp_path) == Path("/abs/run")


def test_task_sources_and_models_accepted() -> None:
    for tasks in ["builtin:arithmetic", "data/tasks.jsonl", "/abs/t.jsonl", "my_pkg.tasks:load"]:
        assert load_topology(edited((("clients", 0, "tasks"), tasks))).clients[0].tasks == tasks
    assert (
        load_topology(edited((("servers", 0, "model"), "/models/qwen"))).servers[0].engine.model
        == "/models/qwen"
    )


def test_yaml_uses_1_2_scalars(tmp_path: Path) -> None:
    text = QUICKSTART.read_text().replace('time: "0:30:00"', "time: 4:00:00") + "\n"
    text = text.replace("lr: 0.003", "lr: 1e-5")
    topo = load_topology(write(tmp_path, text))
    assert topo.servers[0].time == "4:00:00"  # not YAML 1.1's base-60 integer 14400
    assert topo.clients[0].time == "4:00:00"
    trainer = topo.servers[0].trainer
    assert trainer is not None
    assert trainer.lr == 1e-5  # not the string "1e-5"


def test_integer_time_and_memory_are_minutes_and_megabytes() -> None:
    server = load_topology(edited((("servers", 0, "time"), 90), (("servers", 0, "mem"), 4096))).servers[0]
    assert (server.time, server.time_min, server.mem) == ("90", 90, "4096")


def test_sbatch_options_accepted() -> None:
    topo = load_topology(edited((("cluster", "sbatch"), {"constraint": "a100", "nice": 10, "gres": "gpu:1"})))
    assert topo.cluster.sbatch == {"constraint": "a100", "nice": 10, "gres": "gpu:1"}


# ----------------------------------------------------------------------------------------------------
# Slurm time and memory


@pytest.mark.parametrize(
    ("text", "minutes"),
    [
        ("90", 90),
        ("0:30:00", 30),
        ("4:00:00", 240),
        ("48:00:00", 2880),
        ("1-00:00:00", 1440),
        ("1-12", 2160),
        ("1-2:30", 1590),
        ("2-03:04:05", 2 * 1440 + 3 * 60 + 5),
        ("10:00", 10),
        ("1:30", 2),  # MM:SS; seconds round up
        ("0:00:01", 1),
        ("0-00:00:30", 1),
        ("1000", 1000),
    ],
)
def test_time_parsing(text: str, minutes: int) -> None:
    assert slurm_time_minutes(text) == minutes


@pytest.mark.parametrize(
    "text",
    ["", "abc", "4h", "1:2:3:4", "1-", "-1", "1-2-3", "0", "0:00:00", "0-0", "1:60", "1:60:00", "1-24",
     "1-1:60", "1.5", " 10", "10\n", "1-2:3:4:5", "INFINITE"],
)  # fmt: skip
def test_time_parsing_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        slurm_time_minutes(text)


@pytest.mark.parametrize(
    ("text", "mb"),
    [("16G", 16384), ("512M", 512), ("2048", 2048), ("1T", 1024 * 1024), ("1024K", 1), ("1K", 1)],
)
def test_memory_parsing(text: str, mb: int) -> None:
    assert slurm_memory_mb(text) == mb


@pytest.mark.parametrize("text", ["", "G", "0", "0G", "4g", "4GB", "-1G", "1.5G", "16 G", "16Gi", "lots"])
def test_memory_parsing_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        slurm_memory_mb(text)


# ----------------------------------------------------------------------------------------------------
# Overrides


def test_overrides_parse_values_as_yaml() -> None:
    data = base()
    out = apply_overrides(
        data,
        [
            "servers.0.nodes=2",
            "cluster.hetjob=true",
            "clients.math.servers=[policy, other]",
            "run.name=x",
            "servers.0.time=4:00:00",
            "servers.0.trainer.lr=3e-6",
            "cluster.qos=",
            "cluster.setup=[export A=1]",
        ],
    )
    assert out["servers"][0]["nodes"] == 2
    assert out["cluster"]["hetjob"] is True
    assert out["clients"][0]["servers"] == ["policy", "other"]
    assert out["run"]["name"] == "x"
    assert out["servers"][0]["time"] == "4:00:00"
    assert out["servers"][0]["trainer"]["lr"] == 3e-6
    assert out["cluster"]["qos"] is None
    assert out["cluster"]["setup"] == ["export A=1"]


def test_overrides_do_not_mutate_input() -> None:
    data = base()
    before = copy.deepcopy(data)
    apply_overrides(data, ["servers.policy.nodes=3", "cluster.qos=high"])
    assert data == before


def test_overrides_select_list_elements_by_index_and_name() -> None:
    data = edited((("servers",), [{"name": "a", "model": "m"}, {"name": "qwen2.5", "model": "m"}]))
    out = apply_overrides(data, ["servers.1.nodes=2", "servers.a.cpus=8", "servers.qwen2.5.port=8000"])
    assert out["servers"][1]["nodes"] == 2
    assert out["servers"][0]["cpus"] == 8
    assert out["servers"][1]["port"] == 8000
    out = apply_overrides(data, ["servers[a].cpus=3", "servers[1].cpus=5", "clients[0].array=7"])
    assert [s.get("cpus") for s in out["servers"]] == [3, 5]
    assert out["clients"][0]["array"] == 7


def test_overrides_create_missing_mappings() -> None:
    out = apply_overrides(base(), ["cluster.qos=high", "servers.policy.trainer.zero_stage=3"])
    assert out["cluster"] == {"qos": "high"}
    assert out["servers"][0]["trainer"] == {"zero_stage": 3}
    topo = load_topology(base(), overrides=["cluster.qos=high", "cluster.sbatch.constraint=a100"])
    assert topo.cluster.qos == "high"
    assert topo.cluster.sbatch == {"constraint": "a100"}


def test_overrides_in_load_are_validated() -> None:
    assert load_topology(QUICKSTART, overrides=["clients.math.array=8"]).clients[0].array == 8
    with pytest.raises(ConfigError, match=r"servers\[0\]\.nodes"):
        load_topology(QUICKSTART, overrides=["servers.policy.nodes=abc"])


@pytest.mark.parametrize(
    ("override", "path", "message"),
    [
        ("servers.0.nodes", "servers.0.nodes", "dotted.path=value"),
        ("=3", "=3", "dotted.path=value"),
        ("servers..nodes=3", "servers..nodes", "dotted.path=value"),
        ("servers.4.nodes=3", "servers[4]", "out of range"),
        ("servers.nope.nodes=3", "servers.nope", "names are: policy"),
        ("run.name.x=3", "run.name", "not a mapping"),
        ("clients.math.servers.0.x=1", "clients[0].servers[0]", "not a mapping"),
        ("servers.0.nodes=[1", "(root)", "invalid YAML"),
    ],
)
def test_override_errors(override: str, path: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(base(), [override])
    assert info.value.issues[0].path == path
    assert message in str(info.value)


# ----------------------------------------------------------------------------------------------------
# Dump and load back


@pytest.mark.parametrize("source", [QUICKSTART, base()], ids=["quickstart", "defaults"])
def test_round_trip(tmp_path: Path, source: Any) -> None:
    topo = load_topology(source)
    text = dump_topology(topo)
    assert load_topology(write(tmp_path, text)) == topo
    assert yaml.safe_load(text) == topo.model_dump(mode="json")  # plain YAML 1.1 readers see the same values


def test_round_trip_non_defaults(tmp_path: Path) -> None:
    data = edited(
        (("run", "dir"), "/shared/runs/x"),
        (("cluster",), {"backend": "slurm", "account": "0o17", "qos": "1e5", "setup": ["module load cuda"]}),
        (("cluster", "sbatch"), {"constraint": "a100|h100", "nice": 10, "comment": "true"}),
        (("servers", 0, "time"), "1-00:00:00"),
        (("servers", 0, "mem"), "64000"),
        (("servers", 0, "trainer"), {"lr": 3e-6, "zero_stage": 3, "seed": 7}),
        (("clients", 0, "time"), 90),
        (("clients", 0, "env"), "agent-basic.txt"),
    )
    topo = load_topology(data)
    text = dump_topology(topo)
    assert text == dump_topology(load_topology(write(tmp_path, text)))
    assert load_topology(write(tmp_path, text)) == topo
    assert yaml.safe_load(text) == topo.model_dump(mode="json")
    assert text.index("run:") < text.index("cluster:") < text.index("servers:") < text.index("clients:")
    assert "signal_delay_s: 120" in text  # defaults included


# ----------------------------------------------------------------------------------------------------
# Errors: every issue named by its field path


def test_error_rendering() -> None:
    err = ConfigError([ConfigIssue("servers[0].nodes", "bad"), ConfigIssue("(root)", "worse")])
    assert str(err) == "servers[0].nodes: bad\n(root): worse"
    assert format_path(("clients", 1, "servers", 0)) == "clients[1].servers[0]"
    assert format_path(()) == "(root)"
    assert format_path(("cluster", "sbatch", "a b")) == "cluster.sbatch['a b']"


def test_all_issues_are_reported_together() -> None:
    data = edited(
        (("servers", 0, "nodes"), 0), (("clients", 0, "array"), "x"), (("cluster", "backend"), "pbs")
    )
    with pytest.raises(ConfigError) as info:
        load_topology(data)
    assert {i.path for i in info.value.issues} == {"servers[0].nodes", "clients[0].array", "cluster.backend"}

    data = edited(
        (("servers", 1), {"name": "policy", "model": "m"}),
        (("clients", 0, "servers"), ["x", "policy", "y"]),
    )
    with pytest.raises(ConfigError) as info:
        load_topology(data)
    assert [i.path for i in info.value.issues] == [
        "servers[1].name",
        "clients[0].servers[0]",
        "clients[0].servers[2]",
    ]


def test_unknown_key_lists_allowed_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_topology(edited((("servers", 0, "node"), 2)))
    message = str(info.value)
    assert "servers[0].node: unknown key 'node' (did you mean 'nodes'?)" in message
    assert "allowed keys: name, model, engine, partition, nodes" in message


def test_envs_dir(tmp_path: Path) -> None:
    (tmp_path / "agent-basic.txt").write_text("openai\n")
    data = edited((("clients", 0, "env"), "agent-basic.txt"))
    assert load_topology(data, envs_dir=tmp_path).clients[0].env == "agent-basic.txt"
    assert load_topology(edited((("clients", 0, "env"), "other.txt"))).clients[0].env == "other.txt"


def test_check_partitions_accepts_known() -> None:
    topo = load_topology(edited((("clients", 0, "partition"), "cpu,cpu-long")))
    check_partitions(topo, {"gpu", "cpu*", "cpu-long"})


def _load_data(data: dict[str, Any], **kwargs: Any) -> Callable[[Path], object]:
    return lambda tmp_path: load_topology(data, **kwargs)


def _load_text(text: str) -> Callable[[Path], object]:
    return lambda tmp_path: load_topology(write(tmp_path, text))


def _bad(path: str, *edits: tuple[tuple[str | int, ...], Any], fix: str = "") -> tuple[Any, str, str]:
    return (_load_data(edited(*edits)), path, fix)


def _partitions(tmp_path: Path) -> None:
    check_partitions(load_topology(base()), {"cpu", "debug"})


def _missing_env(tmp_path: Path) -> None:
    load_topology(edited((("clients", 0, "env"), "missing.txt")), envs_dir=tmp_path)


MALFORMED = {
    # wrong types
    "string_for_int": _bad("servers[0].nodes", (("servers", 0, "nodes"), "abc")),
    "numeric_string_for_int": _bad("clients[0].array", (("clients", 0, "array"), "3")),
    "bool_for_int": _bad("clients[0].in_flight", (("clients", 0, "in_flight"), True)),
    "float_for_int": _bad("servers[0].cpus", (("servers", 0, "cpus"), 2.5)),
    "string_for_bool": _bad("cluster.hetjob", (("cluster", "hetjob"), "maybe")),
    "string_for_list": _bad("clients[0].servers", (("clients", 0, "servers"), "policy")),
    "string_for_setup_list": _bad("cluster.setup", (("cluster", "setup"), "module load cuda")),
    "bool_for_zero_stage": _bad(
        "servers[0].trainer.zero_stage", (("servers", 0, "trainer", "zero_stage"), True)
    ),
    "list_for_mapping": _bad("cluster", (("cluster",), ["slurm"])),
    # unknown keys
    "unknown_top_key": _bad("sever", (("sever",), []), fix="allowed keys: run, cluster, servers, clients"),
    "unknown_server_key": _bad("servers[0].gpus", (("servers", 0, "gpus"), 1), fix="did you mean"),
    "unknown_client_key": _bad("clients[0].arrays", (("clients", 0, "arrays"), 2), fix="'array'"),
    "unknown_cluster_key": _bad("cluster.partition", (("cluster", "partition"), "gpu"), fix="unknown key"),
    "unknown_trainer_key": _bad(
        "servers[0].trainer.learning_rate", (("servers", 0, "trainer", "learning_rate"), 1)
    ),
    # missing / empty
    "missing_servers": _bad("servers", (("servers",), DELETE), fix="required"),
    "missing_run": _bad("run", (("run",), DELETE)),
    "empty_servers": _bad("servers", (("servers",), [])),
    "empty_client_servers": _bad("clients[0].servers", (("clients", 0, "servers"), [])),
    "missing_model": _bad("servers[0].model", (("servers", 0, "model"), DELETE)),
    # references and duplicates
    "client_unknown_server": _bad(
        "clients[0].servers[0]",
        (("clients", 0, "servers"), ["nope"]),
        fix="unknown server 'nope'; servers are: policy",
    ),
    "duplicate_server_names": _bad("servers[1].name", (("servers", 1), {"name": "policy", "model": "m"})),
    "duplicate_client_names": _bad("clients[1].name", (("clients", 1), base()["clients"][0])),
    "duplicate_client_server_ref": _bad(
        "clients[0].servers[1]", (("clients", 0, "servers"), ["policy", "policy"])
    ),
    # sizes
    "zero_nodes": _bad("servers[0].nodes", (("servers", 0, "nodes"), 0)),
    "negative_nodes": _bad("servers[0].nodes", (("servers", 0, "nodes"), -1)),
    "zero_array": _bad("clients[0].array", (("clients", 0, "array"), 0)),
    "negative_in_flight": _bad("clients[0].in_flight", (("clients", 0, "in_flight"), -4)),
    "negative_gpus_per_node": _bad("servers[0].gpus_per_node", (("servers", 0, "gpus_per_node"), -1)),
    "zero_ranks": _bad("servers[0].trainer.ranks", (("servers", 0, "trainer", "ranks"), 0)),
    "negative_lr": _bad("servers[0].trainer.lr", (("servers", 0, "trainer", "lr"), -0.1)),
    "bad_zero_stage": _bad("servers[0].trainer.zero_stage", (("servers", 0, "trainer", "zero_stage"), 4)),
    "port_out_of_range": _bad("servers[0].port", (("servers", 0, "port"), 70000)),
    "signal_delay_too_small": _bad("cluster.signal_delay_s", (("cluster", "signal_delay_s"), 5)),
    # Slurm values
    "bad_server_time": _bad("servers[0].time", (("servers", 0, "time"), "4h"), fix="HH:MM:SS"),
    "bad_client_time": _bad("clients[0].time", (("clients", 0, "time"), "1:60:00")),
    "time_within_signal_delay": _bad("servers[0].time", (("servers", 0, "time"), "2"), fix="signal_delay_s"),
    "bad_server_memory": _bad("servers[0].mem", (("servers", 0, "mem"), "4GB"), fix="K, M, G or T"),
    "bad_client_memory": _bad("clients[0].mem", (("clients", 0, "mem"), "lots")),
    "bad_partition_name": _bad("servers[0].partition", (("servers", 0, "partition"), "gpu partition")),
    # names and formats
    "bad_run_name": _bad("run.name", (("run", "name"), "my run")),
    "bad_server_name": _bad("servers[0].name", (("servers", 0, "name"), "-policy")),
    "bad_client_name": _bad("clients[0].name", (("clients", 0, "name"), "math/1")),
    "bad_agent_format": _bad(
        "clients[0].agent", (("clients", 0, "agent"), "agents/solve.py"), fix="module.path"
    ),
    "agent_without_function": _bad("clients[0].agent", (("clients", 0, "agent"), "pkg.agents")),
    # a malformed task source is the launcher's check: tests/unit/test_task_source_specs.py
    "unknown_builtin_model": _bad("servers[0].model", (("servers", 0, "model"), "builtin:huge")),
    "env_with_directory": _bad("clients[0].env", (("clients", 0, "env"), "../secret.txt")),
    "bad_backend": _bad("cluster.backend", (("cluster", "backend"), "pbs"), fix="'auto', 'slurm' or 'local'"),
    "bad_engine": _bad("servers[0].engine", (("servers", 0, "engine"), "tgi")),
    "bad_sbatch_key": _bad("cluster.sbatch.--gres", (("cluster", "sbatch"), {"--gres": "gpu:1"})),
    "reserved_sbatch_key": _bad(
        "cluster.sbatch.partition", (("cluster", "sbatch"), {"partition": "x"}), fix="servers[].partition"
    ),
    "sbatch_key_with_space": _bad("cluster.sbatch['a b']", (("cluster", "sbatch"), {"a b": "x"})),
    "bad_sbatch_value": _bad("cluster.sbatch.exclusive", (("cluster", "sbatch"), {"exclusive": True})),
    # files
    "bad_yaml_syntax": (_load_text("run: {name: x\nservers: []\n"), "(root)", "line 2"),
    "bad_yaml_indent": (_load_text("run:\n  name: x\n servers: []\n"), "(root)", "invalid YAML"),
    "duplicate_yaml_key": (_load_text("run: {name: x}\nrun: {name: y}\n"), "(root)", "duplicate key 'run'"),
    "non_mapping_top_level": (_load_text("- run\n- servers\n"), "(root)", "must be a mapping"),
    "scalar_top_level": (_load_text("hello\n"), "(root)", "got a str"),
    "empty_file": (_load_text("# nothing\n"), "(root)", "is empty"),
    "missing_file": (lambda tmp_path: load_topology(tmp_path / "nope.yaml"), "(root)", "cannot read"),
    "missing_env_file": (_missing_env, "clients[0].env", "missing.txt"),
    # live cluster and command line
    "unknown_partition": (_partitions, "servers[0].partition", "partitions are: cpu, debug"),
    "bad_override_path": (
        lambda tmp_path: load_topology(base(), overrides=["servers.main.nodes=2"]),
        "servers.main",
        "no element named 'main'",
    ),
    "override_bad_value": (
        lambda tmp_path: load_topology(base(), overrides=["servers.policy.nodes=-2"]),
        "servers[0].nodes",
        "greater than or equal to 1",
    ),
}


@pytest.mark.parametrize(("action", "path", "fix"), list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_topology(tmp_path: Path, action: Callable[[Path], object], path: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        action(tmp_path)
    message = str(info.value)
    assert f"{path}: " in message
    assert path in [issue.path for issue in info.value.issues]
    assert fix in message


def test_client_group_ratios_must_cover_a_server_and_sum_to_one() -> None:
    second = {"name": "tools", "agent": "pkg.agents:other", "tasks": "builtin:guess", "servers": ["policy"]}
    good = edited((("clients", 0, "ratio"), 0.7), (("clients", 1), {**second, "ratio": 0.3}))
    topology = load_topology(good)
    assert topology.mix_of("policy") == {"math": 0.7, "tools": 0.3}

    with pytest.raises(ConfigError) as info:
        load_topology(edited((("clients", 0, "ratio"), 0.7), (("clients", 1), second)))
    assert [i.path for i in info.value.issues] == ["clients[1].ratio"]
    assert "group 'tools' has none" in str(info.value)

    with pytest.raises(ConfigError) as info:
        load_topology(edited((("clients", 0, "ratio"), 0.6), (("clients", 1), {**second, "ratio": 0.3})))
    assert "sum to 0.9 (math 0.6 + tools 0.3), not 1" in str(info.value)

    with pytest.raises(ConfigError) as info:
        load_topology(edited((("clients", 0, "ratio"), 1.5)))
    assert [i.path for i in info.value.issues] == ["clients[0].ratio"]


def test_merge_settings_are_validated() -> None:
    data = edited((("servers", 0, "trainer"), {"merge": {"mode": "tree", "level": "text"}}))
    trainer = load_topology(data).servers[0].trainer
    assert trainer is not None
    assert trainer.merge.mode == "tree"
    with pytest.raises(ConfigError) as info:
        load_topology(edited((("servers", 0, "trainer"), {"merge": {"mode": "zip"}})))
    assert [i.path for i in info.value.issues] == ["servers[0].trainer.merge.mode"]
