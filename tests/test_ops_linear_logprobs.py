"""`linear_logprobs` (the LM head fused with the log-softmax, chunked) against the plain computation, forward and
backward, through both of its backward paths (kept exps and recomputed logits)."""

from __future__ import annotations

import pytest
import torch

from rlhf.ops import logprobs as ops
from rlhf.ops.logprobs import linear_logprobs


def _inputs(seed: int, n: int = 37, h: int = 8, v: int = 50, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    b = torch.randn(v, generator=gen, dtype=torch.float64) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    g_lp, g_ent = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    return hidden, weight, b, labels, g_lp, g_ent


def _leaves(*tensors):
    return [t.float().clone().requires_grad_() if t is not None else None for t in tensors]


def _reference(hidden, weight, bias, labels, temperature, entropy_in_loss, g_lp, g_ent):
    """float64 log_softmax of the full logits and the gradients of sum(g_lp * logp [+ g_ent * entropy])."""
    h, w, b = (t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias))
    logits = torch.nn.functional.linear(h, w, b) / temperature
    log_p = logits.log_softmax(-1)
    lp = log_p.gather(-1, labels[:, None])[:, 0]
    ent = -(log_p.exp() * log_p).sum(-1)
    loss = (g_lp * lp).sum() + ((g_ent * ent).sum() if entropy_in_loss else 0)
    loss.backward()
    return lp, ent, [t.grad for t in (h, w, b) if t is not None]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_in_loss", [False, True])
@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])  # recomputed logits in the backward, kept exps
@pytest.mark.parametrize("chunk_tokens", [None, 5])
def test_matches_the_full_log_softmax_and_its_gradients(
    monkeypatch, temperature, entropy_in_loss, keep_bytes, chunk_tokens
):
    monkeypatch.setattr(ops, "_KEEP_BYTES", keep_bytes)
    hidden, weight, bias, labels, g_lp, g_ent = _inputs(0)
    ref_lp, ref_ent, ref_grads = _reference(hidden, weight, bias, labels, temperature, entropy_in_loss, g_lp, g_ent)
    h, w, b = _leaves(hidden, weight, bias)
    lp, ent = linear_logprobs(h, w, b, labels, temperature, with_entropy=True, chunk_tokens=chunk_tokens)
    if not entropy_in_loss:
        ent = ent.detach()
    loss = (g_lp.float() * lp).sum() + ((g_ent.float() * ent).sum() if entropy_in_loss else 0)
    loss.backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    for ours, ref in zip((h.grad, w.grad, b.grad), ref_grads, strict=True):
        torch.testing.assert_close(ours.double(), ref, atol=1e-4, rtol=1e-4)


def test_interleaved_calls_and_a_second_backward_recompute(monkeypatch):
    """Two forwards before their backwards (the second takes the kept buffer over) and a retained graph's second
    backward (the buffer was consumed) fall back to recomputing, with the same gradients."""
    monkeypatch.setattr(ops, "_KEEP_BYTES", 1 << 30)
    hidden, weight, bias, labels, g_lp, _ = _inputs(1, bias=False)
    _, _, (ref_h, ref_w) = _reference(hidden, weight, None, labels, 1.0, False, g_lp, None)
    first, second = _leaves(hidden, weight), _leaves(hidden, weight)
    lp1, _ = linear_logprobs(first[0], first[1], None, labels)
    lp2, _ = linear_logprobs(second[0], second[1], None, labels)
    (g_lp.float() * lp1).sum().backward(retain_graph=True)  # not the owner any more: recomputes
    (g_lp.float() * lp2).sum().backward(retain_graph=True)  # the owner: kept exps
    for leaves in (first, second):
        torch.testing.assert_close(leaves[0].grad.double(), ref_h, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(leaves[1].grad.double(), ref_w, atol=1e-4, rtol=1e-4)
    (g_lp.float() * lp2).sum().backward()  # the kept exps were consumed in place: recomputes
    torch.testing.assert_close(second[1].grad.double(), 2 * ref_w, atol=1e-4, rtol=1e-4)


def test_no_grad_calls_keep_nothing(monkeypatch):
    monkeypatch.setattr(ops, "_KEEP_BYTES", 1 << 30)
    monkeypatch.setattr(ops, "_workspaces", type(ops._workspaces)())
    hidden, weight, _, labels, _, _ = _inputs(2, bias=False)
    h, w = _leaves(hidden, weight)
    with torch.no_grad():
        linear_logprobs(h, w, None, labels)
    assert getattr(ops._workspaces, "buffer", None) is None
    linear_logprobs(h, w, None, labels)
    assert ops._workspaces.buffer.numel() == hidden.shape[0] * weight.shape[0]


@pytest.mark.parametrize("entropy_in_loss", [False, True])
@pytest.mark.parametrize("keep_bytes", [0, 1 << 30])
@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])  # autocast hands the head either
def test_bfloat16_matmuls_match_autocast_and_keep_the_master_dtypes(
    monkeypatch, entropy_in_loss, keep_bytes, hidden_dtype
):
    """compute_dtype bfloat16 (CPU bf16 autocast): the log-probs and entropies of autocast's plain computation (bf16
    logits, float32 log-softmax) within bf16 rounding, float32 outputs, the gradients of the float64 reference within
    bf16 rounding, in the inputs' dtypes (a float32 master weight gets a float32 gradient)."""
    monkeypatch.setattr(ops, "_KEEP_BYTES", keep_bytes)
    hidden, weight, bias, labels, g_lp, g_ent = _inputs(3, n=64, h=32, v=300)
    ref_lp, ref_ent, ref_grads = _reference(hidden, weight, bias, labels, 1.0, entropy_in_loss, g_lp, g_ent)
    h, w, b = _leaves(hidden, weight, bias)
    h_in = h.to(hidden_dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_logits = torch.nn.functional.linear(h_in, w, b).float()
        lp, ent = linear_logprobs(
            h_in, w, b, labels, with_entropy=True, chunk_tokens=16, compute_dtype=torch.bfloat16
        )  # fmt: skip
    plain_log_p = plain_logits.log_softmax(-1)
    ulps = 2**-7 * plain_logits.abs().max().item()  # two bf16 rounding steps of the largest logit
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, plain_log_p.gather(-1, labels[:, None])[:, 0], atol=ulps, rtol=0)
    torch.testing.assert_close(ent, -(plain_log_p.exp() * plain_log_p).sum(-1), atol=ulps, rtol=0)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2 * ulps, rtol=0)
    if not entropy_in_loss:
        ent = ent.detach()
    loss = (g_lp.float() * lp).sum() + ((g_ent.float() * ent).sum() if entropy_in_loss else 0)
    loss.backward()
    assert h.grad.dtype == w.grad.dtype == b.grad.dtype == torch.float32
    for ours, ref in zip((h.grad, w.grad, b.grad), ref_grads, strict=True):
        scale = ref.abs().max()
        torch.testing.assert_close(ours.double() / scale, ref / scale, atol=3e-2, rtol=0)
