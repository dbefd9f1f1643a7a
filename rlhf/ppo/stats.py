"""Every PPO statistic of docs/objectives.md, computed from one update's rollout and optimisation pass."""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
from torch import Tensor

from rlhf.config import PPOConfig
from rlhf.metrics import (
    OBJECTIVE_KL,
    OBJECTIVE_KL_COEF,
    OBJECTIVE_RLHF_REWARD,
    OBJECTIVE_SCORES,
    POLICY_APPROXKL,
    POLICY_CLIPFRAC,
)
from rlhf.ops import PolicyLossOutput, ValueLossOutput, explained_variance, masked_mean, masked_quantiles, masked_var


def _to_floats(values: dict[str, Tensor | float]) -> dict[str, float]:
    """The values as Python floats, the tensors of each device copied to the host in one transfer (on a GPU one
    synchronisation a micro-batch instead of one per statistic); float64 on the way, so nothing is rounded."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, Tensor)}
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for key, value in values.items():
        if isinstance(value, Tensor):
            by_device[value.device].append(key)
    for device, keys in by_device.items():
        wide = torch.float32 if device.type == "mps" else torch.float64  # mps has no float64
        stacked = torch.stack([values[k].detach().reshape(()).to(wide) for k in keys])  # type: ignore[union-attr]
        out |= dict(zip(keys, stacked.tolist(), strict=True))
    return {key: out[key] for key in values}


class OptimStats:
    """Running means of the per-minibatch optimisation statistics over all epochs."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, values: dict[str, Tensor | float]) -> None:
        for key, value in _to_floats(values).items():
            self._sums[key] += value
            self._counts[key] += 1

    def means(self) -> dict[str, float]:
        return {k: self._sums[k] / self._counts[k] for k in self._sums}


