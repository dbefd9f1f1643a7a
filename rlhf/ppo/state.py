"""The PPO trainer state: optimizers, schedulers, KL controller and RNGs, saved for resume, and the final models.

The resume state has the format of every trainer's (`rlhf.checkpoints.write_state`): ``policy.safetensors``,
``value.safetensors`` and ``trainer_state.pt``; with sharded models (runtime.sharding 'fsdp') the weights and
optimizer states are a torch.distributed.checkpoint folder instead (`rlhf.ppo.sharded_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file
from torch import Tensor, nn
from transformers import get_scheduler

from rlhf.checkpoints import read_state, write_state
from rlhf.config import PPOConfig
from rlhf.errors import ConfigError
from rlhf.models import sharding
from rlhf.models.training import adamw
from rlhf.ops import AdaptiveKLController, FixedKLController, make_kl_controller
from rlhf.ppo.models import PPOModels
from rlhf.ppo.sharded_state import load_sharded_weights

POLICY_FILE, VALUE_FILE = "policy.safetensors", "value.safetensors"


@dataclass
class TrainerState:
    """Everything of a PPO run that changes from update to update besides the weights."""

    step: int
    policy_params: list[nn.Parameter]
    value_params: list[nn.Parameter]  # empty without a value model (a critic-free estimator)
    policy_opt: torch.optim.Optimizer
    value_opt: torch.optim.Optimizer | None  # None without a value model, as value_sched
    policy_sched: torch.optim.lr_scheduler.LRScheduler
    value_sched: torch.optim.lr_scheduler.LRScheduler | None
    kl_ctl: FixedKLController | AdaptiveKLController
    sample_generator: torch.Generator
    shuffle_generator: torch.Generator

    def policy_held(self, cfg: PPOConfig) -> bool:
        """Whether the update after `step` is one of the critic's warmup (`ppo.critic_warmup`): the value model alone
        learns and the policy stays as it is (never without a value model: `warmup_updates` is 0 there)."""
        return self.step < cfg.warmup_updates


def _scheduler(optimizer: torch.optim.Optimizer, cfg: PPOConfig, updates: int) -> torch.optim.lr_scheduler.LRScheduler:
    """`ppo.lr_schedule`: 'linear' decays to 0 over the model's `updates`, 'constant' keeps the learning rate."""
    return get_scheduler(cfg.lr_schedule, optimizer, num_warmup_steps=0, num_training_steps=updates)


def sample_seed(seed: int, rank: int) -> int:
    """Seed of a rank's sampling generator: `seed` on rank 0 (the single-process run), far apart on the others
    so that no rank's sampling stream is the shuffle stream (seeded ``seed + 1``) or another rank's."""
    return seed + 1_000_003 * rank


def fresh_state(models: PPOModels, cfg: PPOConfig, seed: int, device: torch.device, rank: int = 0) -> TrainerState:
    """Optimizers, schedulers, KL controller and RNGs of a run that starts at update 0.

    The shuffle generator is the same on every rank; the sampling generator differs per rank (`sample_seed`).
    """
    policy_params = [p for p in models.policy.parameters() if p.requires_grad]
    policy_opt = adamw(policy_params, lr=cfg.lr, eps=1e-5)
    value_module = models.value_trainable()
    value_params = [p for p in value_module.parameters() if p.requires_grad] if value_module is not None else []
    value_opt = adamw(value_params, lr=cfg.value_lr, eps=1e-5) if value_module is not None else None
    return TrainerState(
        step=0,
        policy_params=policy_params,
        value_params=value_params,
        policy_opt=policy_opt,
        value_opt=value_opt,
        # the policy's schedule starts after the critic's warmup (ppo.critic_warmup), which leaves the policy as it is
        policy_sched=_scheduler(policy_opt, cfg, cfg.num_updates - cfg.warmup_updates),
        value_sched=_scheduler(value_opt, cfg, cfg.num_updates) if value_opt is not None else None,
        kl_ctl=make_kl_controller(cfg.kl_controller, cfg.kl_coef, cfg.adaptive_kl_target, cfg.kl_horizon),
        sample_generator=torch.Generator(device=device).manual_seed(sample_seed(seed, rank)),
        shuffle_generator=torch.Generator().manual_seed(seed + 1),
    )


