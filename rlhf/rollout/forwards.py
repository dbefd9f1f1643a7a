"""The policy's and the value model's forwards over prompt + response token ids: the response tokens' log-probs (and
entropy) at the sampling temperature, and the values of the states before them. Rollout scoring
(``rlhf.rollout.scoring``) calls them under no grad, PPO's optimisation (``rlhf.ppo.optimise``) with it."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlhf.models.heads import backbone_hidden, lm_logits, token_scores
from rlhf.ops import entropy_from_logits, linear_logprobs, logprobs_from_logits


class PolicyOutput(NamedTuple):
    """`policy_forward`'s log-probs of the response tokens and, when asked, the policy's entropy there."""

    logprobs: Tensor  # (b, r)
    entropy: Tensor | None  # (b, r)


def _fused_head_dtype(model: PreTrainedModel, head: nn.Module | None, hidden: Tensor) -> torch.dtype | None:
    """The compute dtype in which `linear_logprobs` computes what `lm_logits` + `logprobs_from_logits` would, or None
    where it does not: a plain linear LM head (no soft-cap, no adapter wrapper), float32 outside autocast; bfloat16
    under CPU bfloat16 autocast or for a bfloat16 model on a CPU."""
    if type(head) is not nn.Linear or getattr(model.config, "final_logit_softcapping", None):
        return None
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        cpu_bf16 = device == "cpu" and torch.get_autocast_dtype("cpu") == torch.bfloat16
        return torch.bfloat16 if cpu_bf16 else None
    if hidden.dtype == torch.float32 and head.weight.dtype == torch.float32:
        return torch.float32
    if device == "cpu" and hidden.dtype == torch.bfloat16 and head.weight.dtype == torch.bfloat16:
        return torch.bfloat16
    return None


def policy_forward(
    model: PreTrainedModel,
    query_responses: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> PolicyOutput:
    """Log-probs of the response tokens under `model` at the sampling temperature.

    Only the hidden states that predict response tokens go through the LM head (no vocabulary projection of
    the prompt), with the model's own logit post-processing (Gemma-2's soft-cap), so these are the log-probs of
    the distribution `sample_responses` drew from. Shape: query_responses (b, p + r) -> (b, r).
    """
    hidden = backbone_hidden(model, query_responses, attention_mask)[:, prompt_len - 1 : -1]  # position t predicts t+1
    labels = query_responses[:, prompt_len:]
    head = model.get_output_embeddings()
    fused_dtype = _fused_head_dtype(model, head, hidden)
    if fused_dtype is not None:  # the LM head and log-softmax a chunk of positions at a time
        b, r = labels.shape
        logprobs, entropy = linear_logprobs(
            hidden.reshape(b * r, -1), head.weight, head.bias, labels.reshape(-1), temperature, with_entropy,
            compute_dtype=fused_dtype,
        )  # fmt: skip
        logprobs = logprobs.view(b, r)
        if entropy is not None:
            entropy = entropy.view(b, r) if entropy_grad else entropy.detach().view(b, r)
        return PolicyOutput(logprobs, entropy)
    logits = lm_logits(model, hidden)  # (b, r, v)
    logprobs = logprobs_from_logits(logits, labels, temperature)
    entropy = None
    if with_entropy:  # a statistic unless it is in the loss: then no backward through a softmax over the vocabulary
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature)
    return PolicyOutput(logprobs, entropy)


def value_forward(model: PreTrainedModel, query_responses: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """Value estimates of the states that precede each response token. Shape: (b, p + r) -> (b, r)."""
    return token_scores(model, query_responses, attention_mask)[:, prompt_len - 1 : -1]
