"""The topology of a run: typed models, loading with overrides, and field-path errors."""

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
from ajet_hpc.config.topology import (
    ClientGroupConfig,
    ClusterConfig,
    MergeConfig,
    RunConfig,
    ServerConfig,
    ServingConfig,
    StoreConfig,
    Topology,
    TrainerConfig,
)

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
