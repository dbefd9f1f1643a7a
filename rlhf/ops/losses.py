"""PPO policy and value losses (clipped surrogate) and the pairwise reward-model loss."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.ops.stats import masked_mean, masked_var


class PolicyLossOutput(NamedTuple):
    loss: Tensor  # () keeps grad
    clipfrac: Tensor  # () fraction of real tokens where the clipped term is the larger one
    approx_kl: Tensor  # () 0.5 * mean(d^2)
    policy_kl: Tensor  # () mean(-d)
    ratio_mean: Tensor  # ()
    ratio_var: Tensor  # () biased variance


class ValueLossOutput(NamedTuple):
    loss: Tensor  # () keeps grad
    clipfrac: Tensor  # () fraction of real tokens where the clipped error is the larger one
    value_error: Tensor  # () mean((V - R)^2)


class PairwiseLossOutput(NamedTuple):
    loss: Tensor  # () keeps grad
    accuracy: Tensor  # () fraction of pairs with chosen > rejected
    margin: Tensor  # () mean(chosen - rejected)


def _zero_padding(x: Tensor, real: Tensor) -> Tensor:
    """Replace padded entries by 0 so that neither values nor gradients come from them (even inf or NaN)."""
    return torch.where(real, x, torch.zeros_like(x))


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cliprange: float
) -> PolicyLossOutput:
    """PPO clipped surrogate loss ``mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))``.

    ``d = logprobs - old_logprobs`` and ``ratio = exp(d)``. Means are over real tokens. The statistics are
    detached; the loss keeps its graph.

    Shape: logprobs, old_logprobs, advantages and mask (b, t); outputs ().
    """
    real = mask.bool()
    d = _zero_padding(logprobs - old_logprobs, real)
    advantages = _zero_padding(advantages.to(d.dtype), real)
    ratio = torch.exp(d)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(pg1, pg2), mask)

    with torch.no_grad():
        clipfrac = masked_mean((pg2 > pg1).to(d.dtype), mask)
        approx_kl = 0.5 * masked_mean(d**2, mask)
        policy_kl = masked_mean(-d, mask)
        ratio_mean = masked_mean(ratio, mask)
        ratio_var = masked_var(ratio, mask, unbiased=False)
    return PolicyLossOutput(
        loss=loss,
        clipfrac=clipfrac,
        approx_kl=approx_kl,
        policy_kl=policy_kl,
        ratio_mean=ratio_mean,
        ratio_var=ratio_var,
    )


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float | None
) -> ValueLossOutput:
    """Clipped value loss ``0.5 * mean(max((V - R)^2, (V_clipped - R)^2))``.

    ``V_clipped = clip(V, V_old - eps_v, V_old + eps_v)``. With ``cliprange_value=None`` there is no clipping:
    ``0.5 * mean((V - R)^2)`` and a clip fraction of 0. Means are over real tokens; the statistics are detached.

    Shape: values, old_values, returns and mask (b, t); outputs ().
    """
    real = mask.bool()
    values_real = _zero_padding(values, real)
    old_values = _zero_padding(old_values.to(values.dtype), real)
    returns = _zero_padding(returns.to(values.dtype), real)

    err_unclipped = (values_real - returns) ** 2
    if cliprange_value is None:
        loss = 0.5 * masked_mean(err_unclipped, mask)
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        # clamp V itself: V_old + clamp(V - V_old) rounds away from V in float32 and would count as clipped
        values_clipped = torch.clamp(values_real, old_values - cliprange_value, old_values + cliprange_value)
        err_clipped = (values_clipped - returns) ** 2
        loss = 0.5 * masked_mean(torch.maximum(err_unclipped, err_clipped), mask)
        with torch.no_grad():
            clipfrac = masked_mean((err_clipped > err_unclipped).to(values.dtype), mask)
    with torch.no_grad():
        value_error = masked_mean(err_unclipped, mask)
    return ValueLossOutput(loss=loss, clipfrac=clipfrac, value_error=value_error)


def pairwise_reward_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coef: float = 0.0
) -> PairwiseLossOutput:
    """Bradley-Terry loss of a reward model on preference pairs, with optional margin and centring term.

    ``loss = mean(-logsigmoid(chosen - rejected - margin)) + center_coef * mean((chosen + rejected)^2)``; the
    centring term keeps rewards near zero. Accuracy and mean margin are detached.

    Shape: chosen, rejected and margin (b,); outputs ().
    """
    diff = chosen - rejected
    logits = diff if margin is None else diff - margin.to(diff.dtype)
    loss = -F.logsigmoid(logits).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        accuracy = (chosen > rejected).to(diff.dtype).mean()
        mean_margin = diff.mean()
    return PairwiseLossOutput(loss=loss, accuracy=accuracy, margin=mean_margin)
