"""Typed, validated pipeline configuration.

Every field is documented where it is declared (Prefect renders these models as the flow's parameter form).
YAML is loaded with :func:`load_config`; ``key.sub=value`` overrides are applied before validation, and any
error (unknown key, wrong type, impossible value) is raised as one :class:`ConfigError` sentence naming the key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhf.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrackingConfig(_Section):
    uri: str = Field("sqlite:///mlruns/mlflow.db", description="MLflow tracking URI (SQLite file or a server URL).")
    artifact_location: str = Field(
        "mlruns/artifacts", description="Where new experiments store artifacts (a local folder or an object-store URI)."
    )
    experiment: str = Field("rlhf-ppo", description="MLflow experiment name.")
    log_checkpoints: bool = Field(True, description="Log every model checkpoint as an MLflow artifact.")
    registered_model: str | None = Field(
        None,
        description="Register each pipeline run's PPO policy as a version of this MLflow registered model (tagged "
        "with the evaluation summary; a cached policy keeps its version). Needs log_checkpoints.",
    )

    @model_validator(mode="after")
    def _registry_needs_checkpoints(self) -> TrackingConfig:
        if self.registered_model is not None and not self.registered_model.strip():
            raise ValueError("tracking.registered_model must be a non-empty name (or null)")
        if self.registered_model and not self.log_checkpoints:
            raise ValueError(
                "tracking.registered_model needs tracking.log_checkpoints: a model version points at the logged "
                "checkpoint"
            )
        return self


class RuntimeConfig(_Section):
    device: str = Field("auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype. Trained models (SFT, reward, PPO policy and value) keep float32 weights and run "
        "under autocast in this dtype on CUDA; frozen ones (PPO reference and reward model, evaluation) are loaded "
        "in it. 'auto': bfloat16 on a CUDA device that supports it, else float32. float16 has no loss scaling.",
    )
    attn_implementation: str | None = Field(
        "sdpa",
        description="Attention kernel of every loaded model ('sdpa', 'eager', 'flash_attention_2', ...); 'sdpa' "
        "falls back to eager for models without it (Gemma-2); None lets transformers choose.",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads; None keeps torch's default.")
    trust_remote_code: bool = Field(False, description="Allow model/tokenizer code from the hub. Off by default.")
    output_dir: str = Field("outputs", description="Root folder for checkpoints and prepared data.")
    progress: bool = Field(True, description="Show progress bars in the terminal.")
    ppo_processes: int = Field(
        1,
        ge=1,
        description="Data-parallel processes of the PPO stage on this machine: > 1 runs it under torchrun (one per "
        "GPU; gloo processes on CPU). ppo.batch_size stays the global batch.",
    )
    memory_check: Literal["error", "warn", "off"] = Field(
        "error",
        description="Before any weight loads, estimate each stage's memory from the model's config.json and compare "
        "it with the device's free memory (RAM on CPU): 'error' stops with the estimate and the settings that would "
        "fit, 'warn' only warns, 'off' skips the check.",
    )
    memory_budget_gb: float | None = Field(
        None, gt=0, description="Memory budget of the check in GiB; None uses the device's free memory."
    )
    on_nonfinite: Literal["stop", "skip_update"] = Field(
        "stop",
        description="When a trainer's loss or gradient norm is NaN or infinite (SFT, reward model, PPO): 'stop' fails "
        "the stage with the stage, step and statistic, keeping the last saved state (a rerun resumes from it; Prefect "
        "does not retry); 'skip_update' skips that optimizer step and counts it in the metric */skipped_nonfinite.",
    )

    @field_validator("memory_check", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="before")
    @classmethod
    def _bf16_is_dtype_now(cls, data: Any) -> Any:
        if isinstance(data, dict) and "bf16" in data:
            raise ValueError("runtime.bf16 was replaced by runtime.dtype ('auto', 'float32', 'bfloat16' or 'float16')")
        return data


class SyntheticTaskConfig(_Section):
    seed: int = Field(0, description="Seed of the generated task (prompts, demonstrations, pairs).")
    n_sft: int = Field(4000, ge=16, description="Number of SFT demonstrations.")
    n_train_pairs: int = Field(4000, ge=16, description="Number of training preference pairs.")
    n_eval_pairs: int = Field(500, ge=8, description="Number of held-out preference pairs.")
    label_noise: float = Field(
        0.1, ge=0.0, lt=0.5, description="Probability that a training pair's label is flipped (human-like noise)."
    )


# Roles a source column can play (``data.columns`` maps a role to the source's column name).
DATA_COLUMN_ROLES = (
    "prompt",
    "chosen",
    "rejected",
    "score_chosen",
    "score_rejected",
    "margin",
    "responses",
    "scores",
    "ranks",
)


class DataConfig(_Section):
    """Where the preference data comes from and how it is validated (see rlhf/data/ and docs/data.md)."""

    source: Literal["synthetic", "local", "hub"] = Field(
        "synthetic",
        description="'synthetic': the built-in task; 'local': a file or save_to_disk folder (see `path`); "
        "'hub': a Hugging Face hub data set (see `name`).",
    )
    path: str | None = Field(
        None,
        description="Local JSONL/JSON/Parquet/CSV file (the text ones also compressed: .jsonl.gz, .csv.bz2, .json.xz, "
        "...), a `save_to_disk` folder or a folder of data files (source 'local').",
    )
    eval_path: str | None = Field(None, description="Optional separate held-out file; else `eval_fraction` is split.")
    name: str | None = Field(
        None, description="Hub data set id (source 'hub'), e.g. 'Anthropic/hh-rlhf'; any `load_dataset` path works."
    )
    config_name: str | None = Field(None, description="Hub data set configuration (`load_dataset`'s `name`).")
    data_dir: str | None = Field(
        None,
        description="Sub-folder of the hub data set (or of a local data folder) to read, e.g. 'helpful-base' of "
        "Anthropic/hh-rlhf (`load_dataset`'s `data_dir`).",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of the data set.")
    train_split: str = Field("train", description="Split with the training pairs (hub and save_to_disk sources).")
    eval_split: str | None = Field(
        None, description="Split with held-out pairs (hub and save_to_disk); None splits off `eval_fraction`."
    )
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held-out fraction when there is no eval source.")
    split_seed: int = Field(0, description="Seed of the deterministic train/eval split.")
    split_by_prompt: bool = Field(
        True,
        description="Hold out whole prompts, so no prompt has pairs in both train and eval (no leak into the "
        "held-out accuracy); false splits the pairs.",
    )
    format: Literal["auto", "explicit", "implicit", "conversational", "ranked"] = Field(
        "auto",
        description="Layout of the rows: 'auto' detects it; 'explicit' prompt/chosen/rejected strings; 'implicit' "
        "chosen/rejected transcripts sharing a prompt; 'conversational' message lists; 'ranked' responses + scores.",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Role -> source column, e.g. {prompt: question, chosen: response_j}; roles: "
        + ", ".join(DATA_COLUMN_ROLES)
        + ".",
    )
    assistant_marker: str = Field(
        "\n\nAssistant:", description="Implicit format: the prompt ends with the last one of these markers."
    )
    prompts_path: str | None = Field(
        None, description="Separate prompt-only file or folder for PPO rollouts; None uses the training prompts."
    )
    prompts_name: str | None = Field(
        None,
        description="Hub data set id of a prompt-only source for PPO rollouts (instead of `prompts_path`), e.g. "
        "'trl-lib/ultrafeedback-prompt'.",
    )
    prompts_config_name: str | None = Field(None, description="Configuration of the `prompts_name` data set.")
    prompts_revision: str | None = Field(None, description="Revision (branch, tag or commit) of `prompts_name`.")
    prompts_split: str = Field("train", description="Split of `prompts_name` (or of a `prompts_path` folder).")
    prompts_column: str = Field("prompt", description="Column of the prompt source that holds the prompts.")
    max_drop_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="Stop with an error when more than this fraction of rows is dropped."
    )
    max_length_tokens: int | None = Field(
        None, ge=1, description="Drop pairs whose prompt+response is longer (tokens of `tokenizer`); None: no limit."
    )
    max_length_chars: int | None = Field(
        None, ge=1, description="Drop pairs whose prompt+response is longer (characters); None: no limit."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer (path or hub id) that renders message lists with its chat template and measures "
        "lengths in tokens; None defaults to `sft.model` (the policy's tokenizer) when that is set. Override it only "
        "to render for another model.",
    )
    tokenizer_revision: str | None = Field(
        None, description="Hub revision of `tokenizer`; None defaults to `sft.revision` when `tokenizer` is sft.model."
    )
    user_marker: str = Field(
        "\n\nHuman:",
        description="Implicit format with a chat template: transcripts are split into user turns at these markers "
        "(and assistant turns at `assistant_marker`) and rendered with the template.",
    )
    length_warn_fraction: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Warn (task log and manifest) when more than this share of the prompts or pairs is longer than "
        "a stage's length limit (ppo.max_prompt_tokens, reward.max_length, sft.max_length).",
    )
    num_proc: int | None = Field(None, ge=1, description="Processes for validation/tokenization; None: one.")
    batch_size: int = Field(1000, ge=1, description="Rows per validation/tokenization batch (bounds memory).")
    synthetic: SyntheticTaskConfig = Field(default_factory=SyntheticTaskConfig)

    @model_validator(mode="after")
    def _source_needs(self) -> DataConfig:
        if self.source == "local" and not self.path:
            raise ValueError(
                "data.path must name a JSONL/JSON/Parquet/CSV file or a save_to_disk folder when data.source is 'local'"
            )
        if self.prompts_path and self.prompts_name:
            raise ValueError("data.prompts_path and data.prompts_name both name a prompt source; set one of them")
        if self.source == "synthetic" and (self.prompts_path or self.prompts_name):
            raise ValueError(
                "data.prompts_path/prompts_name apply to 'local' and 'hub' sources: the synthetic task's gold reward "
                "is defined on its own prompts"
            )
        if self.source == "hub" and not self.name:
            raise ValueError("data.name must name a hub data set (e.g. 'Anthropic/hh-rlhf') when data.source is 'hub'")
        unknown = sorted(set(self.columns) - set(DATA_COLUMN_ROLES))
        if unknown:
            raise ValueError(f"data.columns: unknown role '{unknown[0]}' (use {', '.join(DATA_COLUMN_ROLES)})")
        return self


class BootstrapModelConfig(_Section):
    vocab_size: int = Field(512, ge=64, description="Byte-level BPE vocabulary trained on the task text.")
    n_layer: int = Field(2, ge=1, description="GPT-2 layers.")
    n_head: int = Field(4, ge=1, description="GPT-2 attention heads.")
    n_embd: int = Field(128, ge=16, description="GPT-2 hidden size (a multiple of n_head).")
    n_positions: int = Field(128, ge=16, description="Maximum sequence length.")

    @model_validator(mode="after")
    def _heads_divide(self) -> BootstrapModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"sft.bootstrap.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        return self


class SFTConfig(_Section):
    model: str | None = Field(
        None,
        description="Existing model (local path or hub id): used as the SFT policy as it is, or fine-tuned first "
        "with `finetune`. None bootstraps a tiny GPT-2 and its tokenizer from the task's demonstrations.",
    )
    revision: str | None = Field(None, description="Hub revision of `model`.")
    finetune: bool = Field(
        False,
        description="Fine-tune `model` on the demonstrations (synthetic task: its demonstrations; otherwise the "
        "chosen responses of the training pairs) before the later stages. Use a small `lr` (1e-5 to 5e-5).",
    )
    bootstrap: BootstrapModelConfig = Field(default_factory=BootstrapModelConfig)
    steps: int = Field(600, ge=1, description="SFT optimizer steps (bootstrapping or fine-tuning).")
    batch_size: int = Field(64, ge=1, description="SFT batch size.")
    lr: float = Field(3e-3, gt=0, description="SFT peak learning rate (AdamW, cosine decay).")
    warmup_steps: int = Field(30, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    max_length: int = Field(
        512, ge=8, description="Fine-tuning: maximum tokens of prompt + response (capped by the model's positions)."
    )
    gradient_checkpointing: bool = Field(False, description="Fine-tuning: trade compute for activation memory.")
    save_every: int = Field(200, ge=1, description="Save the full SFT trainer state every N steps (resume point).")

    @model_validator(mode="after")
    def _finetune_needs_model(self) -> SFTConfig:
        if self.finetune and self.model is None:
            raise ValueError(
                "sft.finetune needs sft.model (the model to fine-tune); without a model the tiny GPT-2 is "
                "bootstrapped and trained anyway"
            )
        return self


class RewardConfig(_Section):
    epochs: float = Field(2.0, gt=0, description="Passes over the training pairs.")
    batch_size: int = Field(32, ge=1, description="Pairs per optimizer step.")
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW, linear decay).")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Fraction of steps of linear warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    use_margin: bool = Field(True, description="Subtract the data's margin column in the loss when present.")
    center_coef: float = Field(0.01, ge=0, description="Reward-centring coefficient c * mean((r_c + r_r)^2).")
    eval_every: int = Field(50, ge=1, description="Evaluate on held-out pairs every N steps; best is kept.")
    max_length: int = Field(128, ge=8, description="Maximum tokens of prompt + response (+ EOS).")
    truncation: Literal["drop", "truncate"] = Field(
        "drop",
        description="Pairs whose prompt + longer response + EOS exceed max_length: 'drop' leaves them out of "
        "training and held-out evaluation (counted: reward/dropped_too_long; an error when more than half are); "
        "'truncate' keeps them, the prompt cut on the left and the response on the right, at least "
        "min_prompt_tokens of the prompt kept.",
    )
    min_prompt_tokens: int = Field(
        8,
        ge=1,
        description="truncation 'truncate': prompt tokens that always survive (all of a shorter prompt), so no "
        "response is scored without its prompt.",
    )
    save_every: int = Field(100, ge=1, description="Save the full trainer state every N steps (resume point).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward: the reward model's activations at real lengths."
    )

    @model_validator(mode="after")
    def _prompt_fits(self) -> RewardConfig:
        if self.min_prompt_tokens >= self.max_length:
            raise ValueError(
                f"reward.min_prompt_tokens ({self.min_prompt_tokens}) must be less than reward.max_length "
                f"({self.max_length}): the response needs room too"
            )
        return self


class LoraConfig(_Section):
    enabled: bool = Field(False, description="Train LoRA adapters on the policy (needs the 'lora' extra: peft).")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (keep 0 for exact PPO ratios).")
    target_modules: list[str] | None = Field(None, description="Modules to adapt; None lets peft pick per model.")


class PPOConfig(_Section):
    total_episodes: int = Field(8192, ge=1, description="Prompt/response pairs sampled over the whole run.")
    batch_size: int = Field(64, ge=1, description="Rollout batch: episodes per PPO update.")
    num_mini_batches: int = Field(4, ge=1, description="Minibatches per PPO epoch; must divide batch_size.")
    num_ppo_epochs: int = Field(4, ge=1, description="Optimisation epochs over each rollout batch.")
    lr: float = Field(3e-4, gt=0, description="Policy learning rate (AdamW).")
    value_lr: float = Field(3e-4, gt=0, description="Value-model learning rate (AdamW).")
    kl_coef: float = Field(0.05, ge=0, description="Initial KL penalty coefficient.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="Per-token KL estimator in the reward.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="Policy ratio clip range.")
    cliprange_value: float = Field(0.2, gt=0, description="Value clip range.")
    vf_coef: float = Field(0.1, ge=0, description="Value-loss coefficient.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    whiten_rewards: bool = Field(False, description="Whiten per-token rewards before GAE.")
    whiten_rewards_keep_mean: bool = Field(
        True,
        description="With whiten_rewards: divide the rewards by their std and keep their mean (TRL's "
        "shift_mean=False); false also subtracts the mean.",
    )
    max_new_tokens: int = Field(24, ge=1, description="Maximum response tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (log-probs use the same one).")
    top_k: int | None = Field(None, ge=1, description="Top-k sampling; None disables.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling; None disables.")
    missing_eos_penalty: float | None = Field(
        1.0, description="Subtracted from the score of a response without a stop token; None disables."
    )
    max_prompt_tokens: int = Field(64, ge=1, description="Prompts are left-truncated to this many tokens.")
    stop_tokens: list[int | str] = Field(
        default_factory=list, description="Extra stop tokens (ids or single-token strings); EOS always stops."
    )
    missing_eos_mode: Literal["subtract", "replace"] = Field(
        "subtract", description="'subtract': score - missing_eos_penalty; 'replace': score = missing_eos_penalty."
    )
    min_response_length: int | None = Field(None, ge=1, description="Responses shorter than this are penalised.")
    min_length_penalty: float | None = Field(
        None, description="Penalty for short responses, in the mode of ppo.missing_eos_mode ('subtract' or 'replace')."
    )
    score_clip: float | None = Field(None, gt=0, description="Clip reward-model scores to [-c, c]; None disables.")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="Constant or adaptive KL coefficient.")
    kl_target: float = Field(6.0, gt=0, description="Adaptive controller: target sequence KL (Ziegler et al.).")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive controller: horizon in episodes.")
    whiten_advantages: bool = Field(True, description="Whiten advantages (masked mean 0, std 1) before the loss.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0 disables).")
    target_kl: float | None = Field(
        None, gt=0, description="Stop the PPO epochs of an update early once approximate KL passes this."
    )
    lr_schedule: Literal["constant", "linear"] = Field("linear", description="Learning-rate schedule of both models.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per minibatch optimizer step.")
    forward_batch_size: int | None = Field(
        None, ge=1, description="Rows per no-grad forward pass (reference, reward, value); None: the whole batch."
    )
    value_model: Literal["separate", "policy_head"] = Field(
        "separate",
        description="'separate': a value model initialised from the reward model; 'policy_head': a scalar head on "
        "the policy's trunk (one model, less memory).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    save_every: int = Field(10, ge=1, description="Save the full trainer state every N updates (resume point).")
    record_rollouts: bool = Field(True, description="Write the per-sample rollout records of each update to Parquet.")
    log_every: int = Field(1, ge=1, description="Log statistics every N updates.")

    @model_validator(mode="after")
    def _batches_divide(self) -> PPOConfig:
        if self.batch_size % self.num_mini_batches:
            raise ValueError(
                f"ppo.num_mini_batches ({self.num_mini_batches}) must divide ppo.batch_size ({self.batch_size})"
            )
        if self.mini_batch_size % self.gradient_accumulation_steps:
            raise ValueError(
                f"ppo.gradient_accumulation_steps ({self.gradient_accumulation_steps}) must divide the minibatch size "
                f"(ppo.batch_size / ppo.num_mini_batches = {self.mini_batch_size})"
            )
        if self.total_episodes < self.batch_size:
            raise ValueError(
                f"ppo.total_episodes ({self.total_episodes}) must be at least ppo.batch_size ({self.batch_size})"
            )
        return self

    @property
    def mini_batch_size(self) -> int:
        return self.batch_size // self.num_mini_batches

    @property
    def num_updates(self) -> int:
        return self.total_episodes // self.batch_size


class EvalConfig(_Section):
    n_prompts: int = Field(256, ge=1, description="Held-out prompts to generate for.")
    batch_size: int = Field(64, ge=1, description="Generation batch size.")
    max_new_tokens: int | None = Field(None, ge=1, description="Response length; None uses ppo.max_new_tokens.")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; None uses ppo.temperature.")
    seed: int = Field(1234, description="Generation seed (the same for the SFT and PPO policies).")
    length_tolerance: float = Field(
        0.2,
        ge=0,
        description="Length-matched win rates count the prompts whose PPO and SFT responses differ in length by at "
        "most this fraction of the longer one (docs/evaluation.md).",
    )


class PipelineConfig(_Section):
    """The whole pipeline: one YAML file (conf/default.yaml) maps onto this model."""

    seed: int = Field(0, description="Global seed for model init, sampling and shuffling.")
    run_name: str | None = Field(None, description="Name of the MLflow parent run; None picks one.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _data_tokenizer_is_the_policys(self) -> PipelineConfig:
        """Chat data is rendered, and lengths measured, with the policy's tokenizer: `data.tokenizer` defaults to
        `sft.model` (at `sft.revision`) when it is unset."""
        if self.data.tokenizer is None and self.sft.model is not None:
            self.data.tokenizer = self.sft.model
            if self.data.tokenizer_revision is None:
                self.data.tokenizer_revision = self.sft.revision
        if self.data.max_length_tokens is not None and self.data.tokenizer is None:
            raise ValueError(
                "data.max_length_tokens needs data.tokenizer (it defaults to sft.model); or use data.max_length_chars"
            )
        return self


def _format_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        msg = f"{source}: unknown key '{key}'"
    elif kind == "value_error":
        msg = f"{source}: {str(first['msg']).removeprefix('Value error, ')}"
    else:
        got = first.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        msg = f"{source}: {key}: {first['msg']}{got_text}"
    more = len(err.errors()) - 1
    return msg + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'ppo.kl_coef=0.1'`` -> (['ppo', 'kl_coef'], 0.1); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.sub=value")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override '{text}' has an empty key")
    return parts, yaml.safe_load(raw) if raw.strip() else None


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
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Load a YAML file (None: the defaults) and apply ``key.sub=value`` overrides."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
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
