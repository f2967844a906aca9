"""Malformed topologies through the real launcher CLI: exit 2, the field path in the message, nothing
written. (The config package's own tests cover the validators case by case; these prove the wiring.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import topology_dict

from ajet_hpc.launch.cli import main


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def edit(data: dict[str, Any]) -> None:
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


S, C = ("servers", 0), ("clients", 0)
CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "string for int": (_set((*S, "nodes"), "two"), "servers[0].nodes"),
    "float for int": (_set((*C, "array"), 2.5), "clients[0].array"),
    "bool for int": (_set((*C, "in_flight"), True), "clients[0].in_flight"),
    "string for list": (_set((*C, "servers"), "policy"), "clients[0].servers"),
    "string for bool": (_set(("cluster", "hetjob"), "maybe"), "cluster.hetjob"),
    "unknown top key": (_set(("extra",), 1), "extra"),
    "unknown server key": (_set((*S, "gpu"), 1), "servers[0].gpu"),
    "unknown client key": (_set((*C, "size"), 3), "clients[0].size"),
    "unknown cluster key": (_set(("cluster", "partition"), "gpu"), "cluster.partition"),
    "missing servers": (_delete(("servers",)), "servers"),
    "empty servers": (_set(("servers",), []), "servers"),
    "client uses missing server": (_set((*C, "servers"), ["nobody"]), "clients[0].servers[0]"),
    "negative nodes": (_set((*S, "nodes"), -1), "servers[0].nodes"),
    "zero array": (_set((*C, "array"), 0), "clients[0].array"),
    "negative gpus": (_set((*S, "gpus_per_node"), -2), "servers[0].gpus_per_node"),
    "bad time": (_set((*S, "time"), "4h"), "servers[0].time"),
    "bad day time": (_set((*C, "time"), "1-30:00"), "clients[0].time"),
    "bad memory": (_set((*S, "mem"), "lots"), "servers[0].mem"),
    "bad backend": (_set(("cluster", "backend"), "kubernetes"), "cluster.backend"),
    "bad agent": (_set((*C, "agent"), "not an entry point"), "clients[0].agent"),
    "bad server name": (_set((*S, "name"), "has space"), "servers[0].name"),
    "duplicate group": (lambda d: d["clients"].append(copy.deepcopy(d["clients"][0])), "clients[1].name"),
}


@pytest.mark.parametrize(("edit", "path"), list(CASES.values()), ids=list(CASES))
def test_malformed_topology_exits_2_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[dict[str, Any]], None], path: str
) -> None:
    data = topology_dict(tmp_path / "run")
    edit(data)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main([str(config)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:" in err or f"{path} " in err, err
    assert not (tmp_path / "run").exists()


def test_yaml_syntax_error_names_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("run:\n  name: x\nservers: [\n")
    assert main([str(config)]) == 2
    assert "line" in capsys.readouterr().err


def test_bad_override_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ok.yaml"
    config.write_text(yaml.safe_dump(topology_dict(tmp_path / "run")))
    assert main([str(config), "servers.nobody.nodes=2"]) == 2
    assert "servers" in capsys.readouterr().err
    assert main([str(config), "servers.0.nodes=-3"]) == 2
    assert "servers[0].nodes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "absent.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