def load_state(
    folder: Path,
    models: PPOModels,
    cfg: PPOConfig,
    seed: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
) -> TrainerState:
    """The state saved in `folder` (weights, optimizers, schedulers, KL, RNGs, step), or a fresh one.

    Every rank reads the same files (rank 0 wrote them) and takes its own sampling generator state; a state saved
    by a different number of processes cannot be resumed (the shards of the prompt batches would change).
    """
    state = fresh_state(models, cfg, seed, device, rank)
    saved: dict[str, Any] | None = read_state(folder)
    if saved is None:
        return state
    saved_world = int(saved.get("world_size", 1))
    if saved_world != world_size:
        raise ConfigError(
            f"the PPO trainer state in {folder} was saved by {saved_world} process(es); resume it with the same "
            f"number, not {world_size}"
        )
    saved_sharding, sharded = saved.get("sharding", "none"), sharding.is_sharded(models.policy)
    if saved_sharding != ("fsdp" if sharded else "none"):
        raise ConfigError(
            f"the PPO trainer state in {folder} was saved with runtime.sharding={saved_sharding}; resume it with the "
            "same setting"
        )
    if sharded:
        load_sharded_weights(folder, models, state.policy_opt, state.value_opt)
    else:
        load_model(models.policy, folder / POLICY_FILE, device=str(device))
        state.policy_opt.load_state_dict(saved["policy_opt"])
        if state.value_opt is not None:
            models.value_trainable().load_state_dict(load_file(folder / VALUE_FILE, device=str(device)))
            state.value_opt.load_state_dict(saved["value_opt"])
    state.step = int(saved["step"])
    state.policy_sched.load_state_dict(saved["policy_sched"])
    if state.value_sched is not None:
        state.value_sched.load_state_dict(saved["value_sched"])
    state.kl_ctl.load_state_dict(saved["kl_ctl"])
    state.sample_generator.set_state(saved["sample_rngs"][rank] if world_size > 1 else saved["sample_rng"])
    state.shuffle_generator.set_state(saved["shuffle_rng"])
    return state


def save_state(folder: Path, models: PPOModels, state: TrainerState, sample_rngs: list[Tensor] | None = None) -> None:
    """Write everything a restart needs, atomically (a crash mid-save keeps the previous state).

    With several processes, rank 0 alone calls this, with `sample_rngs`: every rank's sampling generator state in
    rank order (weights, optimizers and the shuffle generator are the same on every rank).
    """
    fields = {**trainer_fields(state, sample_rngs), "policy_opt": state.policy_opt.state_dict()}
    value_weights = {}
    if state.value_opt is not None:  # a critic-free run saves no value model
        fields["value_opt"] = state.value_opt.state_dict()
        value_weights = {VALUE_FILE: models.value_trainable().state_dict()}
    write_state(folder, fields, {POLICY_FILE: models.policy}, value_weights)  # save_model handles tied weights


def trainer_fields(state: TrainerState, sample_rngs: list[Tensor] | None = None) -> dict[str, Any]:
    """What ``trainer_state.pt`` holds besides the optimizer states: step, schedulers, KL controller, RNGs."""
    extra: dict[str, Any] = {}
    if sample_rngs is not None and len(sample_rngs) > 1:
        extra = {"world_size": len(sample_rngs), "sample_rngs": sample_rngs}
    return {
        "step": state.step,
        "policy_sched": state.policy_sched.state_dict(),
        **({"value_sched": state.value_sched.state_dict()} if state.value_sched is not None else {}),
        "kl_ctl": state.kl_ctl.state_dict(),
        "sample_rng": state.sample_generator.get_state(),
        "shuffle_rng": state.shuffle_generator.get_state(),
        **extra,
    }


def save_final(folder: Path, models: PPOModels, weights: dict[str, dict[str, Tensor]] | None = None) -> None:
    """The trained policy (LoRA merged into the base) and value model, loadable with the Auto classes.

    `weights`: the whole "policy" and "value" state dicts of sharded models (`sharded_state.full_weights`)."""
    weights = weights or {}
    policy = models.policy.merge_and_unload() if hasattr(models.policy, "merge_and_unload") else models.policy
    policy.save_pretrained(folder / "policy", safe_serialization=True, state_dict=weights.get("policy"))
    models.tokenizer.save_pretrained(folder / "policy")
    if models.value is None:  # a critic-free run: the policy is all it trains
        return
    (folder / "value").mkdir(parents=True, exist_ok=True)
    if models.shared_value_head:
        save_file(
            {k: v.contiguous() for k, v in models.value.score.state_dict().items()},
            folder / "value" / "value_head.safetensors",
        )
    else:
        models.value.save_pretrained(folder / "value", safe_serialization=True, state_dict=weights.get("value"))
        models.tokenizer.save_pretrained(folder / "value")
