"""The four PPO models, the trainer state that is saved for resume, prompt batches and reward scoring."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_model, save_model
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf import models
from rlhf.batching import encode_prompt_response, pad_left
from rlhf.checkpoints import atomic_dir
from rlhf.config import PPOConfig, RuntimeConfig
from rlhf.ops import AdaptiveKLController, FixedKLController, make_kl_controller
from rlhf.ppo.rollout import Responses

STATE_FILE = "trainer_state.pt"


@dataclass
class PPOModels:
    policy: PreTrainedModel
    reference: PreTrainedModel
    value: PreTrainedModel
    reward: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    reward_tokenizer: PreTrainedTokenizerBase
    value_tokenizer: PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]
    same_tokenizer: bool


@dataclass
class TrainerState:
    step: int
    policy_opt: torch.optim.Optimizer
    value_opt: torch.optim.Optimizer
    policy_sched: torch.optim.lr_scheduler.LRScheduler
    value_sched: torch.optim.lr_scheduler.LRScheduler
    kl_ctl: FixedKLController | AdaptiveKLController
    sample_generator: torch.Generator
    shuffle_generator: torch.Generator


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a.get_vocab() == b.get_vocab()


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, stop_tokens: list[int | str]) -> tuple[int, ...]:
    """EOS plus configured stop tokens; a string must be exactly one token of the policy's vocabulary."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for tok in stop_tokens:
        if isinstance(tok, int):
            ids.append(tok)
            continue
        encoded = tokenizer(tok, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ValueError(f"ppo.stop_tokens: '{tok}' is {len(encoded)} tokens for this tokenizer, not one")
        ids.append(encoded[0])
    return tuple(dict.fromkeys(ids))


def load_models(
    cfg: PPOConfig, runtime: RuntimeConfig, policy_path: str, reward_path: str, value_path: str, device: torch.device
) -> PPOModels:
    """Policy and frozen reference from the SFT checkpoint; value model and frozen reward model from the RM."""
    trc = runtime.trust_remote_code
    policy = models.load_causal_lm(policy_path, device, trust_remote_code=trc)
    reference = models.load_causal_lm(policy_path, device, trust_remote_code=trc)
    value = models.load_reward_model(value_path, device, trust_remote_code=trc)
    reward = models.load_reward_model(reward_path, device, trust_remote_code=trc)
    for frozen in (reference, reward):
        frozen.requires_grad_(False)
    for model in (policy, reference, value, reward):
        model.eval()  # no dropout: the ratio must be exactly 1 before the first optimizer step
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=trc)
    reward_tokenizer = models.load_tokenizer(reward_path, trust_remote_code=trc)
    value_tokenizer = models.load_tokenizer(value_path, trust_remote_code=trc)
    if not same_vocabulary(tokenizer, value_tokenizer):
        raise ValueError(f"the value model {value_path} must share the policy's tokenizer (it scores every token)")
    return PPOModels(
        policy,
        reference,
        value,
        reward,
        tokenizer,
        reward_tokenizer,
        value_tokenizer,
        stop_token_ids(tokenizer, cfg.stop_tokens),
        same_vocabulary(tokenizer, reward_tokenizer),
    )


def _schedule(cfg: PPOConfig):
    total = cfg.num_updates
    if cfg.lr_schedule == "linear":
        return lambda step: max(0.0, 1.0 - step / total)
    return lambda step: 1.0


def load_state(folder: Path, m: PPOModels, cfg: PPOConfig, seed: int, device: torch.device) -> TrainerState:
    """A fresh trainer state, or the one saved in `folder` (weights, optimizers, schedulers, KL, RNGs, step)."""
    saved: dict[str, Any] | None = None
    if (folder / STATE_FILE).is_file():
        saved = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
        load_model(m.policy, folder / "policy.safetensors", device=str(device))
        load_model(m.value, folder / "value.safetensors", device=str(device))
    policy_opt = torch.optim.AdamW(m.policy.parameters(), lr=cfg.lr, eps=1e-5)
    value_opt = torch.optim.AdamW(m.value.parameters(), lr=cfg.value_lr, eps=1e-5)
    state = TrainerState(
        step=0,
        policy_opt=policy_opt,
        value_opt=value_opt,
        policy_sched=torch.optim.lr_scheduler.LambdaLR(policy_opt, _schedule(cfg)),
        value_sched=torch.optim.lr_scheduler.LambdaLR(value_opt, _schedule(cfg)),
        kl_ctl=make_kl_controller(cfg.kl_controller, cfg.kl_coef, cfg.kl_target, cfg.kl_horizon),
        sample_generator=torch.Generator(device=device).manual_seed(seed),
        shuffle_generator=torch.Generator().manual_seed(seed + 1),
    )
    if saved is not None:
        state.step = int(saved["step"])
        state.policy_opt.load_state_dict(saved["policy_opt"])
        state.value_opt.load_state_dict(saved["value_opt"])
        state.policy_sched.load_state_dict(saved["policy_sched"])
        state.value_sched.load_state_dict(saved["value_sched"])
        state.kl_ctl.load_state_dict(saved["kl_ctl"])
        state.sample_generator.set_state(saved["sample_rng"])
        state.shuffle_generator.set_state(saved["shuffle_rng"])
    return state


