"""Log-probabilities and entropies from logits, without materialising a full log-softmax copy."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
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


# logits per chunk of `linear_logprobs`: a few MiB, so that each chunk's softmax passes stay in cache
_CHUNK_BYTES = 64 << 20


def _chunk_rows(n: int, vocab: int, chunk_tokens: int | None) -> int:
    return max(1, min(n, chunk_tokens or _CHUNK_BYTES // (4 * vocab)))


def _chunk_forward(logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool):
    """Log-probs of `labels`, logsumexp and (optionally) entropy of softmax(logits / temperature); `logits` is a
    fresh (n, v) buffer and is overwritten. Shape: (n, v), (n,) -> (n,), (n,), (n,) or None."""
    if temperature != 1.0:
        logits.div_(temperature)
    top = logits.amax(-1)
    picked = logits.gather(-1, labels[:, None]).squeeze(-1)
    shifted = logits.sub_(top[:, None])  # z - max
    entropy = None
    if with_entropy:
        e = shifted.exp()
        s = e.sum(-1)
        weighted = torch.bmm(e[:, None, :], shifted[:, :, None]).view(-1)  # sum e * (z - max)
        log_s = s.log()
        entropy = log_s - weighted / s
    else:
        log_s = shifted.exp_().sum(-1).log_()
    lse = top + log_s
    return picked - lse, lse, entropy


class _LinearLogprobs(torch.autograd.Function):
    """`linear_logprobs` with a backward that recomputes each chunk's logits instead of keeping (n, v) of them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy, rows):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n)
        lse = hidden.new_empty(n)
        entropy = hidden.new_empty(n if with_entropy else 0)
        for i in range(0, n, rows):
            sl = slice(i, min(i + rows, n))
            lp, ls, ent = _chunk_forward(F.linear(hidden[sl], weight, bias), labels[sl], temperature, with_entropy)
            logprobs[sl], lse[sl] = lp, ls
            if with_entropy:
                entropy[sl] = ent
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, _g_lse):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        temperature, rows, n = ctx.temperature, ctx.rows, hidden.shape[0]
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        if g_entropy is not None and entropy.numel() == 0:
            g_entropy = None
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b and bias is not None else None
        if g_logprobs is None and g_entropy is None:
            return grad_h.zero_() if want_h else None, grad_w, grad_b, None, None, None, None
        for i in range(0, n, rows):
            sl = slice(i, min(i + rows, n))
            h = hidden[sl]
            z = F.linear(h, weight, bias)
            if temperature != 1.0:
                z.div_(temperature)
            coef = None  # d loss / d z = p * coef (+ the label term)
            if g_entropy is not None:  # dH/dz = -p (z - E_p[z]), E_p[z] = lse - H
                coef = (z - (lse[sl] - entropy[sl])[:, None]).mul_(-g_entropy[sl, None])
            p = z.sub_(lse[sl, None]).exp_()
            if g_logprobs is not None:  # d logp_y / dz = onehot(y) - p
                coef = -g_logprobs[sl, None] if coef is None else coef.sub_(g_logprobs[sl, None])
            grad = p.mul_(coef)
            if g_logprobs is not None:
                grad.scatter_add_(-1, labels[sl, None], g_logprobs[sl, None])
            if temperature != 1.0:
                grad.div_(temperature)
            if want_h:
                torch.mm(grad, weight, out=grad_h[sl])
            if want_w:
                grad_w.addmm_(grad.t(), h)
            if grad_b is not None:
                grad_b += grad.sum(0)
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``labels`` (and the entropy) under ``softmax(linear(hidden, weight, bias) / temperature)``,
    the LM head fused with the log-softmax: the logits are computed ``chunk_tokens`` rows at a time (a few MiB of
    them by default) and never held for all rows at once, in the forward pass nor in the backward pass (which
    recomputes each chunk's logits). Equal to ``logprobs_from_logits`` / ``entropy_from_logits`` of the full
    logits within float32 rounding; float32 only.

    Shape: hidden (n, h), weight (v, h), bias (v,) or None, labels (n,); output (n,), (n,) or None.
    """
    _check_temperature(temperature)
    rows = _chunk_rows(hidden.shape[0], weight.shape[0], chunk_tokens)
    logprobs, entropy, _ = _LinearLogprobs.apply(
        hidden.contiguous(), weight, bias, labels.contiguous(), float(temperature), with_entropy, rows
    )
    return logprobs, entropy if with_entropy else None
