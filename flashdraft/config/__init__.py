"""The run config: documented dataclasses (schema.py) filled from YAML and dotted CLI overrides (load.py)."""

from flashdraft.config.load import describe_fields, from_dict, load_config, to_dict
from flashdraft.config.schema import (
    ConfigError,
    DataConfig,
    DrafterConfig,
    LogConfig,
    OptimConfig,
    RecipeConfig,
    RunConfig,
    S3Config,
    TargetConfig,
    TrainConfig,
    is_switch,
    resolve_switch,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "LogConfig",
    "OptimConfig",
    "RecipeConfig",
    "RunConfig",
    "S3Config",
    "TargetConfig",
    "TrainConfig",
    "describe_fields",
    "from_dict",
    "is_switch",
    "load_config",
    "resolve_switch",
    "to_dict",
]
