"""Advantage estimators over right-padded responses: GAE with a critic, and the critic-free ones.

``gae`` (Schulman et al. 2016) needs a value model. The critic-free estimators use a group of ``G`` samples per
prompt instead: GRPO (Shao et al. 2024), Dr. GRPO (Liu et al. 2025), RLOO (Ahmadian et al. 2024) and REINFORCE++
(Hu 2025), with or without the group-mean baseline.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# the advantages `group_advantages` computes (the estimators of the config that use them: rlhf.config.estimators)
GROUP_ADVANTAGES: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
# what a group-centred score is divided by (TRL's GRPOConfig.scale_rewards): its group's std, the batch's, or nothing
REWARD_SCALES: tuple[str, ...] = ("group", "batch", "none")


class GAEOutput(NamedTuple):
    advantages: Tensor  # (b, t), 0 at padding; not whitened
    returns: Tensor  # (b, t) advantages + values, 0 at padding


class GroupAdvantages(NamedTuple):
    advantages: Tensor  # (b,) one per sequence
    group_mean: Tensor  # (n_groups,) mean score of each group
    group_std: Tensor  # (n_groups,) unbiased std of each group's scores; 0 for groups of one
    zero_std_fraction: Tensor  # () share of groups whose scores are all equal (no learning signal)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> GAEOutput:
    """Advantages and returns by GAE, backwards over the response.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where ``V_{t+1}``
    and ``A_{t+1}`` are 0 beyond the last real token; ``returns = A + V``. Rows are right-padded
    (``1...1 0...0``); padded rewards and values, whatever they hold, change nothing, and both outputs are 0
    there. The advantages are not whitened: the caller applies ``masked_whiten``.

    Shape: rewards, values and mask (b, t); outputs (b, t).
    """
    m = mask.to(values.dtype)
    real = m != 0
    zeros = torch.zeros_like(values)
    rewards = torch.where(real, rewards.to(values.dtype), zeros)
    values = torch.where(real, values, zeros)

    num_steps = values.shape[1]
    next_advantage = torch.zeros_like(values[:, 0])  # (b,)
    advantages_reversed = []
    for t in reversed(range(num_steps)):
        next_value = values[:, t + 1] * m[:, t + 1] if t + 1 < num_steps else torch.zeros_like(next_advantage)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # multiplying by m[:, t] keeps A_t = 0 at padding, so it is 0 as A_{t+1} of the last real token
        next_advantage = (delta + gamma * lam * next_advantage) * m[:, t]
        advantages_reversed.append(next_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)  # t x (b,) -> (b, t)
    returns = torch.where(real, advantages + values, zeros)
    return GAEOutput(advantages=advantages, returns=returns)


def group_advantages(
    scores: Tensor,
    group_size: int,
    estimator: str,
    eps: float = 1e-6,
    scale: str | None = None,
    batch_std: Tensor | None = None,
) -> GroupAdvantages:
    """Sequence advantages of the critic-free estimators from the scores of groups of samples of one prompt.

    Rows ``[g * G, (g + 1) * G)`` of ``scores`` are the ``G = group_size`` samples of prompt ``g`` (contiguous
    groups). With ``mean`` and ``std`` (unbiased, as ``torch.std``) those of the sample's group:

    - ``grpo``: ``(s - mean) / (std + eps)`` (GRPO, Shao et al. 2024; TRL);
    - ``dr_grpo``: ``s - mean``, no division by the std (Dr. GRPO, Liu et al. 2025);
    - ``grpo`` and ``dr_grpo`` with ``scale`` (TRL's ``scale_rewards``): ``s - mean`` divided by ``std + eps`` of the
      group (``group``, grpo's own), of the whole batch (``batch``: ``batch_std``, default the unbiased std of
      ``scores``; pass the global batch's with several processes) or by nothing (``none``, dr_grpo's own);
    - ``rloo``: ``s_i`` minus the mean of the other ``G - 1`` scores, ``G / (G - 1) * (s - mean)`` (Ahmadian et al.
      2024); needs ``G >= 2``;
    - ``reinforce_pp_baseline``: ``s - mean``; it goes on into the token rewards, ``reinforce_returns`` and the
      whitening over the batch;
    - ``reinforce_pp``: ``s`` unchanged (no baseline); the same path as above.

    In a group whose scores are all equal every advantage is exactly 0 (no ulp residue, no NaN), and its std is 0.
    ``gae`` needs a critic: call ``gae``.

    Shape: scores (b,) with b = n_groups * group_size; advantages (b,), group_mean and group_std (n_groups,),
    zero_std_fraction ().
    """
    if estimator not in GROUP_ADVANTAGES:
        hint = " gae needs a critic: call gae()." if estimator == "gae" else ""
        allowed = ", ".join(GROUP_ADVANTAGES)
        raise ValueError(f"Unknown critic-free advantage estimator {estimator!r}; allowed values are {allowed}.{hint}")
    scale = scale or {"grpo": "group", "dr_grpo": "none"}.get(estimator)
    if scale is not None and (scale not in REWARD_SCALES or estimator not in ("grpo", "dr_grpo")):
        raise ValueError(
            f"scale {scale!r} applies to grpo and dr_grpo, one of {', '.join(REWARD_SCALES)}; got {estimator!r}."
        )
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape (b,), got {tuple(scores.shape)}.")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}.")
    if scores.shape[0] % group_size != 0:
        raise ValueError(
            f"The batch of {scores.shape[0]} scores is not a whole number of groups of {group_size} samples; "
            "each prompt needs exactly group_size contiguous samples."
        )
    if estimator == "rloo" and group_size < 2:
        raise ValueError(f"rloo leaves one sample out of its group and needs group_size >= 2, got {group_size}.")

    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    grouped = scores.reshape(-1, group_size)  # (n_groups, G)
    group_mean = grouped.mean(dim=1)
    all_equal = grouped.amax(dim=1) == grouped.amin(dim=1)  # exact, where the mean may be an ulp off the scores
    centred = torch.where(all_equal[:, None], torch.zeros_like(grouped), grouped - group_mean[:, None])
    # unbiased std as torch.std, but 0 for groups of one (undefined there) and for equal scores; the sqrt only
    # sees positive variances, so no NaN reaches the gradient either
    var = (centred**2).sum(dim=1) / max(group_size - 1, 1)
    spread = var > 0
    group_std = torch.where(spread, torch.sqrt(torch.where(spread, var, torch.ones_like(var))), torch.zeros_like(var))

    if scale in ("group", "batch"):
        if scale == "group":
            denom = group_std[:, None] + eps
        else:
            spread_all = scores.std() if batch_std is None else batch_std.to(scores.dtype)
            denom = torch.nan_to_num(spread_all, nan=0.0).expand(1, 1) + eps
        # a group without spread has centred == 0: divide by 1 there, so eps = 0 gives 0 rather than NaN
        advantages = centred / torch.where(denom > 0, denom, torch.ones_like(denom))
    elif estimator == "rloo":
        advantages = centred * (group_size / (group_size - 1))
    elif estimator == "reinforce_pp":
        advantages = grouped
    else:  # grpo and dr_grpo with scale 'none', reinforce_pp_baseline
        advantages = centred
    zero_std_fraction = all_equal.to(group_mean.dtype).mean()
    return GroupAdvantages(
        advantages=advantages.reshape(-1),
        group_mean=group_mean,
        group_std=group_std,
        zero_std_fraction=zero_std_fraction,
    )


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give every real token its sequence's advantage; padded positions are 0.

    Shape: advantages (b,), mask (b, t); output (b, t).
    """
    real = mask.bool()
    per_token = advantages[:, None].expand(real.shape)
    return torch.where(real, per_token, torch.zeros_like(per_token))


def reinforce_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return to go without a critic (REINFORCE++, Hu 2025): ``G_t = r_t + gamma * G_{t+1}``.

    ``G_{t+1}`` is 0 beyond the last real token. The per-token rewards already hold the KL penalty and the score
    at the last real token (``per_token_rewards``). Rows are right-padded (``1...1 0...0``); padded rewards,
    whatever they hold, change nothing, and the output is 0 there. The returns are not whitened: the caller
    whitens them over the global batch with ``masked_whiten`` and uses them as the advantages.

    Shape: rewards and mask (b, t); output (b, t).
    """
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    m = mask.to(rewards.dtype)
    rewards = torch.where(m != 0, rewards, torch.zeros_like(rewards))

    next_return = torch.zeros_like(rewards[:, 0])  # (b,)
    returns_reversed = []
    for t in reversed(range(rewards.shape[1])):
        # multiplying by m[:, t] keeps G_t = 0 at padding, so it is 0 as G_{t+1} of the last real token
        next_return = (rewards[:, t] + gamma * next_return) * m[:, t]
        returns_reversed.append(next_return)
    if not returns_reversed:
        return torch.zeros_like(rewards)
    return torch.stack(returns_reversed[::-1], dim=1)  # t x (b,) -> (b, t)
