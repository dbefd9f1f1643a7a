"""Log-probabilities and entropies from logits, without materialising a full log-softmax copy."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"Temperature must be positive, got {temperature}.")


def _rowwise(fn: Callable[..., Tensor], logits: Tensor, *args: Tensor) -> Tensor:
    """Apply ``fn`` in float32; row by row for half-precision logits so only one row is upcast at a time."""
    if torch.finfo(logits.dtype).bits >= 32:
        return fn(logits, *args)
    rows = [fn(logits[i : i + 1].float(), *(a[i : i + 1] for a in args)) for i in range(logits.shape[0])]
    return torch.cat(rows, dim=0)


def _logprobs(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    logits = logits / temperature
    gathered = logits.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)  # (b, t, 1) -> (b, t)
    return gathered - torch.logsumexp(logits, dim=-1)


def _entropy(logits: Tensor, temperature: float) -> Tensor:
    logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probs of ``labels`` under ``softmax(logits / temperature)``: gathered logit minus logsumexp.

    Use the sampling temperature so that the log-probs are those of the distribution sampled from. Labels must
    be valid token ids everywhere (use the pad id at padded positions, not -100). Half-precision logits are
    computed in float32, one row at a time; the output is float32 then.

    Shape: logits (b, t, v), labels (b, t); output (b, t).
    """
    _check_temperature(temperature)
    return _rowwise(lambda x, y: _logprobs(x, y, temperature), logits, labels)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position: ``logsumexp(z) - sum(softmax(z) * z)``.

    Half-precision logits are computed in float32, one row at a time.

    Shape: logits (b, t, v); output (b, t).
    """
    _check_temperature(temperature)
    return _rowwise(lambda x: _entropy(x, temperature), logits)
