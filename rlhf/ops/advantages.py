"""Generalised advantage estimation (Schulman et al. 2016) over right-padded responses."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GAEOutput(NamedTuple):
    advantages: Tensor  # (b, t), 0 at padding; not whitened
    returns: Tensor  # (b, t) advantages + values, 0 at padding


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