def _pcts(prefix: str, x: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    mask = torch.ones_like(x) if mask is None else mask
    p05, p50, p95 = masked_quantiles(x.float(), mask, (0.05, 0.5, 0.95))
    return {f"{prefix}_p05": p05, f"{prefix}_p50": p50, f"{prefix}_p95": p95}


@torch.no_grad()
def rollout_stats(
    *,
    scores: Tensor,
    shaped_scores: Tensor,
    contains_stop: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kl: Tensor,
    non_score_rewards: Tensor,
    response_mask: Tensor,
    query_lengths: Tensor,
    advantages: Tensor,
    returns: Tensor | None,
    values: Tensor | None,
    kl_coef: float,
) -> dict[str, float]:
    """Objective, token and distribution statistics of one rollout batch (shapes (b,) and (b, r)); the returns and
    value statistics only where there is a value model (`values` and `returns` not None)."""
    m = response_mask.float()
    kl_seq = kl.sum(1)  # (b, r) -> (b,)
    non_score = non_score_rewards.sum(1)
    response_len = m.sum(1)
    stats = {
        OBJECTIVE_KL: kl_seq.mean().item(),
        OBJECTIVE_KL_COEF: kl_coef,
        "objective/logprobs": masked_mean(logprobs, m).item(),
        "objective/ref_logprobs": masked_mean(ref_logprobs, m).item(),
        "objective/entropy": (-logprobs * m).sum(1).mean().item(),
        "objective/non_score_reward": non_score.mean().item(),
        OBJECTIVE_SCORES: scores.mean().item(),
        "objective/scores_std": scores.std().item() if len(scores) > 1 else 0.0,
        "objective/scores_min": scores.min().item(),
        "objective/scores_max": scores.max().item(),
        "objective/shaped_scores": shaped_scores.mean().item(),
        OBJECTIVE_RLHF_REWARD: (shaped_scores + non_score).mean().item(),
        "objective/stop_rate": contains_stop.float().mean().item(),
        "advantages/mean": masked_mean(advantages, m).item(),
        "tokens/query_len_mean": query_lengths.float().mean().item(),
        "tokens/query_len_std": query_lengths.float().std().item() if len(query_lengths) > 1 else 0.0,
        "tokens/response_len_mean": response_len.mean().item(),
        "tokens/response_len_std": response_len.std().item() if len(response_len) > 1 else 0.0,
    }
    if values is not None and returns is not None:
        stats.update(
            {
                "returns/mean": masked_mean(returns, m).item(),
                "returns/var": masked_var(returns, m).item(),
                "value/mean": masked_mean(values, m).item(),
                "value/var": masked_var(values, m).item(),
                "value/explained_variance": explained_variance(values, returns, m).item(),
            }
        )
    stats.update(_pcts("dist/kl", kl_seq))
    stats.update(_pcts("dist/scores", scores))
    stats.update(_pcts("dist/response_len", response_len))
    stats.update(_pcts("dist/advantages", advantages, m))
    return stats


@torch.no_grad()
def group_distinct_share(tokens: Tensor, mask: Tensor, group_size: int) -> float:
    """The mean over groups (rows ``[g * G, (g + 1) * G)``, one prompt's samples) of the share of the group's
    responses that differ from each other: distinct token sequences over G (1 / G: all G the same). Padding is
    ignored. Shape: tokens and mask (b, r)."""
    masked = torch.where(mask.bool(), tokens, torch.full_like(tokens, -1))
    groups = masked.view(-1, group_size, masked.shape[-1])
    distinct = [len(torch.unique(group, dim=0)) for group in groups]
    return sum(distinct) / (len(distinct) * group_size) if distinct else 1.0


@torch.no_grad()
def ensemble_rollout_stats(member_scores: Tensor | None, in_distribution_std: float) -> dict[str, float]:
    """A reward-model ensemble's view of one rollout batch: its members' mean, std and minimum (means over the
    responses), and the std over the members' std on held-out chosen responses (`disagreement_ratio`). Shape:
    member_scores (K, b); empty without an ensemble (None)."""
    if member_scores is None:
        return {}
    std = member_scores.std(0, unbiased=False).mean().item()
    return {
        "ensemble/mean": member_scores.mean().item(),
        "ensemble/std": std,
        "ensemble/min": member_scores.min(0).values.mean().item(),
        "ensemble/disagreement_ratio": std / in_distribution_std if in_distribution_std > 0 else float("nan"),
    }


@torch.no_grad()
def function_rollout_stats(function_scores: Tensor | None, names: list[str]) -> dict[str, float]:
    """Each reward function's own scores over one rollout batch (reward.functions, TRL's per-function curves):
    rewards/<name>/mean and rewards/<name>/std. Shape: function_scores (F, b), one row per name; empty without
    reward functions (None)."""
    if function_scores is None:
        return {}
    stats: dict[str, float] = {}
    for name, row in zip(names, function_scores, strict=True):
        stats[f"rewards/{name}/mean"] = row.mean().item()
        stats[f"rewards/{name}/std"] = row.std(unbiased=False).item()
    return stats


class MicroStats(NamedTuple):
    """One micro-batch's optimisation statistics; `metrics()` names them with their keys (`MICRO_KEYS`), leaving
    out what the run does not have (value statistics without a value model, the KL loss with the KL in the reward)."""

    policy_loss: Tensor
    value_loss: Tensor | None
    total_loss: Tensor  # policy + vf_coef * value - entropy_coef * entropy (+ kl_coef * KL with ppo.kl_in 'loss')
    entropy: Tensor
    approxkl: Tensor
    policykl: Tensor
    clipfrac: Tensor
    ratio_mean: Tensor
    ratio_var: Tensor
    value_clipfrac: Tensor | None
    value_error: Tensor | None
    kl_loss: Tensor | None
    seq_clipfrac: Tensor | None  # with a sequence-level importance ratio: the share of clipped responses

    @classmethod
    def of(
        cls,
        pl: PolicyLossOutput,
        vl: ValueLossOutput | None,
        entropy: Tensor,
        cfg: PPOConfig,
        kl: Tensor | None = None,
        kl_coef: float = 0.0,
    ) -> MicroStats:
        if vl is None:
            total = pl.loss - cfg.entropy_coef * entropy
        else:
            total = pl.loss + cfg.vf_coef * vl.loss - cfg.entropy_coef * entropy
        if kl is not None:
            total = total + kl_coef * kl
        return cls(
            pl.loss, None if vl is None else vl.loss, total, entropy, pl.approx_kl, pl.policy_kl, pl.clipfrac,
            pl.ratio_mean, pl.ratio_var, None if vl is None else vl.clipfrac, None if vl is None else vl.value_error,
            None if kl is None else kl.detach(),
            None if cfg.importance_sampling_level == "token" else pl.seq_clipfrac,
        )  # fmt: skip

    def metrics(self) -> dict[str, Tensor]:
        return {key: value for key, value in zip(MICRO_KEYS, self, strict=True) if value is not None}


# the metric key of each field of MicroStats, in its order
MICRO_KEYS = (
    "policy/loss",
    "value/loss",
    "loss/total",
    "policy/entropy",
    POLICY_APPROXKL,
    "policy/policykl",
    POLICY_CLIPFRAC,
    "policy/ratio_mean",
    "policy/ratio_var",
    "value/clipfrac",
    "value/error",
    "policy/kl_loss",
    "policy/seq_clipfrac",
)


# the MLflow key of a category's share of groups without spread: `group/zero_std_fraction/<category>` (a category's
# ':' becomes '.', which metric names take everywhere)
ZERO_STD_BY_CATEGORY = "group/zero_std_fraction/"


@torch.no_grad()
def zero_std_counts(scores: Tensor, group_size: int, categories: list[list[str]]) -> dict[str, tuple[int, int]]:
    """Per category (an instruction type, a task): the groups of its prompts whose `scores` are all equal (no
    learning signal), and its groups. `categories` has one list per row (the rows of a group share their prompt's);
    a group counts once for each of its prompt's categories. Shape: scores (b,) in groups of `group_size` rows."""
    flat = scores.reshape(-1, group_size)
    equal = (flat.amax(dim=1) == flat.amin(dim=1)).tolist()
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for group, all_equal in enumerate(equal):
        for category in dict.fromkeys(categories[group * group_size]):
            counts[category][0] += int(all_equal)
            counts[category][1] += 1
    return {category: (zero, total) for category, (zero, total) in counts.items()}


def zero_std_by_category(counts: list[dict[str, tuple[int, int]]]) -> dict[str, float]:
    """`group/zero_std_fraction/<category>` over the counts of every process (`zero_std_counts`), by category."""
    merged: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for part in counts:
        for category, (zero, total) in part.items():
            merged[category][0] += zero
            merged[category][1] += total
    return {
        ZERO_STD_BY_CATEGORY + category.replace(":", "."): zero / total
        for category, (zero, total) in sorted(merged.items())
    }
