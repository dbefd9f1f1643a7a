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


# float32 logits per chunk of `linear_logprobs` at most: the rows split into chunks of equal size under it. Large
# chunks keep the LM head's matmuls efficient (on a 2-core CPU, (85 x 576) @ (576 x 49152) ran at 73 GFLOP/s, 512
# rows at 100 or more); on a CPU the chunk buffers are per-thread and reused across calls, since fresh multi-MiB
# buffers cost page faults on every allocation (glibc maps allocations over 32 MiB anew each time: a 64 MiB chunk
# allocated per call made the LM head twice as slow as the same matmul into a reused buffer).
_CHUNK_BYTES = 128 << 20


def _chunk_rows(n: int, vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens:
        return max(1, min(n, chunk_tokens))
    chunks = -(-4 * n * vocab // _CHUNK_BYTES)  # ceil
    return max(1, -(-n // max(1, chunks)))


def _chunk_buffer(name: str, device: torch.device, rows: int, v: int) -> Tensor:
    """A (rows, v) float32 buffer for one call's chunks: this thread's reused one on a CPU, a fresh one elsewhere
    (the CUDA caching allocator reuses freed blocks itself, and a kept one would hold GPU memory between calls)."""
    if device.type == "cpu":
        return _workspace(name, device, rows, v)
    return torch.empty(rows, v, device=device, dtype=torch.float32)


def _logits_into(out: Tensor, hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear(hidden, weight, bias)`` written into the float32 `out`; a bfloat16 `hidden` and `weight` multiply
    in bfloat16 (float32 accumulation, logits rounded to bfloat16 as autocast's would be), then widen into `out`.
    Shape: (n, h), (v, h), (v,) -> out (n, v)."""
    if hidden.dtype != out.dtype:
        out.copy_(torch.mm(hidden, weight.t()))
        return out if bias is None else out.add_(bias)
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)


# With a backward to come, `linear_logprobs` on a CPU keeps each row's exp(z - max) in a reusable per-thread buffer
# when it holds at most this many bytes, so that the backward needs no second LM-head matmul: the cpu-long bench's
# (1024 x 32000) minibatch keeps 131 MB. The buffer is kept for the next call (a fresh one costs page faults).
_KEEP_BYTES = 256 << 20
_workspaces = threading.local()


def _workspace(name: str, device: torch.device, n: int, v: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """This thread's reusable (n, v) buffer `name`, grown when too small."""
    buffer = getattr(_workspaces, name, None)
    if buffer is None or buffer.numel() < n * v or buffer.device != device or buffer.dtype != dtype:
        buffer = torch.empty(n * v, device=device, dtype=dtype)
        setattr(_workspaces, name, buffer)
    return buffer[: n * v].view(n, v)


def _kept_exps(device: torch.device, n: int, v: int) -> tuple[Tensor, object]:
    """This thread's (n, v) float32 buffer of kept exps and a fresh owner token (a later call takes the buffer over:
    the earlier call's backward then sees another owner and recomputes)."""
    buffer = _workspace("buffer", device, n, v)
    _workspaces.owner = token = object()
    return buffer, token


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
        weighted = shifted.mul_(e).sum(-1)  # sum e * (z - max), in place: z - max is not needed after this
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
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy, rows, keep, compute_dtype):
        n, v = hidden.shape[0], weight.shape[0]
        f32 = {"device": hidden.device, "dtype": torch.float32}
        logprobs, lse, sums = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
        entropy = torch.empty(n if with_entropy else 0, **f32)
        kept, ctx.token = _kept_exps(hidden.device, n, v) if keep else (None, None)
        chunk = _chunk_buffer("chunk", hidden.device, rows, v) if with_entropy or not keep else None
        scratch = _chunk_buffer("scratch", hidden.device, rows, v) if with_entropy and not keep else None
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)  # no copies in float32
        for i in range(0, n, rows):
            sl, m = slice(i, min(i + rows, n)), min(rows, n - i)
            z = _logits_into(chunk[:m] if chunk is not None else kept[sl], h[sl], w, bias)
            exps = kept[sl] if keep else scratch[:m] if with_entropy else None
            logprobs[sl], lse[sl], sums[sl], ent = _chunk_forward(z, labels[sl], temperature, with_entropy, exps)
            if with_entropy:
                entropy[sl] = ent
        ctx.save_for_backward(h, w, bias, labels, lse, entropy, sums)
        ctx.temperature, ctx.rows, ctx.kept = temperature, rows, kept
        ctx.dtypes = hidden.dtype, weight.dtype
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
        f32 = {"device": hidden.device, "dtype": torch.float32}
        grad_h = torch.empty(hidden.shape, **f32) if want_h else None
        grad_b = torch.zeros_like(bias) if want_b and bias is not None else None
        # bfloat16 matmuls: each chunk's d loss / d z rounded into a (n, v) buffer, the weight gradient in one matmul
        low = _workspace("low", hidden.device, n, v, hidden.dtype) if hidden.dtype != torch.float32 else None
        heads = _HeadGrads(hidden, weight, temperature, grad_h, want_w, grad_b, low)
        if g_logprobs is None and g_entropy is None:
            return heads.result(ctx.dtypes, zero=True)
        if ctx.kept is not None and g_entropy is None and _owns_kept_exps(ctx.token):
            _workspaces.owner = None  # consumed: a second backward (retain_graph) recomputes
            # d logp_y / dz = onehot(y) - p, p = exp(z - max) / sum: in place over every row, then the head's
            # gradients in one matmul each (row chunks' matmuls run slower than one over every row)
            grad = ctx.kept.mul_((g_logprobs / sums).neg_()[:, None])
            grad.scatter_add_(-1, labels[:, None], g_logprobs[:, None])
            ctx.kept = None
            heads.add(grad, slice(0, n))
            return heads.result(ctx.dtypes)
        ctx.kept = None
        chunk = _chunk_buffer("chunk", hidden.device, rows, v)
        scratch = _chunk_buffer("scratch", hidden.device, rows, v) if g_entropy is not None else None
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
            heads.add(grad, sl)
        return heads.result(ctx.dtypes)


class _HeadGrads:
    """The LM head's input, weight and bias gradients, accumulated chunk by chunk from d loss / d (z / temperature):
    in float32 matmuls (the weight's: the first chunk's matmul into a fresh buffer, the next ones added to it), or
    with `low` (a (n, v) bfloat16 buffer) in bfloat16 ones, the weight's in one matmul over every row at the end
    (float32 accumulation inside it, as autocast's backward)."""

    def __init__(self, hidden, weight, temperature, grad_h, want_w, grad_b, low) -> None:
        self.hidden, self.weight, self.temperature, self.low = hidden, weight, temperature, low
        self.grad_h, self.want_w, self.grad_b = grad_h, want_w, grad_b
        self.grad_w: Tensor | None = None

    def add(self, grad: Tensor, sl: slice) -> None:
        if self.temperature != 1.0:
            grad.div_(self.temperature)
        if self.grad_b is not None:
            self.grad_b += grad.sum(0)
        if self.low is not None:
            grad = self.low[sl].copy_(grad)
        if self.grad_h is not None:
            if self.low is None:
                torch.mm(grad, self.weight, out=self.grad_h[sl])
            else:
                self.grad_h[sl] = torch.mm(grad, self.weight)
        if self.want_w and self.low is None:
            if self.grad_w is None:
                self.grad_w = torch.mm(grad.t(), self.hidden[sl])
            else:
                self.grad_w.addmm_(grad.t(), self.hidden[sl])

    def result(self, dtypes: tuple[torch.dtype, torch.dtype], zero: bool = False) -> tuple:
        grad_h, grad_w = self.grad_h, self.grad_w
        if zero:
            grad_h = grad_h.zero_() if grad_h is not None else None
            grad_w = torch.zeros(self.weight.shape, device=self.weight.device) if self.want_w else None
        elif self.want_w and self.low is not None:
            grad_w = torch.mm(self.low.t(), self.hidden).float()
        grad_h = grad_h.to(dtypes[0]) if grad_h is not None else None
        grad_w = grad_w.to(dtypes[1]) if grad_w is not None else None
        return grad_h, grad_w, self.grad_b, *(None,) * 6


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``labels`` (and the entropy) under ``softmax(linear(hidden, weight, bias) / temperature)``,
    the LM head fused with the log-softmax: the logits are computed ``chunk_tokens`` rows at a time (a few MiB of
    them by default) and never held for all rows at once. The backward recomputes each chunk's logits, except on a
    CPU where the (n, v) exps fit in 256 MiB: there the forward keeps them in a reused per-thread buffer and the
    backward (of the log-probs; with the entropy in the loss it recomputes) costs two matmuls instead of three.
    Equal to ``logprobs_from_logits`` / ``entropy_from_logits`` of the full logits within float32 rounding.

    `compute_dtype` bfloat16: the three matmuls in bfloat16 (float32 accumulation; the logits and their gradient
    rounded to bfloat16, as under autocast), the log-softmax, entropy and outputs in float32; the gradients come
    back in `hidden`'s and `weight`'s dtypes (float32 master weights stay float32).

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
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are this function's choice
        logprobs, entropy, _ = _LinearLogprobs.apply(
            hidden.contiguous(), weight, bias, labels.contiguous(), float(temperature), with_entropy, rows, keep,
            compute_dtype,
        )  # fmt: skip
    return logprobs, entropy if with_entropy else None
