"""Direct Preference Optimization (Rafailov et al. 2023): the loss on sequence log-probs and its implicit rewards.

The policy's implicit reward of a response is ``beta * (logp_policy - logp_ref)``; the loss compares the chosen and
rejected responses of a pair through ``h = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)``, the difference
of the policy's and the reference's log-ratios.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf.ops.logprobs import logprobs_from_logits
from rlhf.ops.stats import masked_mean, masked_sum

DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo")


class DPOLossOutput(NamedTuple):
    loss: Tensor  # () keeps grad
    chosen_rewards: Tensor  # (b,) detached beta * (pi_chosen - ref_chosen)
    rejected_rewards: Tensor  # (b,) detached beta * (pi_rejected - ref_rejected)
    reward_margin: Tensor  # () mean(chosen_rewards - rejected_rewards)
    reward_accuracy: Tensor  # () share of pairs with chosen_rewards > rejected_rewards


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> DPOLossOutput:
    """DPO loss of a batch of preference pairs, in one of ``DPO_LOSS_TYPES``, with ``h`` the log-ratio difference
    ``(policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)``:

    - ``sigmoid`` (DPO, Eq. 7 of Rafailov et al. 2023), with conservative-DPO label smoothing ``ls`` (the chance
      that a label is flipped; 0 gives plain DPO): ``mean(-(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta
      * h))``;
    - ``ipo`` (IPO, Eq. 17 of Azar et al. 2023, ``beta`` in the role of their tau): ``mean((h - 1 / (2 * beta))^2)``,
      which regresses ``h`` onto a finite target instead of pushing it to infinity. No label smoothing.

    The inputs are sequence log-probs: sums over the response tokens (TRL feeds IPO their means over the response
    tokens instead; the caller chooses). The reference log-probs are treated as constants (detached). The implicit
    rewards ``beta * (policy - ref)``, their mean margin and the share of pairs they rank right are detached
    statistics; the loss keeps its graph.

    Shape: the four log-probs (b,); outputs: loss, reward_margin, reward_accuracy (); the rewards (b,).
    """
    if beta <= 0:
        raise ValueError(f"DPO beta must be positive, got {beta}.")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"Unknown DPO loss type {loss_type!r}; allowed values are {', '.join(DPO_LOSS_TYPES)}.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"DPO label_smoothing must be in [0, 0.5), got {label_smoothing}.")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("DPO label_smoothing applies to the 'sigmoid' loss only, not to 'ipo'.")
    ref_chosen = ref_chosen_logps.detach().to(policy_chosen_logps.dtype)
    ref_rejected = ref_rejected_logps.detach().to(policy_rejected_logps.dtype)
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen - ref_rejected)  # (b,)
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h)
        if label_smoothing:
            losses = losses - label_smoothing * F.logsigmoid(-beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    with torch.no_grad():
        chosen_rewards = beta * (policy_chosen_logps - ref_chosen)
        rejected_rewards = beta * (policy_rejected_logps - ref_rejected)
        margin = (chosen_rewards - rejected_rewards).mean()
        accuracy = (chosen_rewards > rejected_rewards).to(h.dtype).mean()
    return DPOLossOutput(
        loss=losses.mean(),
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        reward_margin=margin,
        reward_accuracy=accuracy,
    )


def sequence_logps(logits: Tensor, labels: Tensor, mask: Tensor, average: bool = False) -> Tensor:
    """Log-prob of each row's labelled tokens: the sum (``average``: the mean) over real positions of
    ``logprobs_from_logits(logits, labels)``. Padded positions give neither value nor gradient; a row without real
    positions gives 0.

    Shifting is the caller's: ``logits[:, t]`` scores ``labels[:, t]`` (for a causal LM, logits of positions
    ``:-1`` and labels ``input_ids[:, 1:]``). Labels must be valid token ids everywhere (the pad id where padded).
    The logits of padded positions are set to 0 before the log-softmax, so whatever they hold (inf, NaN) reaches
    neither the value nor the gradient: the softmax's backward would multiply its NaN by a zero gradient.

    Shape: logits (b, t, v), labels and mask (b, t); output (b,).
    """
    logits = torch.where(mask.bool()[..., None], logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    token_logps = logprobs_from_logits(logits, labels)  # (b, t)
    return masked_mean(token_logps, mask, dim=-1) if average else masked_sum(token_logps, mask, dim=-1)
