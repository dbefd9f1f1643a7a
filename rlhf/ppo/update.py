"""One PPO update, steps 1 to 6 (docs/objectives.md "One PPO update"): sample and score a rollout batch, shape the
scores, compute the advantages; each step is one call into ``rlhf.ops``. Step 7, the optimisation, is
``rlhf.ppo.optimise``; the update's statistics and speed: `update_stats`, `speed_stats`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhf.config import PPOConfig
from rlhf.memory import peak_memory_mb
from rlhf.metrics import EPISODES_PER_S, PEAK_MEMORY
from rlhf.ops import (
    ShapedScores,
    broadcast_to_tokens,
    gae,
    group_advantages,
    masked_whiten,
    per_token_rewards,
    reinforce_returns,
    shape_scores,
)
from rlhf.ppo.distributed import DistContext, masked_mean_var
from rlhf.ppo.models import PPOModels
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import PromptBatch
from rlhf.ppo.stats import ensemble_rollout_stats, group_distinct_share, rollout_stats
from rlhf.rollout import scoring
from rlhf.rollout.generation import GenerationSettings
from rlhf.rollout.scoring import ScoredResponses


@dataclass
class Rollout:
    """One rollout batch: the scored responses, then what `compute_advantages` adds; everything the optimisation
    pass and the statistics need."""

    indices: list[int]  # rows of the prompt list
    scored: ScoredResponses  # query_responses (b, p + r), resp (b, r), logprobs, ref_logprobs, values (b, r), scores
    # filled by compute_advantages
    shaped_scores: Tensor | None = None
    kl: Tensor | None = None
    non_score_rewards: Tensor | None = None
    advantages: Tensor | None = None  # raw advantages (GAE, or the critic-free estimator's)
    loss_advantages: Tensor | None = None  # whitened when configured: what the loss sees
    returns: Tensor | None = None  # GAE's value targets; None without a value model
    group_stats: dict[str, float] = field(default_factory=dict)  # critic-free group estimators: group/*
    # the first epoch's order of the rows, drawn before sampling where the first minibatch computes its own old
    # log-probs (`first_epoch_order`); None: `rlhf.ppo.optimise` draws it
    first_order: Tensor | None = None

    @property
    def mask(self) -> Tensor:
        """The response mask as floats. Shape: (b, r)."""
        return self.scored.resp.mask.float()


def generate_and_score(
    models: PPOModels,
    batch: PromptBatch,
    prompts: list[str] | None,
    cfg: PPOConfig,
    settings: GenerationSettings,
    generator: torch.Generator,
    plan: ExecutionPlan,
    first_order: Tensor | None = None,
    rows: list[str] | None = None,
) -> Rollout:
    """Steps 1-3: sample responses, then (no grad) policy and reference log-probs, values and scores, on the plan's
    device, under its autocast dtype (float32 turns it off) and threads.

    `batch.indices` are the rows of `prompts` in the batch (None: no texts, when no reward model re-tokenizes), and
    of `rows`, the prompts' row keys (``rlhf.rollout.rows``; None: no reward function takes row columns).
    `first_order` (`first_epoch_order`): the policy and reference log-probs of the first minibatch's rows are
    computed on the rows, and the columns, that the optimisation's first policy forwards take
    (`ExecutionPlan.rollout_groups`), on its torch threads, so that they are what it computes, bit for bit; where
    `defers_old_logprobs`, those rows get no policy forward here: the optimisation's first pass computes their
    log-probs (the policy has not changed yet) and writes them in. Shape: batch.ids, batch.mask (b, p).
    """
    texts = [prompts[i] for i in batch.indices] if prompts is not None else None
    keys = [rows[i] for i in batch.indices] if rows is not None else None
    query, query_mask = batch.ids.to(plan.device), batch.mask.to(plan.device)
    deferred = groups = None
    if first_order is not None:
        groups = plan.rollout_groups(first_order, cfg, critic=models.value is not None)
        if defers_old_logprobs(cfg):
            deferred = torch.zeros(len(batch.indices), dtype=torch.bool)
            deferred[first_order[: cfg.mini_batch_size // plan.world_size]] = True
    scored = scoring.generate_and_score(
        models.scoring(), query, query_mask, texts, settings, generator, plan.dtype, cfg.forward_batch_size,
        second_thread=plan.scoring_second_thread, deferred=deferred, groups=groups,
        policy_threads=plan.optimise_threads if groups is not None else None,
        paired=groups is not None and plan.paired_scoring, rows=keys,
    )  # fmt: skip
    return Rollout(batch.indices, scored, first_order=first_order)


def first_epoch_order(cfg: PPOConfig, shuffle_generator: torch.Generator, n: int) -> Tensor | None:
    """The first epoch's shuffled order of an update's `n` rows, drawn (from the generator the optimisation shuffles
    with, as it would have drawn it) before sampling, so that the rollout's log-probs of the first minibatch are
    computed on the rows its forwards take (`generate_and_score`). None where dynamic sampling merges batches (the
    rows are not known before it ends): the optimisation then draws it."""
    if cfg.dynamic_rounds:
        return None
    return torch.randperm(n, generator=shuffle_generator)


def defers_old_logprobs(cfg: PPOConfig) -> bool:
    """Whether the first minibatch's old log-probs are the first optimizer step's own forward, detached (the policy
    has not changed yet: TRL's GRPO does the same with one iteration), rather than a no-grad forward at sampling:
    where nothing before the optimisation needs them, the KL to the reference being in the loss (ppo.kl_in 'loss':
    no reward depends on it). It saves the rollout's policy forward over those rows: all of them with one minibatch
    and one epoch."""
    return cfg.kl_placement == "loss"


def refresh_kl(rollout: Rollout, cfg: PPOConfig) -> None:
    """Once the optimisation has written the deferred rows' log-probs (`first_epoch_order`): the rollout's KL to the
    reference (its statistics and the KL controller's), which `compute_advantages` could not see there. The KL is in
    the loss, so no reward or advantage depended on it."""
    scored = rollout.scored
    if scored.deferred is None:
        return
    token_rewards = per_token_rewards(
        rollout.shaped_scores, scored.logprobs, scored.ref_logprobs, rollout.mask, 0.0, cfg.kl_estimator_used
    )
    rollout.kl, rollout.non_score_rewards = token_rewards.kl, token_rewards.non_score_rewards
    scored.deferred = None


def shaped_scores(scored: ScoredResponses, cfg: PPOConfig) -> ShapedScores:
    """The reward model's scores shaped as the config says (`rlhf.ops.shape_scores`): clipped, penalised for a
    missing stop token or a short response, and DAPO's overlong penalty (ppo.overlong_buffer)."""
    return shape_scores(
        scored.scores,
        scored.resp.mask.sum(1),
        scored.resp.contains_stop,
        clip=cfg.score_clip,
        missing_eos_penalty=cfg.missing_eos_penalty,
        missing_eos_mode=cfg.missing_eos_mode,
        min_length=cfg.min_response_length,
        min_length_penalty=cfg.min_length_penalty,
        min_length_mode=cfg.min_length_mode,
        overlong_max_length=cfg.max_new_tokens,
        overlong_buffer=cfg.overlong_tokens or None,
        overlong_factor=cfg.overlong_penalty,
    )


def compute_advantages(rollout: Rollout, cfg: PPOConfig, kl_coef: float, dist: DistContext | None = None) -> Rollout:
    """Steps 4-6: shape scores, per-token rewards (KL penalty + score at the last token), advantages, whitening.

    ppo.advantage_estimator 'gae' runs GAE over the value model's values; the critic-free estimators go through
    `critic_free_advantages`. With several processes (`dist`), the whitening moments are those of the global batch
    (every rank's shard), so W processes whiten as one process with the same global batch would.
    """
    t0 = time.perf_counter()
    mask = rollout.mask
    several = dist is not None and dist.world_size > 1

    def whiten(x: Tensor, restore_mean: bool) -> Tensor:
        moments = masked_mean_var(x, mask) if several else None
        return masked_whiten(x, mask, restore_mean=restore_mean, moments=moments)

    scored = rollout.scored
    shaped = shaped_scores(scored, cfg)
    reward_kl_coef = kl_coef if cfg.kl_placement == "reward" else 0.0  # KL in the loss: not in the reward
    token_rewards = per_token_rewards(
        shaped.scores, scored.logprobs, scored.ref_logprobs, mask, reward_kl_coef, cfg.kl_estimator_used
    )
    rollout.shaped_scores, rollout.kl, rollout.non_score_rewards = (
        shaped.scores,
        token_rewards.kl,
        token_rewards.non_score_rewards,
    )
    if cfg.critic_free:
        batch_std = None
        if cfg.reward_scale == "batch":  # the global batch's std of the sequence rewards (TRL's scale_rewards)
            sequence_rewards = rollout.shaped_scores + rollout.non_score_rewards.sum(1)
            ones = torch.ones_like(sequence_rewards)
            batch_std = masked_mean_var(sequence_rewards, ones)[1].sqrt()
        advantages, rollout.group_stats = critic_free_advantages(rollout, cfg, reward_kl_coef, whiten, batch_std)
        rollout.advantages = advantages
        rollout.loss_advantages = rollout.advantages
    else:
        rewards = token_rewards.rewards
        if cfg.whiten_rewards:
            rewards = whiten(rewards, cfg.whiten_rewards_keep_mean)
        adv = gae(rewards, scored.values, mask, cfg.gamma, cfg.lam)
        rollout.advantages, rollout.returns = adv.advantages, adv.returns
        rollout.loss_advantages = whiten(adv.advantages, False) if cfg.whiten_advantages else adv.advantages
    scored.timings["time/advantages"] = time.perf_counter() - t0
    return rollout


def critic_free_advantages(
    rollout: Rollout,
    cfg: PPOConfig,
    reward_kl_coef: float,
    whiten: Callable[[Tensor, bool], Tensor],
    batch_std: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The advantages of a critic-free estimator (docs/objectives.md) and its group statistics.

    The rollout's rows hold whole groups of ppo.samples_per_prompt samples of one prompt, contiguous
    (`rlhf.ppo.prompts.prompt_batch`). grpo, dr_grpo and rloo give every token of a response its sequence's
    advantage: the shaped score (minus `reward_kl_coef` times the response's KL when the KL is in the reward) against
    its group's baseline (grpo and dapo divided as ppo.scale_rewards says: by the group's std, by `batch_std`, the
    global batch's, or not at all). reinforce_pp takes the return to go of the per-token rewards (KL penalty at
    every token, score at the last), whitened over the global batch (`whiten`); reinforce_pp_baseline subtracts the
    group mean of the scores first.

    Shape: rollout tensors (b, r); advantages (b, r), 0 at padding.
    """
    scored, mask, group = rollout.scored, rollout.mask, cfg.samples_per_prompt
    estimator = cfg.estimator.advantages
    if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
        scores = rollout.shaped_scores
        groups = group_advantages(scores, group, estimator)
        token_rewards = per_token_rewards(
            groups.advantages, scored.logprobs, scored.ref_logprobs, mask, reward_kl_coef, cfg.kl_estimator_used
        )
        advantages = whiten(reinforce_returns(token_rewards.rewards, mask, cfg.gamma), False)
    else:
        # the sequence reward: the shaped score, less the KL penalty where the KL goes in the reward
        sequence_rewards = rollout.shaped_scores + rollout.non_score_rewards.sum(1)  # (b, r) -> (b,)
        groups = group_advantages(sequence_rewards, group, estimator, scale=cfg.reward_scale, batch_std=batch_std)
        advantages = broadcast_to_tokens(groups.advantages, mask)
    if group == 1:  # reinforce_pp with one sample a prompt: no groups to describe
        return advantages, {}
    stats = {
        "group/reward_std": float(groups.group_std.mean()),
        "group/zero_std_fraction": float(groups.zero_std_fraction),
        "group/distinct_responses": group_distinct_share(scored.resp.tokens, mask, group),
    }
    return advantages, stats


def update_stats(
    rollout: Rollout,
    optim_stats: dict[str, float],
    ratio_quantiles: list[float],
    kl_coef: float,
    in_distribution_std: float = 0.0,
) -> dict[str, float]:
    """One update's statistics: the rollout's (`rollout_stats`), its groups' and an ensemble's, the optimisation
    pass's (`optim_stats`) and the quantiles of its probability ratios."""
    scored = rollout.scored
    stats = rollout_stats(
        scores=scored.scores,
        shaped_scores=rollout.shaped_scores,
        contains_stop=scored.resp.contains_stop,
        logprobs=scored.logprobs,
        ref_logprobs=scored.ref_logprobs,
        kl=rollout.kl,
        non_score_rewards=rollout.non_score_rewards,
        response_mask=rollout.mask,
        query_lengths=scored.qr_mask[:, : scored.prompt_len].sum(1),
        advantages=rollout.advantages,
        returns=rollout.returns,
        values=scored.values,
        kl_coef=kl_coef,
    )
    stats.update(rollout.group_stats)
    stats.update(ensemble_rollout_stats(scored.member_scores, in_distribution_std))
    stats.update(optim_stats)
    stats.update(dict(zip(("dist/ratio_p05", "dist/ratio_p50", "dist/ratio_p95"), ratio_quantiles, strict=True)))
    return stats


def speed_stats(
    rollout: Rollout,
    stats: dict[str, float],
    t0: float,
    t_stats: float,
    batch_size: int,
    device: torch.device,
    world_size: int = 1,
) -> dict[str, float]:
    """Times of this rank; `batch_size` is the global batch, and with W ranks this rank's tokens count W times,
    so that the mean over ranks is the run's throughput."""
    now = time.perf_counter()
    total = now - t0
    return {
        **rollout.scored.timings,
        "time/stats": now - t_stats,
        "time/total": total,
        EPISODES_PER_S: batch_size / total,
        "speed/tokens_per_s": float(rollout.mask.sum()) * world_size / total,
        PEAK_MEMORY: peak_memory_mb(device),
    }
