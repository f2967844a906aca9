"""Read, override, validate and freeze a topology; every failure is a ``ConfigError`` with field paths."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ajet_hpc.config.clients import ClientGroupConfig
from ajet_hpc.config.errors import (
    ROOT,
    ConfigError,
    ConfigIssue,
    issues_from_validation_error,
    unknown_key_message,
)
from ajet_hpc.config.old_form import OLD_FORM_KEYS, is_old_form, old_path
from ajet_hpc.config.overrides import apply_overrides
from ajet_hpc.config.server import ServerConfig
from ajet_hpc.config.topology import Topology
from ajet_hpc.config.yaml_io import parse_yaml, to_yaml


def load_topology(
    source: str | Path | dict[str, Any], overrides: Sequence[str] = (), envs_dir: Path | None = None
) -> Topology:
    """Load a topology from a YAML file (a ``str`` is a path) or from already-parsed data.

    ``overrides`` (``dotted.path=value``) are applied to the raw data before validation. With ``envs_dir``,
    each client's ``env`` must name a file in it. All problems found at one stage are reported together.
    """
    data = source if isinstance(source, dict) else _read_mapping(Path(source))
    if overrides:
        data = apply_overrides(data, overrides)
    return validate_topology(data, envs_dir=envs_dir)


def validate_topology(data: Any, envs_dir: Path | None = None) -> Topology:
    """Validate parsed data as a :class:`Topology`, converting pydantic's errors into a ``ConfigError``."""
    context = {"envs_dir": envs_dir} if envs_dir is not None else None
    try:
        return Topology.model_validate(data, context=context)
    except ValidationError as err:
        issues = issues_from_validation_error(err, Topology)
        raise ConfigError([_as_written(data, issue) for issue in issues]) from None


def _as_written(data: Any, issue: ConfigIssue) -> ConfigIssue:
    """An issue of a server written in the old form at the path it was written with (``engine_gpus``, not
    ``engine.gpus``): pydantic reports the form that server was rewritten to (``config.old_form``)."""
    match = re.match(r"servers\[(\d+)\]", issue.path)
    servers = data.get("servers") if isinstance(data, dict) else None
    if match is None or not isinstance(servers, list) or int(match[1]) >= len(servers):
        return issue
    server = servers[int(match[1])]
    try:
        old = isinstance(server, dict) and is_old_form(server)
    except ValueError:  # both forms mixed: reported as such
        return issue
    if not old:
        return issue
    key = re.fullmatch(r"servers\[\d+\]\.(\w+)", issue.path)
    if key is not None and issue.message.startswith("unknown key"):  # the keys of the form it was written in
        return dataclasses.replace(issue, message=unknown_key_message(key[1], list(OLD_FORM_KEYS)))
    return dataclasses.replace(issue, path=old_path(issue.path))


def check_array_sizes(topology: Topology, limit: int | None) -> None:
    """Raise ``ConfigError`` for every client group (and eval group) with more array tasks than one job
    array may have on this cluster (``limit``: ``slurmcli.array_limit``; None: not known, nothing checked).
    Slurm would refuse the sbatch, after the servers were submitted."""
    if limit is None:
        return
    issues = []
    for i, group in enumerate(topology.clients):
        sized = [(f"clients[{i}].array", group.array)]
        if group.eval is not None:
            sized.append((f"clients[{i}].eval.array", group.eval.array))
        for where, array in sized:
            if array > limit:
                issues.append(
                    ConfigIssue(
                        where,
                        f"{array} array tasks, but a job array here may have at most {limit} (slurm.conf: "
                        "MaxArraySize, SchedulerParameters=max_array_tasks): split the group into groups of "
                        f"at most {limit} tasks with the same agent and servers, or ask the admins",
                    )
                )
    if issues:
        raise ConfigError(issues)


def check_partitions(topology: Topology, available: set[str]) -> None:
    """Raise ``ConfigError`` for every server or client partition not in ``available`` (the names from sinfo).

    A trailing ``*`` (sinfo's mark of the default partition) is ignored.
    """
    known = {name.rstrip("*") for name in available}
    listed = ", ".join(sorted(known)) or "(none)"
    issues = []
    jobs: list[tuple[str, Sequence[ServerConfig | ClientGroupConfig]]] = [
        ("servers", topology.servers),
        ("clients", topology.clients),
    ]
    for section, members in jobs:
        for i, member in enumerate(members):
            for part in member.partition.split(","):
                if part not in known:
                    issues.append(
                        ConfigIssue(
                            f"{section}[{i}].partition",
                            f"unknown partition {part!r}; partitions are: {listed}",
                        )
                    )
    if issues:
        raise ConfigError(issues)


def dump_topology(topology: Topology) -> str:
    """The fully resolved topology (defaults included) as YAML, keys in field order.

    This is what the launcher freezes into the run directory; :func:`load_topology` reads it back unchanged.
    """
    return to_yaml(topology.model_dump(mode="json"))


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError.at(ROOT, f"cannot read topology file {str(path)!r}: {reason}") from None
    data = parse_yaml(text, source=str(path))
    if data is None:
        raise ConfigError.at(ROOT, f"{path} is empty; a topology needs at least 'run' and 'servers'")
    if not isinstance(data, dict):
        raise ConfigError.at(
            ROOT,
            f"the top level of {path} must be a mapping with 'run', 'servers', ... "
            f"(got a {type(data).__name__})",
        )
    return data
