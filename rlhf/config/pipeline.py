"""The whole pipeline's config: YAML loading, ``key.sub=value`` overrides, validation, digests and flattening."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from rlhf.config.base import Section, format_validation_error, read_yaml, safe_load
from rlhf.config.ppo import PPOConfig
from rlhf.config.reward import RewardConfig
from rlhf.config.sections import DataConfig, RuntimeConfig, TrackingConfig
from rlhf.config.stages import DPOConfig, EvalConfig, SFTConfig, WarmStartConfig
from rlhf.errors import ConfigError


class PipelineConfig(Section):
    """The whole pipeline: one YAML file (conf/default.yaml) maps onto this model."""

    seed: int = Field(0, description="Global seed for model init, sampling and shuffling.")
    policy_seed: int | None = Field(
        None,
        description="Seed of the policy stage alone (PPO's sampling and minibatches, DPO's shuffling); None uses "
        "`seed`. Varying it repeats the policy stage on one cached SFT and reward model (the algorithm study).",
    )
    run_name: str | None = Field(None, description="Name of the MLflow parent run; None picks one.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    algorithm: Literal["ppo", "dpo"] = Field(
        "ppo",
        description="The policy stage: 'ppo' (online RL on sampled responses, with the estimator of "
        "ppo.advantage_estimator: PPO, GRPO, RLOO, REINFORCE++) or 'dpo' (offline, on the preference pairs; the "
        "reward model is still trained, for the evaluation). docs/objectives.md.",
    )
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @property
    def policy_stage_seed(self) -> int:
        """The seed the policy stage (PPO or DPO) runs with: `policy_seed`, else `seed`."""
        return self.seed if self.policy_seed is None else self.policy_seed

    @model_validator(mode="after")
    def _data_tokenizer_is_the_policys(self) -> PipelineConfig:
        """Chat data is rendered, and lengths measured, with the policy's tokenizer: `data.tokenizer` defaults to
        `sft.model` (at `sft.revision`, its GGUF file `sft.gguf_file`) when it is unset."""
        if self.data.tokenizer is None and self.sft.model is not None:
            self.data.tokenizer = self.sft.model
            if self.data.tokenizer_revision is None:
                self.data.tokenizer_revision = self.sft.revision
            if self.data.tokenizer_gguf_file is None:
                self.data.tokenizer_gguf_file = self.sft.gguf_file
        if self.reward.is_ensemble and self.runtime.sharding == "fsdp":
            raise ValueError(
                f"reward.ensemble_size {self.reward.ensemble_size} with runtime.sharding 'fsdp': an ensemble's members "
                "are not sharded; use one reward model or runtime.sharding: none"
            )
        if self.data.max_length_tokens is not None and self.data.tokenizer is None:
            raise ValueError(
                "data.max_length_tokens needs data.tokenizer (it defaults to sft.model); or use data.max_length_chars"
            )
        return self

    @model_validator(mode="after")
    def _runtime_knows_the_model_width(self) -> PipelineConfig:
        """`runtime.dtype: auto` is decided at the policy's width on a CPU: tell the runtime section (on every
        validation, so a variant that changes the model gets its own)."""
        self.runtime.with_model_width(policy_width(self.sft))
        return self

    @model_validator(mode="after")
    def _own_sft_trains(self) -> PipelineConfig:
        """reward.ensemble_trunks 'own_sft' needs an SFT stage that trains."""
        reward = self.reward
        if reward.is_ensemble and reward.ensemble_trunks == "own_sft" and self.sft.model and not self.sft.finetune:
            raise ValueError(
                f"reward.ensemble_trunks 'own_sft' has nothing to vary: sft.model ({self.sft.model}) is used as it is "
                "(sft.finetune false); set sft.finetune true to fine-tune it anew for each member, or list the "
                "members' own models in reward.ensemble_models"
            )
        return self

    @model_validator(mode="after")
    def _warm_start_has_a_verifier(self) -> PipelineConfig:
        """warm_start.enabled keeps the responses reward.function (or reward.functions) passes: without a function
        there is nothing to keep them by."""
        if self.warm_start.enabled and not self.reward.function_specs:
            raise ValueError(
                "warm_start.enabled needs reward.function to keep the sampled responses by (reward.source is "
                f"'{self.reward.source}' with no function): name a verifier, e.g. reward.function="
                "rlhf.data.verifiers:ifeval_strict, or set warm_start.enabled: false"
            )
        return self


def policy_width(sft: SFTConfig) -> int | None:
    """The policy model's hidden size, read without loading it: the embedded model's `sft.bootstrap.n_embd`, else
    the hidden size in the config.json of `sft.model` where it is a local folder; None where it is unknown here (a hub
    id, a GGUF file, an unreadable folder: preflight names those)."""
    if sft.model is None:
        return sft.bootstrap.n_embd
    try:
        fields = json.loads((Path(sft.model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict):
        return None
    if isinstance(fields.get("text_config"), dict):  # a multimodal checkpoint: its language model's
        fields = fields["text_config"]
    return next((fields[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(fields.get(k), int)), None)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'ppo.kl_coef=0.1'`` -> (['ppo', 'kl_coef'], 0.1); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.sub=value")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override '{text}' has an empty key")
    return parts, safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a raw config dict (validation happens afterwards)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{'.'.join(parts[: i + 1])}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def build_config(raw: dict[str, Any], source: str = "config") -> PipelineConfig:
    """Validate a raw dict; any problem becomes one ConfigError sentence naming the key."""
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load a YAML file (None: the defaults) and apply ``key.sub=value`` overrides."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        raw = read_yaml(path, "config file") or {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, not {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    return build_config(raw, source)


def section_digest(section: BaseModel | dict[str, Any]) -> str:
    """Stable content digest of a config section (part of the stage cache keys)."""
    data = section.model_dump(mode="json") if isinstance(section, BaseModel) else section
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Flatten a config into dotted keys (MLflow params)."""
    out: dict[str, Any] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else k)
        else:
            out[key] = node

    walk(cfg.model_dump(mode="json"), prefix)
    return out
