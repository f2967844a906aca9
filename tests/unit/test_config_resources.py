"""The job models' shared resources (``config.resources``): declared once, each job's own defaults and help,
and the key order a user reads (the frozen RUN/topology.yaml, unknown-key errors, docs/config.md) kept."""

from __future__ import annotations

from typing import Any, ClassVar

import pydantic
import pytest

from ajet_hpc.config import ClientGroupConfig, ConfigError, ServerConfig, dump_topology, load_topology
from ajet_hpc.config.resources import JobResources, Slot

SERVER_KEYS = [
    "name", "partition", "cpus", "mem", "time", "nodes", "gpus_per_node", "placement", "port", "serving",
    "engine", "models",
]  # fmt: skip
OLD_SERVER_KEYS = [
    "name", "model", "engine", "partition", "nodes", "gpus_per_node", "placement", "engine_gpus",
    "gpu_memory_gib", "vllm", "cpus", "mem", "time", "port", "serving", "store", "trainer", "adapters",
]  # fmt: skip  # a server written in the old form (config.old_form) is told its own keys
CLIENT_KEYS = [
    "name", "agent", "tasks", "servers", "partition", "array", "in_flight", "max_tasks", "repeats", "env",
    "ratio", "time", "cpus", "mem", "epochs", "server_wait_s", "max_restarts", "max_resubmits", "eval",
]  # fmt: skip


def test_each_job_keeps_its_key_order_in_the_frozen_topology_and_its_errors() -> None:
    assert list(ServerConfig.model_fields) == SERVER_KEYS
    assert list(ClientGroupConfig.model_fields) == CLIENT_KEYS
    topology = load_topology(
        {
            "run": {"name": "t"},
            "servers": [{"name": "policy", "model": "builtin:tiny"}],
            "clients": [{"name": "m", "agent": "a:b", "tasks": "builtin:arithmetic", "servers": ["policy"]}],
        }
    )
    dumped = topology.model_dump(mode="json")
    assert list(dumped["servers"][0]) == SERVER_KEYS and list(dumped["clients"][0]) == CLIENT_KEYS
    assert load_topology(dumped) == topology and dump_topology(load_topology(dumped)) == dump_topology(
        topology
    )
    with pytest.raises(ConfigError, match="allowed keys: " + ", ".join(OLD_SERVER_KEYS)):
        load_topology({"run": {"name": "t"}, "servers": [{"name": "p", "model": "builtin:tiny", "gpu": 1}]})
    with pytest.raises(ConfigError, match="allowed keys: " + ", ".join(SERVER_KEYS)):
        new = {"name": "p", "engine": {"model": "builtin:tiny"}, "gpu": 1}
        load_topology({"run": {"name": "t"}, "servers": [new]})


def test_each_job_has_its_own_defaults_and_help_and_the_shared_checks() -> None:
    server = ServerConfig.model_validate({"name": "p", "model": "builtin:tiny"})
    client = ClientGroupConfig(name="m", agent="a:b", tasks="builtin:arithmetic", servers=["p"])
    assert (server.partition, server.cpus, server.mem, server.time) == ("gpu", 4, "16G", "4:00:00")
    assert (client.partition, client.cpus, client.mem, client.time) == ("cpu", 1, "2G", "4:00:00")
    assert ServerConfig.model_fields["mem"].description.startswith("Memory per node")  # type: ignore[union-attr]
    assert ClientGroupConfig.model_fields["mem"].description.startswith("Memory per array task")  # type: ignore[union-attr]
    jobs: list[tuple[type[JobResources], dict[str, Any]]] = [
        (ServerConfig, {"name": "p", "model": "builtin:tiny"}),
        (ClientGroupConfig, {"name": "m", "agent": "a:b", "tasks": "builtin:arithmetic", "servers": ["p"]}),
    ]
    for model, required in jobs:
        assert model(**required, time="1-00").time_min == 24 * 60  # the shared property
        with pytest.raises(pydantic.ValidationError, match="greater than or equal to 1"):
            model(**required, cpus=0)
        with pytest.raises(pydantic.ValidationError, match="mem"):
            model(**required, mem="lots")


def test_a_job_model_must_place_every_resource() -> None:
    with pytest.raises(TypeError, match="must place exactly these fields"):

        class Partial(JobResources):
            RESOURCES: ClassVar[dict[str, Slot]] = {"partition": Slot("name", "cpu", "Partition.")}
            name: str

    with pytest.raises(TypeError, match="follows 'nowhere'"):

        class Misplaced(JobResources):
            RESOURCES: ClassVar[dict[str, Slot]] = {
                "partition": Slot("nowhere", "cpu", "Partition."),
                "cpus": Slot("name", 1, "CPUs."),
                "mem": Slot("cpus", "1G", "Memory."),
                "time": Slot("mem", "10", "Time."),
            }
            name: str
