"""Typed, validated pipeline configuration.

Every field is documented where it is declared (Prefect renders these models as the flow's parameter form).
YAML is loaded with :func:`load_config`; ``key.sub=value`` overrides are applied before validation, and any
error (unknown key, wrong type, impossible value) is raised as one :class:`ConfigError` sentence naming the key.

``sections`` holds the run-wide sections (tracking, runtime, data), ``stages`` those of the training stages,
``pipeline`` the whole config and its loading; this package re-exports them (the config API).
"""

from rlhf.config.base import Section, format_validation_error, read_yaml
from rlhf.config.pipeline import (
    PipelineConfig,
    apply_overrides,
    build_config,
    flatten,
    load_config,
    parse_override,
    section_digest,
)
from rlhf.config.ppo import LoraConfig, PPOConfig, PPOGenerationConfig
from rlhf.config.reward import RewardConfig
from rlhf.config.sections import (
    DATA_COLUMN_ROLES,
    DataConfig,
    ReasoningTaskConfig,
    RuntimeConfig,
    SyntheticTaskConfig,
    TrackingConfig,
)
from rlhf.config.stages import (
    BootstrapModelConfig,
    DPOConfig,
    EvalConfig,
    SFTConfig,
    WarmStartConfig,
)
from rlhf.errors import ConfigError

__all__ = [
    "DATA_COLUMN_ROLES",
    "BootstrapModelConfig",
    "ConfigError",
    "DataConfig",
    "DPOConfig",
    "EvalConfig",
    "LoraConfig",
    "PPOConfig",
    "PPOGenerationConfig",
    "PipelineConfig",
    "ReasoningTaskConfig",
    "RewardConfig",
    "RuntimeConfig",
    "SFTConfig",
    "Section",
    "SyntheticTaskConfig",
    "TrackingConfig",
    "WarmStartConfig",
    "apply_overrides",
    "build_config",
    "flatten",
    "format_validation_error",
    "load_config",
    "parse_override",
    "read_yaml",
    "section_digest",
]
