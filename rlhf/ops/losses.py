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
    ratio_var: Tensor  # () biased variance of the token ratios
    seq_clipfrac: Tensor  # () mean over responses of the share of their tokens that clip


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


IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = ("token", "sequence", "sequence_sum")
# the largest sequence log-ratio exponentiated: a sequence_sum ratio sums up to max_new_tokens token log-ratios, and
# exp(89) overflows float32; a ratio of e^20 is far past any clip range, so this changes no clipped term
SEQUENCE_LOG_RATIO_MAX = 20.0


def importance_log_ratios(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """The log importance ratio each real token's loss term uses, from the token log-ratios ``d``.

    - ``token``: ``d_t`` itself (PPO, Schulman et al. 2017);
    - ``sequence``: every token of a response gets the mean of its ``d`` over its real tokens, the log of the
      geometric mean of its token ratios (GSPO, Zheng et al. 2025: ``s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|)``);
    - ``sequence_sum``: every token gets the sum of its response's ``d``, the log of the whole response's likelihood
      ratio ``pi(y_i|x) / pi_old(y_i|x)`` (RLOO as Ahmadian et al. 2024 and TRL 0.19's ``RLOOTrainer`` compute it),
      capped at ``SEQUENCE_LOG_RATIO_MAX``.

    The gradient flows through every token of the response: ``d s_i = s_i * mean_t(d log pi(y_t))`` for
    ``sequence``, as GSPO's eq. 10. Padded positions are 0 in the output.

    Shape: log_ratio and mask (b, t); output (b, t).
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        per_seq = masked_mean(log_ratio, mask, dim=-1)
    elif level == "sequence_sum":
        per_seq = masked_sum(log_ratio, mask, dim=-1).clamp(max=SEQUENCE_LOG_RATIO_MAX)
    else:
        raise ValueError(
            f"Unknown importance sampling level {level!r}; allowed values are {', '.join(IMPORTANCE_SAMPLING_LEVELS)}."
        )
    return _zero_padding(per_seq[:, None].expand_as(log_ratio), mask.bool())


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cliprange: float,
    *,
    cliprange_high: float | None = None,
    importance_sampling_level: str = "token",
    loss_aggregation: str = "token_mean",
    norm_length: int | None = None,
) -> PolicyLossOutput:
    """PPO's clipped surrogate ``max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))`` per real token.

    ``d = logprobs - old_logprobs``. ``eps_low = cliprange`` and ``eps_high = cliprange_high`` (None: the same as
    ``cliprange``); DAPO's clip-higher (Yu et al. 2025) sets eps_high above eps_low. The ratio is
    ``exp(importance_log_ratios(d, mask, importance_sampling_level))``: each token's own (``token``), or one per
    response that every token of it shares (``sequence``: GSPO; ``sequence_sum``: RLOO), clipped per response.

    At the token level the per-token terms are reduced by ``aggregate_loss`` with ``loss_aggregation`` (and
    ``norm_length``). At a sequence level the loss is the mean over responses of their clipped terms (the papers'
    ``1/G sum_i``): ``seq_mean_token_mean``, whatever ``loss_aggregation`` says. This follows GSPO's paper and
    veRL's recommended ``seq-mean-token-mean``; TRL's ``importance_sampling_level="sequence"`` aggregates with its
    ``loss_type`` and so weighs long responses more under its token-level default. Where the advantages vary along
    a response (REINFORCE++), each token's term takes its own advantage times the shared ratio, as veRL's GSPO does.

    The statistics are detached: ``clipfrac`` the share of real tokens where the clipped term is the larger one,
    ``seq_clipfrac`` the mean over responses of that share in each (at a sequence level: the share of clipped
    responses), ``approx_kl``, ``policy_kl``, ``ratio_mean`` and ``ratio_var`` those of the token ratios.

    Shape: logprobs, old_logprobs, advantages and mask (b, t); outputs ().
    """
    real = mask.bool()
    d = _zero_padding(logprobs - old_logprobs, real)
    advantages = _zero_padding(advantages.to(d.dtype), real)
    ratio = torch.exp(importance_log_ratios(d, mask, importance_sampling_level))
    high = cliprange if cliprange_high is None else cliprange_high
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    aggregation = loss_aggregation if importance_sampling_level == "token" else "seq_mean_token_mean"
    loss = aggregate_loss(torch.maximum(pg1, pg2), mask, aggregation, norm_length)

    with torch.no_grad():
        clipped = (pg2 > pg1).to(d.dtype)
        clipfrac = masked_mean(clipped, mask)
        seq_clipfrac = aggregate_loss(clipped, mask, "seq_mean_token_mean")
        token_ratio = torch.exp(d)
        approx_kl = 0.5 * masked_mean(d**2, mask)
        policy_kl = masked_mean(-d, mask)
        ratio_mean = masked_mean(token_ratio, mask)
        ratio_var = masked_var(token_ratio, mask, unbiased=False)
    return PolicyLossOutput(
        loss=loss,
        clipfrac=clipfrac,
        approx_kl=approx_kl,
        policy_kl=policy_kl,
        ratio_mean=ratio_mean,
        ratio_var=ratio_var,
        seq_clipfrac=seq_clipfrac,
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
