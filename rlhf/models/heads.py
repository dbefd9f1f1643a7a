"""Heads on backbone hidden states: the LM head (log-probs of responses) and scalar heads (values, rewards)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlhf.errors import ConfigError
from rlhf.models.compiled import training_backbone


def hidden_width(model: PreTrainedModel) -> int:
    """Width of the backbone's last hidden state, what the LM head reads (OPT-350m projects its hidden_size down to
    word_embed_proj_dim)."""
    head = model.get_output_embeddings()
    return head.in_features if isinstance(head, nn.Linear) else model.config.hidden_size


def lm_logits(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """The LM head on backbone hidden states, as the model's own forward computes its logits (Gemma-2's final
    soft-cap: cap * tanh(logits / cap)). Shape: (b, t, h) -> (b, t, v)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding. Shape: (b, t) -> (b, t)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_real_index(attention_mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of a mask (works for left and right padding). Shape: (b, t) -> (b,)."""
    t = attention_mask.shape[1]
    positions = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    return (positions * attention_mask.long()).argmax(dim=1)


def _score_head(model: PreTrainedModel) -> nn.Module:
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ConfigError(f"{type(model).__name__} has no scalar head named 'score' or 'classifier'")


def token_scores(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The scalar head at every position (value estimates; a reward model reads the last real one).

    Shape: (b, t) -> (b, t).
    """
    return _score_head(model)(backbone_hidden(model, input_ids, attention_mask)).squeeze(-1).float()


def backbone_hidden(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The backbone's last hidden states (no LM or score head), with positions that skip left padding.

    Shape: (b, t) -> (b, t, h).
    """
    backbone = training_backbone(model)  # compiled for training forwards where runtime.compile_training is on
    return backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state


def sequence_scores(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Reward-model score at the last real (non-pad) token of each row. Shape: (b, t) -> (b,)."""
    per_token = token_scores(model, input_ids, attention_mask)
    last = last_real_index(attention_mask)
    return per_token.gather(1, last.unsqueeze(1)).squeeze(1)


class PolicyValueHead(nn.Module):
    """Value model option 'policy_head': a scalar head on the policy's own trunk (shared, not copied).

    `token_scores` reads it like a reward model: trunk hidden states (b, t, h) -> scores (b, t).
    """

    base_model_prefix = "trunk"

    def __init__(self, policy: PreTrainedModel) -> None:
        super().__init__()
        self.trunk = getattr(policy, policy.base_model_prefix)
        width = hidden_width(policy)  # the trunk's output width (not hidden_size for OPT-350m)
        self.score = nn.Linear(width, 1, bias=False)
        nn.init.normal_(self.score.weight, std=1.0 / (width + 1) ** 0.5)
        self.score.to(next(policy.parameters()).device)
