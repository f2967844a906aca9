"""The topology of a run: typed models, loading with overrides, and field-path errors."""

from ajet_hpc.config.clients import ClientGroupConfig
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.errors import ConfigError, ConfigIssue, format_path, issues_from_validation_error
from ajet_hpc.config.fields import BUILTIN_MODELS, slurm_memory_mb, slurm_time_minutes
from ajet_hpc.config.load import (
    check_array_sizes,
    check_partitions,
    dump_topology,
    load_topology,
    validate_topology,
)
from ajet_hpc.config.overrides import apply_overrides
from ajet_hpc.config.run import ClusterConfig, RunConfig
from ajet_hpc.config.server import ServerConfig
from ajet_hpc.config.store import StoreConfig
from ajet_hpc.config.topology import Topology
from ajet_hpc.config.trainer import MergeConfig, TrainerConfig

__all__ = [
    "BUILTIN_MODELS",
    "ClientGroupConfig",
    "ClusterConfig",
    "ConfigError",
    "ConfigIssue",
    "MergeConfig",
    "RunConfig",
    "ServerConfig",
    "ServingConfig",
    "StoreConfig",
    "Topology",
    "TrainerConfig",
    "apply_overrides",
    "check_array_sizes",
    "check_partitions",
    "dump_topology",
    "format_path",
    "issues_from_validation_error",
    "load_topology",
    "slurm_memory_mb",
    "slurm_time_minutes",
    "validate_topology",
]
