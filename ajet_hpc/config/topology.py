"""The topology: one typed description of a run's servers (trainable models) and clients (agent job arrays).

Every model is frozen, rejects unknown keys, and validates strictly (an int is not ``"3"`` nor ``true``).
Each component later receives only its own block: the launcher ``cluster``, a server job its
``ServerConfig``, the trainer its model's ``trainer``, a client array its ``ClientGroupConfig``. The
components' models are in their own modules (``config.run``, ``config.server``, ``config.clients``, ...);
the rules that span them in ``config.rules``.

Constructing a :class:`Topology` raises ``pydantic.ValidationError`` for malformed fields and ``ConfigError``
for inconsistent ones (duplicate names, unknown server references, see
:func:`ajet_hpc.config.rules.consistency_issues`); the validation context ``{"envs_dir": path}`` also checks
that client ``env`` files exist. :func:`ajet_hpc.config.load.load_topology` reports both kinds as
``ConfigError``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, ValidationInfo, model_validator

from ajet_hpc.config.clients import ClientGroupConfig
from ajet_hpc.config.errors import ConfigError
from ajet_hpc.config.fields import MODEL_CONFIG
from ajet_hpc.config.rules import consistency_issues
from ajet_hpc.config.run import ClusterConfig, RunConfig
from ajet_hpc.config.server import ServerConfig


class Topology(BaseModel):
    """A whole run: its identity, the cluster settings, the servers and the client groups."""

    model_config = MODEL_CONFIG

    run: RunConfig = Field(description="Run name and directory.")
    cluster: ClusterConfig = Field(
        default=ClusterConfig(), description="Submission settings shared by all jobs."
    )
    servers: list[ServerConfig] = Field(
        min_length=1, description="Server jobs, each an engine and the models it serves (clients name them)."
    )
    clients: list[ClientGroupConfig] = Field(
        default_factory=list, description="Agent groups, one job array each."
    )

    @model_validator(mode="after")
    def _check_consistency(self, info: ValidationInfo) -> Topology:
        envs_dir = (info.context or {}).get("envs_dir")
        issues = consistency_issues(self, None if envs_dir is None else Path(envs_dir))
        if issues:
            raise ConfigError(issues)
        return self

    @property
    def models(self) -> list[ServerConfig]:
        """Every model of the run, each as a server (`ServerConfig.hosted`): each server job, and after it the
        other models it serves. Clients, stores, rendezvous files, checkpoints and metrics are per model; jobs
        per server."""
        return [model for server in self.servers for model in server.hosted()]

    def server(self, name: str) -> ServerConfig:
        """The model called ``name`` (a server job's first model, or another model of a job) as a server;
        ``KeyError`` naming them otherwise."""
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no server named {name!r}; servers are: {', '.join(m.name for m in self.models)}")

    def host_of(self, name: str) -> ServerConfig:
        """The server job that serves the model ``name``."""
        for server in self.servers:
            if any(model.name == name for model in server.models):
                return server
        raise KeyError(f"no server serves a model named {name!r}")

    def client(self, name: str) -> ClientGroupConfig:
        """The client group called ``name`` (an eval group too); ``KeyError`` naming the groups otherwise."""
        for client in [*self.clients, *self.eval_groups.values()]:
            if client.name == name:
                return client
        known = ", ".join([c.name for c in self.clients] + list(self.eval_groups)) or "(none)"
        raise KeyError(f"no client group named {name!r}; client groups are: {known}")

    @property
    def eval_groups(self) -> dict[str, ClientGroupConfig]:
        """Eval group name -> the eval group of every client group with an ``eval`` block
        (``config.evaluation``). They run as jobs of the run, but feed no trainer: ``clients`` does not
        list them."""
        return {g.name: g for g in (c.eval_group() for c in self.clients if c.eval is not None)}

    def evaluated_by(self, eval_group_name: str) -> ClientGroupConfig | None:
        """The client group whose eval group is ``eval_group_name``; None if it is not an eval group."""
        for client in self.clients:
            if client.eval is not None and client.eval_group().name == eval_group_name:
                return client
        return None

    def mix_of(self, server: str) -> dict[str, float] | None:
        """The task shares (client group -> ratio) of a server's batches; None when its groups set none."""
        groups = [c for c in self.clients if server in c.servers]
        if not any(c.ratio is not None for c in groups):
            return None
        return {c.name: c.ratio or 0.0 for c in groups}

    def episode_repeats(self, group: ClientGroupConfig) -> int:
        """Episodes a client group runs per task: its ``repeats``, else its first server's
        ``trainer.repeats`` (1 when that server only serves)."""
        if group.repeats is not None:
            return group.repeats
        trainer = self.server(group.servers[0]).trainer
        return trainer.repeats if trainer is not None else 1

    def repeats_feeding(self, server: str) -> dict[str, int]:
        """Client group -> episodes per task, for every group whose agents use ``server``."""
        return {c.name: self.episode_repeats(c) for c in self.clients if server in c.servers}

    def co_trained(self, server: str) -> list[str]:
        """The other trainable servers that share a client group with ``server`` (their agents use both)."""
        names: dict[str, None] = {}
        for client in self.clients:
            if server in client.servers:
                for other in client.servers:
                    if other != server and self.server(other).trainer is not None:
                        names[other] = None
        return list(names)
