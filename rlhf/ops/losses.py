"""PPO policy and value losses (clipped surrogate), their aggregation modes, the KL loss and the pairwise loss."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.ops.kl import kl_per_token
from rlhf.ops.stats import masked_mean, masked_sum, masked_var

LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


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


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: str, norm_length: int | None = None) -> Tensor:
    """Reduce a per-token loss to a scalar, in one of ``LOSS_AGGREGATIONS``.

    - ``token_mean``: the mean over every real token of the batch (``masked_mean``; PPO), so long sequences weigh
      more;
    - ``seq_mean_token_mean``: each sequence's mean over its real tokens, then the mean over sequences (GRPO);
    - ``seq_mean_token_sum_norm``: each sequence's sum over its real tokens divided by the constant
      ``norm_length`` (Dr. GRPO: the generation's max_new_tokens), then the mean over sequences; needs
      ``norm_length``.

    In both sequence modes a sequence without real tokens contributes 0 and is not counted; a batch without real
    tokens gives 0. Padded positions, even inf or NaN, get neither value nor gradient.

    Shape: per_token and mask (b, t); output ().
    """
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, mask, dim=-1)  # (b,), 0 for empty rows
    elif mode == "seq_mean_token_sum_norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(
                f"Loss aggregation seq_mean_token_sum_norm needs a positive norm_length (e.g. max_new_tokens), "
                f"got {norm_length}."
            )
        per_seq = masked_sum(per_token, mask, dim=-1) / norm_length  # (b,)
    else:
        raise ValueError(f"Unknown loss aggregation {mode!r}; allowed values are {', '.join(LOSS_AGGREGATIONS)}.")
    has_tokens = mask.bool().any(dim=-1)  # (b,)
    return masked_mean(per_seq, has_tokens)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cliprange: float,
    *,
    loss_aggregation: str = "token_mean",
    norm_length: int | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate loss ``mean(max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps)))``.

    ``d = logprobs - old_logprobs`` and ``ratio = exp(d)``. The loss is reduced by ``aggregate_loss`` with
    ``loss_aggregation`` (and ``norm_length``); the default, ``token_mean``, is the mean over real tokens. The
    statistics are detached token means over real tokens whatever the aggregation; the loss keeps its graph.

    Shape: logprobs, old_logprobs, advantages and mask (b, t); outputs ().
    """
    real = mask.bool()
    d = _zero_padding(logprobs - old_logprobs, real)
    advantages = _zero_padding(advantages.to(d.dtype), real)
    ratio = torch.exp(d)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = aggregate_loss(torch.maximum(pg1, pg2), mask, loss_aggregation, norm_length)

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


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: str = "k3",
    loss_aggregation: str = "token_mean",
    norm_length: int | None = None,
) -> Tensor:
    """KL-to-reference loss term, for KL in the loss rather than in the rewards (GRPO).

    ``kl_per_token(logprobs, ref_logprobs, estimator)`` (k1 ``d``, k2 ``d^2 / 2``, k3 ``exp(-d) - 1 + d`` with
    ``d = logprobs - ref_logprobs``) reduced by ``aggregate_loss``. The gradient flows through ``logprobs`` only
    (``ref_logprobs`` is detached). Padded positions are set to ``d = 0`` before the estimator, so garbage there
    gives neither value nor gradient (no ``0 * inf`` through ``exp``).

    Shape: logprobs, ref_logprobs and mask (b, t); output ().
    """
    real = mask.bool()
    logprobs_real = _zero_padding(logprobs, real)
    ref_real = _zero_padding(ref_logprobs.detach().to(logprobs.dtype), real)
    per_token = kl_per_token(logprobs_real, ref_real, estimator)
    return aggregate_loss(per_token, mask, loss_aggregation, norm_length)


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
