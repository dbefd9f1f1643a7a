"""The four PPO models: policy and frozen reference from the SFT checkpoint, value model and frozen reward model
from the reward model; and what the stage takes from the policy checkpoint, as run parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlhf.config import PPOConfig, RewardConfig, RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.models.compiled import compile_for_training
from rlhf.models.cpu_kernels import use_cpu_kernels
from rlhf.models.device import MODEL_BUILD_LOCK
from rlhf.models.heads import PolicyValueHead
from rlhf.models.loading import (
    load_causal_lm,
    load_options,
    load_reward_model,
    load_tokenizer,
)
from rlhf.models.reference import load_reference_lm
from rlhf.models.reward_ensemble import (
    RewardEnsemble,
    ensemble_objective,
    load_reward,
    member_paths,
    member_tokenizers,
    reward_members,
)
from rlhf.models.stop_tokens import checkpoint_stop_tokens, same_vocabulary, stop_token_ids
from rlhf.models.training import (
    apply_lora,
    disable_dropout,
    enable_gradient_checkpointing,
    lora_targets,
    unwrap,
)
from rlhf.rollout.generation import Sampler
from rlhf.rollout.reward_function import RewardFunctions, reward_function
from rlhf.rollout.rows import RowColumns
from rlhf.rollout.scoring import ScoringModels


@dataclass
class PPOModels:
    """The models of a PPO run and their tokenizers."""

    policy: PreTrainedModel  # a peft model when LoRA is on
    reference: PreTrainedModel | None  # None with LoRA: the policy with adapters disabled
    value: nn.Module | None  # None with a critic-free estimator (ppo.advantage_estimator other than gae)
    reward: PreTrainedModel | RewardEnsemble | None  # None with reward.source: function
    tokenizer: PreTrainedTokenizerBase
    reward_tokenizer: PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]
    same_tokenizer: bool
    sampler: Sampler | None = None  # ppo.generation.backend other than the built-in one (started by the trainer)
    reward_fn: RewardFunctions | None = None  # reward.function(s): the score, or added to the reward model's
    reward_fn_weight: float = 1.0
    # per scoring model, the tokenizer it re-tokenizes the decoded text with (None: the policy's ids as they are)
    member_tokenizers: list[PreTrainedTokenizerBase | None] | None = None

    @property
    def shared_value_head(self) -> bool:
        return isinstance(self.value, PolicyValueHead)

    def value_trainable(self) -> nn.Module | None:
        """The value parameters the value optimizer owns (only the head when the trunk is the policy's); None
        without a value model."""
        return self.value.score if self.shared_value_head else self.value

    def scoring(self) -> ScoringModels:
        """The models `rlhf.rollout.scoring.generate_and_score` samples and scores a rollout with."""
        return ScoringModels(
            policy=self.policy,
            reference=self.reference,
            reward=self.reward,
            tokenizer=self.tokenizer,
            reward_tokenizer=self.reward_tokenizer,
            same_tokenizer=self.same_tokenizer,
            value=self.value,
            sampler=self.sampler,
            reward_fn=self.reward_fn,
            reward_fn_weight=self.reward_fn_weight,
            member_tokenizers=self.member_tokenizers,
        )


def run_choices(cfg: PPOConfig, runtime: RuntimeConfig, policy_path: str) -> dict[str, str]:
    """What the PPO stage takes from the policy checkpoint, as run parameters: the stop tokens and, with LoRA, the
    adapted modules."""
    trust_remote_code = runtime.trust_remote_code
    stops = checkpoint_stop_tokens(policy_path, cfg.stop_tokens, trust_remote_code)
    choices = {"stop_token_ids": json.dumps(list(stops)), "stop_tokens_resolved": json.dumps(list(stops.values()))}
    if cfg.lora.enabled:
        model_type = AutoConfig.from_pretrained(policy_path, trust_remote_code=trust_remote_code).model_type
        choices["lora_target_modules_resolved"] = json.dumps(lora_targets(model_type, cfg.lora.target_modules))
    return choices


def compile_trained_models(policy: nn.Module, value: nn.Module | None) -> None:
    """runtime.compile_training: the policy's and the value model's training forwards under torch.compile
    (`rlhf.models.compiled`)."""
    for model in (policy, value):
        if model is not None:
            compile_for_training(unwrap(model))


def load_models(
    cfg: PPOConfig,
    runtime: RuntimeConfig,
    policy_path: str,
    reward_path: str | None,
    value_path: str | None,
    device: torch.device,
    reward_cfg: RewardConfig | None = None,
    columns: RowColumns | None = None,
) -> PPOModels:
    """Policy and frozen reference from the SFT checkpoint; value model and frozen reward model from the RM.

    `columns`: the row columns (data.row_columns) of the prompts the reward function of `reward_cfg` scores.

    A critic-free estimator (`cfg.critic_free`) loads no value model at all; `reward_path` None (reward.source:
    function) no reward model: the reward function of `reward_cfg` scores alone, and gae's value model starts from
    `value_path` (the SFT checkpoint, with a new scalar head). Trained models (policy, value) get float32 weights,
    the frozen reward model the runtime dtype (`load_options`); the reference computes under the run's autocast
    exactly what the policy computes at the same weights (`load_reference_lm`: float32 but for the matmul weights),
    so the first update's KL is 0 and its ratio 1 in every runtime dtype; with LoRA it is the policy itself with
    its adapters disabled.
    """
    trained, frozen = (load_options(runtime, device, trainable) for trainable in (True, False))
    trust_remote_code = runtime.trust_remote_code
    policy = load_causal_lm(policy_path, device, **trained)
    tokenizer = load_tokenizer(policy_path, trust_remote_code=trust_remote_code)
    reward_tokenizer = (
        tokenizer if reward_path is None else load_tokenizer(reward_path, trust_remote_code=trust_remote_code)
    )
    stops = stop_token_ids(tokenizer, cfg.stop_tokens, policy.config, policy.generation_config)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    reference = None if cfg.lora.enabled else load_reference_lm(policy_path, runtime, device)
    if cfg.lora.enabled:
        policy = apply_lora(policy, cfg.lora)
    value: nn.Module | None = None
    if cfg.critic_free:
        pass
    elif cfg.value_model == "policy_head":
        with MODEL_BUILD_LOCK:
            value = PolicyValueHead(unwrap(policy))
    else:
        value_path = member_paths(value_path or policy_path)[0]  # an ensemble's value model: member 0's
        value = load_reward_model(value_path, device, **trained)
        if not same_vocabulary(tokenizer, load_tokenizer(value_path, trust_remote_code=trust_remote_code)):
            raise ConfigError(f"the value model {value_path} must share the policy's tokenizer (it scores every token)")
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(value)
    reward = (
        None if reward_path is None else load_reward(reward_path, device, *ensemble_objective(reward_cfg), **frozen)
    )
    reward_fn, reward_fn_weight = reward_function(reward_cfg, columns)
    readers = None if reward_path is None else member_tokenizers(reward_path, tokenizer, trust_remote_code)
    for frozen_model in (reference, reward):
        if frozen_model is not None:
            frozen_model.requires_grad_(False)
            frozen_model.eval()
    scorers = reward_members(reward) if reward is not None else []
    for model in (policy, value, *scorers, reference):
        if model is not None:
            disable_dropout(model)
            use_cpu_kernels(model)
    if runtime.compile_training:
        compile_trained_models(policy, value)
    return PPOModels(
        policy,
        reference,
        value,
        reward,
        tokenizer,
        reward_tokenizer,
        stops,
        readers is None or all(reader is None for reader in readers),
        reward_fn=reward_fn,
        reward_fn_weight=reward_fn_weight,
        member_tokenizers=readers,
    )