def save_state(folder: Path, m: PPOModels, state: TrainerState) -> None:
    """Write everything a restart needs, atomically (a crash mid-save keeps the previous state)."""
    with atomic_dir(folder) as tmp:
        save_model(m.policy, str(tmp / "policy.safetensors"))  # handles tied weights
        save_model(m.value, str(tmp / "value.safetensors"))
        torch.save(
            {
                "step": state.step,
                "policy_opt": state.policy_opt.state_dict(),
                "value_opt": state.value_opt.state_dict(),
                "policy_sched": state.policy_sched.state_dict(),
                "value_sched": state.value_sched.state_dict(),
                "kl_ctl": state.kl_ctl.state_dict(),
                "sample_rng": state.sample_generator.get_state(),
                "shuffle_rng": state.shuffle_generator.get_state(),
            },
            tmp / STATE_FILE,
        )


@functools.lru_cache(maxsize=4)
def _pass_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


class PromptBatch(NamedTuple):
    ids: Tensor  # (b, p) left-padded
    mask: Tensor  # (b, p)
    indices: list[int]  # rows of the prompt list


def prompt_batch(prompt_ids: list[list[int]], update: int, batch_size: int, seed: int, pad_id: int) -> PromptBatch:
    """Prompts of one update: a seeded stream of shuffled passes, so the data position is the update index."""
    n = len(prompt_ids)
    indices = []
    for pos in range(update * batch_size, (update + 1) * batch_size):
        epoch, offset = divmod(pos, n)
        indices.append(_pass_order(n, seed, epoch)[offset])
    ids, mask = pad_left([prompt_ids[i] for i in indices], pad_id)
    return PromptBatch(ids, mask, indices)


def score_responses(
    m: PPOModels,
    indices: list[int],
    prompts: list[str],
    query_responses: Tensor,
    qr_mask: Tensor,
    resp: Responses,
    cfg: PPOConfig,
    device: torch.device,
) -> Tensor:
    """Reward-model scores of one rollout batch (see :func:`reward_scores`)."""
    return reward_scores(
        m.reward,
        m.reward_tokenizer,
        m.tokenizer,
        m.same_tokenizer,
        [prompts[i] for i in indices],
        query_responses,
        qr_mask,
        resp,
        cfg.forward_batch_size,
        device,
    )


@torch.no_grad()
def reward_scores(
    reward: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
    policy_tokenizer: PreTrainedTokenizerBase,
    same_tokenizer: bool,
    prompts: list[str],
    query_responses: Tensor,
    qr_mask: Tensor,
    resp: Responses,
    forward_batch_size: int | None,
    device: torch.device,
) -> Tensor:
    """Reward-model score at the last real token of each (prompt, response). Shape: (b,).

    Same tokenizer: the policy's token ids are scored as they are. Different tokenizers: the response is decoded
    and the reward model re-tokenizes prompt and response text (a logged decision, see the PPO stage params).
    """
    if not same_tokenizer:
        texts = policy_tokenizer.batch_decode(
            resp.tokens.masked_fill(resp.mask == 0, policy_tokenizer.pad_token_id), skip_special_tokens=True
        )
        limit = getattr(reward.config, "max_position_embeddings", None) or 1024
        batch = encode_prompt_response(reward_tokenizer, prompts, texts, max_length=limit)
        query_responses, qr_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    size = forward_batch_size or len(query_responses)
    return torch.cat(
        [
            models.sequence_scores(reward, query_responses[i : i + size], qr_mask[i : i + size])
            for i in range(0, len(query_responses), size)
        ]
    ).float()
