"""The config of every command: documented dataclasses (schema.py: the training run's sections; commands.py: the
other commands' sections) filled from YAML and dotted CLI overrides (load.py)."""

from flashdraft.config.commands import (
    BASELINES,
    BenchCommand,
    DoctorCommand,
    EvalCommand,
    ExportCommand,
    PrepareCommand,
    RegenerateCommand,
    is_switch,
    resolve_switch,
)
from flashdraft.config.load import Field, describe_fields, explicit_fields, fields_of, from_dict, load_config, to_dict
from flashdraft.config.schema import (
    CHOICES,
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
)

__all__ = [
    "BASELINES",
    "CHOICES",
    "BenchCommand",
    "ConfigError",
    "DataConfig",
    "DoctorCommand",
    "DrafterConfig",
    "EvalCommand",
    "ExportCommand",
    "Field",
    "LogConfig",
    "OptimConfig",
    "PrepareCommand",
    "RecipeConfig",
    "RegenerateCommand",
    "RunConfig",
    "S3Config",
    "TargetConfig",
    "TrainConfig",
    "describe_fields",
    "explicit_fields",
    "fields_of",
    "from_dict",
    "is_switch",
    "load_config",
    "resolve_switch",
    "to_dict",
]
