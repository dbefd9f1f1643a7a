"""Log-probabilities and entropies from logits, without materialising a full log-softmax copy."""

from __future__ import annotations

import threading
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


# logits per chunk of `linear_logprobs`: a few MiB, reused for every chunk of a call. Fresh multi-MiB buffers cost
# page faults on every allocation (glibc maps allocations over 32 MiB anew each time): on a CPU, a 64 MiB chunk
# allocated per chunk made the LM head twice as slow as the same matmul into a reused buffer.
_CHUNK_BYTES = 16 << 20


def _chunk_rows(n: int, vocab: int, chunk_tokens: int | None) -> int:
    return max(1, min(n, chunk_tokens or _CHUNK_BYTES // (4 * vocab)))


def _logits_into(out: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear(hidden, weight, bias)`` written into `out`. Shape: (n, h), (v, h), (v,) -> out (n, v)."""
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


# With a backward to come, `linear_logprobs` on a CPU keeps each row's exp(z - max) in a reusable per-thread buffer
# when it holds at most this many bytes, so that the backward needs no second LM-head matmul: the cpu-long bench's
# (1024 x 32000) minibatch keeps 131 MB. The buffer is kept for the next call (a fresh one costs page faults).
_KEEP_BYTES = 256 << 20
_workspaces = threading.local()


def _kept_exps(device: torch.device, n: int, v: int) -> tuple[Tensor, object]:
    """This thread's (n, v) float32 buffer of kept exps and a fresh owner token (a later call takes the buffer over:
    the earlier call's backward then sees another owner and recomputes)."""
    buffer = getattr(_workspaces, "buffer", None)
    if buffer is None or buffer.numel() < n * v or buffer.device != device:
        buffer = _workspaces.buffer = torch.empty(n * v, device=device)
    _workspaces.owner = token = object()
    return buffer[: n * v].view(n, v), token


def _owns_kept_exps(token: object) -> bool:
    return getattr(_workspaces, "owner", None) is token


def _chunk_forward(logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, exps: Tensor | None):
    """Log-probs of `labels`, logsumexp, sum of exp(z - max) and (optionally) the entropy of softmax(logits /
    temperature); `logits` is overwritten. `exps` (the logits' shape, or None): where exp(z - max) is written when
    the entropy needs it beside z - max, or when it is kept for the backward. Shape: (n, v), (n,) -> four (n,)."""
    if temperature != 1.0:
        logits.div_(temperature)
    top = logits.amax(-1)
    picked = logits.gather(-1, labels[:, None]).squeeze(-1)
    shifted = logits.sub_(top[:, None])  # z - max
    entropy = None
    if with_entropy:
        e = torch.exp(shifted, out=exps)
        s = e.sum(-1)
        weighted = torch.bmm(e[:, None, :], shifted[:, :, None]).view(-1)  # sum e * (z - max)
        entropy = s.log() - weighted / s
    elif exps is not None:
        s = torch.exp(shifted, out=exps).sum(-1)
    else:
        s = shifted.exp_().sum(-1)
    lse = top + s.log()
    return picked - lse, lse, s, entropy


class _LinearLogprobs(torch.autograd.Function):
    """`linear_logprobs` with a backward that recomputes each chunk's logits instead of keeping (n, v) of them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy, rows, keep):
        n, v = hidden.shape[0], weight.shape[0]
        logprobs, lse, sums = hidden.new_empty(n), hidden.new_empty(n), hidden.new_empty(n)
        entropy = hidden.new_empty(n if with_entropy else 0)
        kept, ctx.token = _kept_exps(hidden.device, n, v) if keep else (None, None)
        chunk = hidden.new_empty(rows, v) if with_entropy or not keep else None
        scratch = hidden.new_empty(rows, v) if with_entropy and not keep else None
        for i in range(0, n, rows):
            sl, m = slice(i, min(i + rows, n)), min(rows, n - i)
            z = _logits_into(chunk[:m] if chunk is not None else kept[sl], hidden[sl], weight, bias)
            exps = kept[sl] if keep else scratch[:m] if with_entropy else None
            logprobs[sl], lse[sl], sums[sl], ent = _chunk_forward(z, labels[sl], temperature, with_entropy, exps)
            if with_entropy:
                entropy[sl] = ent
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy, sums)
        ctx.temperature, ctx.rows, ctx.kept = temperature, rows, kept
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, _g_lse):
        hidden, weight, bias, labels, lse, entropy, sums = ctx.saved_tensors
        temperature, rows, n, v = ctx.temperature, ctx.rows, hidden.shape[0], weight.shape[0]
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        if g_entropy is not None and entropy.numel() == 0:
            g_entropy = None
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros_like(bias) if want_b and bias is not None else None
        nones = (None,) * 5
        if g_logprobs is None and g_entropy is None:
            return grad_h.zero_() if want_h else None, grad_w, grad_b, *nones
        if ctx.kept is not None and g_entropy is None and _owns_kept_exps(ctx.token):
            _workspaces.owner = None  # consumed: a second backward (retain_graph) recomputes
            for i in range(0, n, rows):
                sl = slice(i, min(i + rows, n))
                # d logp_y / dz = onehot(y) - p, p = exp(z - max) / sum
                grad = ctx.kept[sl].mul_((g_logprobs[sl] / sums[sl]).neg_()[:, None])
                grad.scatter_add_(-1, labels[sl, None], g_logprobs[sl, None])
                _head_grads(grad, hidden[sl], weight, temperature, grad_h, grad_w, grad_b, sl)
            ctx.kept = None
            return grad_h, grad_w, grad_b, *nones
        ctx.kept = None
        chunk = hidden.new_empty(rows, v)
        scratch = hidden.new_empty(rows, v) if g_entropy is not None else None
        for i in range(0, n, rows):
            sl, m = slice(i, min(i + rows, n)), min(rows, n - i)
            h = hidden[sl]
            z = _logits_into(chunk[:m], h, weight, bias)
            if temperature != 1.0:
                z.div_(temperature)
            coef = None  # d loss / d z = p * coef (+ the label term)
            if g_entropy is not None:  # dH/dz = -p (z - E_p[z]), E_p[z] = lse - H
                coef = torch.sub(z, (lse[sl] - entropy[sl])[:, None], out=scratch[:m]).mul_(-g_entropy[sl, None])
            p = z.sub_(lse[sl, None]).exp_()
            if g_logprobs is not None:  # d logp_y / dz = onehot(y) - p
                coef = -g_logprobs[sl, None] if coef is None else coef.sub_(g_logprobs[sl, None])
            grad = p.mul_(coef)
            if g_logprobs is not None:
                grad.scatter_add_(-1, labels[sl, None], g_logprobs[sl, None])
            _head_grads(grad, h, weight, temperature, grad_h, grad_w, grad_b, sl)
        return grad_h, grad_w, grad_b, *nones


def _head_grads(grad, h, weight, temperature, grad_h, grad_w, grad_b, sl) -> None:
    """Accumulate the LM head's input, weight and bias gradients of one chunk from d loss / d (z / temperature)."""
    if temperature != 1.0:
        grad.div_(temperature)
    if grad_h is not None:
        torch.mm(grad, weight, out=grad_h[sl])
    if grad_w is not None:
        grad_w.addmm_(grad.t(), h)
    if grad_b is not None:
        grad_b += grad.sum(0)


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
    them by default) and never held for all rows at once. The backward recomputes each chunk's logits, except on a
    CPU where the (n, v) exps fit in 256 MiB: there the forward keeps them in a reused per-thread buffer and the
    backward (of the log-probs; with the entropy in the loss it recomputes) costs two matmuls instead of three.
    Equal to ``logprobs_from_logits`` / ``entropy_from_logits`` of the full logits within float32 rounding; float32
    only.

    Shape: hidden (n, h), weight (v, h), bias (v,) or None, labels (n,); output (n,), (n,) or None.
    """
    _check_temperature(temperature)
    n, v = hidden.shape[0], weight.shape[0]
    rows = _chunk_rows(n, v, chunk_tokens)
    keep = (
        hidden.device.type == "cpu"
        and torch.is_grad_enabled()
        and (hidden.requires_grad or weight.requires_grad)
        and 4 * n * v <= _KEEP_BYTES
    )
    logprobs, entropy, _ = _LinearLogprobs.apply(
        hidden.contiguous(), weight, bias, labels.contiguous(), float(temperature), with_entropy, rows, keep
    )
    return logprobs, entropy if with_entropy else None
