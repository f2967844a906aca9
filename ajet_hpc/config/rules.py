"""The rules that span fields of the topology: each problem a ``ConfigIssue`` with its field path and fix.

:func:`consistency_issues` runs every rule; ``Topology`` calls it when it is constructed and raises them
all as one ``ConfigError``. A rule that belongs to one component's own settings is a method of its model
and is called from here (an algorithm's: ``config.algorithms.Algorithm.issues``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ajet_hpc.config.clients import ClientGroupConfig
from ajet_hpc.config.errors import ConfigIssue
from ajet_hpc.config.evaluation import eval_group_name, evaluated_model
from ajet_hpc.config.placement import PlacementError
from ajet_hpc.config.resources import JobResources
from ajet_hpc.config.run import ClusterConfig
from ajet_hpc.config.server import ServerConfig
from ajet_hpc.config.trainer import TrainerConfig


class Run(Protocol):
    """What the rules read of a topology (``config.topology.Topology``, which imports this module)."""

    @property
    def cluster(self) -> ClusterConfig: ...
    @property
    def servers(self) -> list[ServerConfig]: ...
    @property
    def clients(self) -> list[ClientGroupConfig]: ...
    @property
    def models(self) -> list[ServerConfig]: ...
    def server(self, name: str) -> ServerConfig: ...
    def mix_of(self, server: str) -> dict[str, float] | None: ...


def consistency_issues(topology: Run, envs_dir: Path | None = None) -> list[ConfigIssue]:
    """Problems that span fields, all of them, each with its path.

    Duplicate names, unknown or repeated server references, time limits not longer than the signal delay, and
    (when ``envs_dir`` is given) client ``env`` files missing from it.
    """
    issues = _duplicates_of_models(topology)
    issues += _duplicates("clients", [c.name for c in topology.clients])
    server_names = list(dict.fromkeys(m.name for m in topology.models))
    for i, client in enumerate(topology.clients):
        seen: set[str] = set()
        for j, ref in enumerate(client.servers):
            path = f"clients[{i}].servers[{j}]"
            if ref not in server_names:
                issues.append(
                    ConfigIssue(path, f"unknown server {ref!r}; servers are: {', '.join(server_names)}")
                )
            elif ref in seen:
                issues.append(ConfigIssue(path, f"server {ref!r} is listed twice"))
            seen.add(ref)
    delay = topology.cluster.signal_delay_s
    jobs: list[tuple[str, Sequence[JobResources]]] = [
        ("servers", topology.servers),
        ("clients", topology.clients),
    ]
    for section, members in jobs:
        for i, member in enumerate(members):
            if member.time_min * 60 <= delay:
                issues.append(
                    ConfigIssue(
                        f"{section}[{i}].time",
                        f"time limit {member.time!r} is not longer than cluster.signal_delay_s={delay}; "
                        "raise the time limit or lower the delay",
                    )
                )
    issues += _mix_issues(topology)
    issues += _placement_issues(topology)
    issues += _lora_issues(topology)
    issues += _algorithm_issues(topology)
    issues += _eval_issues(topology)
    if envs_dir is not None:
        issues += _missing_envs(topology, envs_dir)
    return issues


def _lora_issues(topology: Run) -> list[ConfigIssue]:
    """An adapter rank above the engine's ``max_lora_rank``; fewer LoRA slots than adapters; what a server
    with several models cannot do (full fine-tuning of the shared base, the transformers engine, colocate)."""
    issues = []
    for i, server in enumerate(topology.servers):
        limit = server.lora_rank_limit()
        for j, model in enumerate(server.models):
            lora = model.trainer.lora if model.trainer is not None else None
            if lora is not None and limit is not None and lora.rank > limit:
                issues.append(
                    ConfigIssue(
                        server.path(i, f"models[{j}].trainer.lora.rank"),
                        f"rank {lora.rank} is above {server.path(i, 'engine.vllm.max_lora_rank')}={limit}: "
                        "vLLM would refuse the adapter; raise max_lora_rank or lower the rank",
                    )
                )
        issues += _job_issues(i, server)
    return issues


def _algorithm_issues(topology: Run) -> list[ConfigIssue]:
    """Algorithm settings that cannot work together: a ``loss_agg`` the algorithm does not allow (GSPO's
    loss is a mean over sequences), off-policy correction without the trainer's own log-probabilities,
    DAPO without the dynamic sampling it is defined with (docs/algorithms.md)."""
    issues = []
    for i, server in enumerate(topology.servers):
        for j, model in enumerate(server.models):
            if model.trainer is not None:
                issues += _trainer_algorithm_issues(server.path(i, f"models[{j}].trainer"), model.trainer)
    return issues


def _trainer_algorithm_issues(where: str, trainer: TrainerConfig) -> list[ConfigIssue]:
    issues = []
    if trainer.off_policy.mode != "none" and not trainer.recompute_logprobs:
        issues.append(
            ConfigIssue(
                f"{where}.off_policy.mode",
                f"off_policy.mode {trainer.off_policy.mode!r} weighs each token by the ratio of the "
                "trained policy to the engine that sampled it, against the trainer's own log-probabilities; "
                f"without {where}.recompute_logprobs: true the clipped ratio is already taken against the "
                "engine's, and the correction would count the same ratio twice: set recompute_logprobs: "
                "true or off_policy.mode: none",
            )
        )
    issues += trainer.spec.issues(where, trainer)  # the algorithm's own (config.algorithms)
    return issues


def _job_issues(i: int, server: ServerConfig) -> list[ConfigIssue]:
    """The first model named as the job; a frozen adapter folder only beside the base; and, where the job
    serves several models, what they cannot share."""
    issues = []
    if server.models[0].name != server.name:
        issues.append(
            ConfigIssue(
                server.path(i, "models[0].name"),
                f"the first model of server job {server.name!r} carries the job's name: name it "
                f"{server.name!r}, or rename the job (a plain server is a job with one model of its name)",
            )
        )
    if len(server.models) == 1:
        if server.models[0].adapter is not None:
            issues.append(
                ConfigIssue(
                    server.path(i, "models[0].adapter"),
                    "an adapter folder is served beside its base: add the model that serves it as a second "
                    "model of this job (trainer: null, adapter: FOLDER)",
                )
            )
        return issues
    return issues + _shared_base_issues(i, server)


def _shared_base_issues(i: int, server: ServerConfig) -> list[ConfigIssue]:
    issues = []
    for j, model in enumerate(server.models):
        if model.trainer is not None and j == 0 and model.trainer.lora is None:
            issues.append(
                ConfigIssue(
                    server.path(i, "models[0].trainer"),
                    f"full fine-tuning would change the base model that the models of server {server.name!r} "
                    "share: give it trainer.lora, or trainer: null to serve the bare base",
                )
            )
        if model.trainer is not None and model.adapter is not None:
            issues.append(
                ConfigIssue(
                    server.path(i, f"models[{j}].adapter"),
                    f"adapter {model.name!r} trains from version 0 (B = 0, the base); a given folder is "
                    "served frozen: set trainer: null to serve it, or drop `adapter` to train",
                )
            )
        if model.trainer is not None and j > 0 and model.trainer.lora is None:
            issues.append(
                ConfigIssue(
                    server.path(i, f"models[{j}].trainer.lora"),
                    f"adapter {model.name!r} trains a LoRA adapter of the shared base: set trainer.lora "
                    "(or trainer: null to serve the bare base under this name)",
                )
            )
    if server.engine.kind == "transformers":
        issues.append(
            ConfigIssue(
                server.path(i, "engine.kind"),
                "a server with several models serves them all from one engine with multi-LoRA: use engine "
                "vllm",
            )
        )
    if server.placement == "colocate":
        issues.append(
            ConfigIssue(
                server.path(i, "placement"),
                "a server with several models runs their trainers beside the engine: use placement split "
                "(colocate, where the engine sleeps for one trainer's step, is not supported with several)",
            )
        )
    count = len(server.lora_models()) + len(server.frozen_adapters())
    if server.engine.vllm.max_loras is not None and server.engine.vllm.max_loras < count:
        issues.append(
            ConfigIssue(
                server.path(i, "engine.vllm.max_loras"),
                f"max_loras {server.engine.vllm.max_loras} is below the {count} LoRA models of server "
                f"{server.name!r}: every adapter needs its slot; raise it or leave it null",
            )
        )
    return issues


def _mix_issues(topology: Run) -> list[ConfigIssue]:
    issues = []
    index = {c.name: i for i, c in enumerate(topology.clients)}
    for server in topology.servers:
        groups = [c for c in topology.clients if server.name in c.servers]
        shares = topology.mix_of(server.name)
        if shares is None:
            continue
        unset = [c.name for c in groups if c.ratio is None]
        for name in unset:
            issues.append(
                ConfigIssue(
                    f"clients[{index[name]}].ratio",
                    f"server {server.name!r} mixes its groups' tasks by ratio, but group {name!r} has none: "
                    "give every group of the server a ratio, or none of them",
                )
            )
        total = sum(shares.values())
        if not unset and abs(total - 1.0) > 1e-6:
            parts = " + ".join(f"{name} {share:g}" for name, share in shares.items())
            issues.append(
                ConfigIssue(
                    f"clients[{index[groups[0].name]}].ratio",
                    f"the ratios of server {server.name!r}'s groups sum to {total:g} ({parts}), not 1",
                )
            )
        if server.trainer is not None and server.trainer.batch_policy != "tasks":
            issues.append(
                ConfigIssue(
                    f"clients[{index[groups[0].name]}].ratio",
                    f"ratios need trainer.batch_policy 'tasks' (server {server.name!r} uses "
                    f"{server.trainer.batch_policy!r})",
                )
            )
    return issues


def _placement_issues(topology: Run) -> list[ConfigIssue]:
    issues = []
    for i, server in enumerate(topology.servers):
        try:
            server.placement_plan()
        except PlacementError as error:
            issues.append(ConfigIssue(server.path(i, error.field), error.message))
        if server.placement == "colocate" and server.engine.kind == "transformers":
            issues.append(
                ConfigIssue(
                    server.path(i, "engine.kind"),
                    "placement colocate needs the vllm engine (its sleep mode frees the GPUs for the "
                    "trainer); use engine: vllm, or placement: split",
                )
            )
    return issues


def _missing_envs(topology: Run, envs_dir: Path) -> list[ConfigIssue]:
    issues = []
    for i, client in enumerate(topology.clients):
        if client.env is not None and not (envs_dir / client.env).is_file():
            present = sorted(p.name for p in envs_dir.iterdir() if p.is_file()) if envs_dir.is_dir() else []
            issues.append(
                ConfigIssue(
                    f"clients[{i}].env",
                    f"no environment file {client.env!r} in {envs_dir}; "
                    f"files there: {', '.join(present) or '(none)'}",
                )
            )
    return issues


def _duplicates_of_models(topology: Run) -> list[ConfigIssue]:
    """Model names (every model of every server job) must be unique over the run."""
    first: dict[str, str] = {}
    issues = []
    for i, server in enumerate(topology.servers):
        named = [(server.path(i, f"models[{j}]"), m.name) for j, m in enumerate(server.models)]
        for path, name in named:
            if name in first:
                issues.append(ConfigIssue(f"{path}.name", f"duplicate name {name!r} (also {first[name]})"))
            else:
                first[name] = path
    return issues


def _duplicates(section: str, names: list[str]) -> list[ConfigIssue]:
    first: dict[str, int] = {}
    issues = []
    for i, name in enumerate(names):
        if name in first:
            issues.append(
                ConfigIssue(
                    f"{section}[{i}].name", f"duplicate name {name!r} (also {section}[{first[name]}])"
                )
            )
        else:
            first[name] = i
    return issues


def _eval_issues(topology: Run) -> list[ConfigIssue]:
    """Eval blocks that cannot work: a model the group does not use, or one that does not train (no
    steps to follow), and an eval group name that another group already has."""
    issues = []
    names = {c.name for c in topology.clients}
    for i, group in enumerate(topology.clients):
        ev = group.eval
        if ev is None:
            continue
        where = f"clients[{i}].eval"
        if eval_group_name(group.name) in names:
            issues.append(
                ConfigIssue(
                    where,
                    f"the eval group of {group.name!r} is called {eval_group_name(group.name)!r}, the name "
                    "of another client group: rename that group",
                )
            )
        if ev.model is not None and ev.model not in group.servers:
            issues.append(
                ConfigIssue(
                    f"{where}.model",
                    f"model {ev.model!r} is not one of the group's servers ({', '.join(group.servers)})",
                )
            )
            continue
        model = evaluated_model(topology, group)
        known = {m.name for m in topology.models}
        if model is not None and model in known and topology.server(model).trainer is None:
            issues.append(
                ConfigIssue(
                    f"{where}.model",
                    f"model {model!r} does not train: eval rounds follow a trained model's steps; name one "
                    "that trains, or use `ajet-hpc eval` to evaluate a served model",
                )
            )
        elif model is None and all(s in known for s in group.servers):
            issues.append(
                ConfigIssue(
                    where,
                    f"none of the group's servers ({', '.join(group.servers)}) trains: eval rounds follow a "
                    "trained model's steps",
                )
            )
    return issues
