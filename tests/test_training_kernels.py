"""The CPU kernels swapped into models for training speed compute what the models' own modules compute."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from rlhf.models.cpu_kernels import CpuFastTanhGELU, fuse_gelu


def _reference_gelu(x: torch.Tensor) -> torch.Tensor:  # the tanh formula in float64
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_cpu_fast_gelu_matches_the_tanh_formula_and_its_gradient(scale):
    x64 = (torch.randn(4096, dtype=torch.float64) * scale).requires_grad_()
    grad = torch.randn_like(x64)
    _reference_gelu(x64).backward(grad)
    x32 = x64.detach().float().requires_grad_()
    out = CpuFastTanhGELU()(x32)
    out.backward(grad.float())
    torch_out = F.gelu(x64.detach().float(), approximate="tanh")
    assert torch.allclose(out.double(), _reference_gelu(x64.detach()), atol=2e-6 * scale, rtol=1e-5)
    assert torch.allclose(out, torch_out, atol=2e-6 * scale, rtol=1e-5)
    assert torch.allclose(x32.grad.double(), x64.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the no-grad path (rollout forwards) gives the same values
        assert torch.equal(CpuFastTanhGELU()(x32.detach()), out.detach())


def test_cpu_fast_gelu_is_finite_at_extreme_inputs():
    x = torch.tensor([-1e30, -1e6, -50.0, 0.0, 50.0, 1e6, 1e30], requires_grad=True)
    out = CpuFastTanhGELU()(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert x.grad.tolist() == pytest.approx([0, 0, 0, 0.5, 1, 1, 1])


def _tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_layer=2, n_head=2, n_embd=32, n_positions=32, activation_function="gelu_new")
    return GPT2LMHeadModel(config)


def test_fuse_gelu_keeps_a_models_outputs_and_gradients(family_checkpoint):
    for model in (_tiny_gpt2(), AutoModelForCausalLM.from_pretrained(family_checkpoint("gemma"))):
        model.eval()
        ids = torch.randint(1, 60, (2, 12))
        before = model(ids).logits
        before.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        assert fuse_gelu(model) >= 1
        assert any(isinstance(m, CpuFastTanhGELU) for m in model.modules())
        after = model(ids).logits
        after.square().mean().backward()
        assert torch.allclose(after, before, atol=1e-5)
        for name, param in model.named_parameters():
            if name in grads:
                assert torch.allclose(param.grad, grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_cpu_gelu_in_bf16_is_the_exact_gelu_within_bf16_rounding_of_the_tanh_form(scale):
    x = (torch.randn(4096) * scale).bfloat16().requires_grad_()
    out = CpuFastTanhGELU()(x)
    assert out.dtype == torch.bfloat16
    grad = torch.randn(4096).bfloat16()
    out.backward(grad)
    exact_x = x.detach().clone().requires_grad_()
    F.gelu(exact_x).backward(grad)  # torch's exact GELU, the same values and gradient
    assert torch.equal(out, F.gelu(x.detach())) and torch.equal(x.grad, exact_x.grad)
    with torch.no_grad():  # the no-grad path (rollout forwards) gives the same values
        assert torch.equal(CpuFastTanhGELU()(x.detach()), out.detach())
    # against the tanh form in float64: its bf16 rounding (half a step) plus the forms' 4.7e-4 apart
    tanh_form = _reference_gelu(x.detach().double())
    torch.testing.assert_close(out.double(), tanh_form, atol=5e-4, rtol=2**-8)
    assert not torch.equal(out, tanh_form.bfloat16())  # the exact form: some bf16 outputs differ


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma", "phi", "opt"])
def test_cpu_attention_keeps_outputs_and_stays_out_of_the_checkpoint(family_checkpoint, family, tmp_path):
    """The float32 CPU attention under bf16 autocast: float32 models unchanged bit for bit, bf16 autocast logits
    within bf16 rounding of sdpa's, gradients no further from the float32 gradients than sdpa's own bf16 ones are;
    the saved config still names sdpa (or nothing)."""
    from rlhf.models.cpu_kernels import CPU_SDPA, use_cpu_attention

    path = family_checkpoint(family)
    exact = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    fast = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    assert use_cpu_attention(fast)
    assert fast.config._attn_implementation == CPU_SDPA
    ids = torch.randint(3, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row: the mask reaches the kernel
    with torch.no_grad():
        assert torch.equal(plain(ids, attention_mask=mask).logits, fast(ids, attention_mask=mask).logits)
    logits = {}
    for name, model, bf16 in (("exact", exact, False), ("plain", plain, True), ("fast", fast, True)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits[name] = model(ids, attention_mask=mask).logits.float()
        logits[name][mask.bool()].square().mean().backward()
    scale = logits["plain"].abs().max()
    torch.testing.assert_close(logits["fast"] / scale, logits["plain"] / scale, atol=2e-2, rtol=0)
    params = zip(exact.named_parameters(), plain.parameters(), fast.parameters(), strict=True)
    for (name, p_exact), p_plain, p_fast in params:
        if p_exact.grad is None:
            continue
        reference = p_exact.grad.norm()
        # rounding noise is compared in norm: one element of a bf16 gradient can be off by more than its size
        sdpa_error = (p_plain.grad - p_exact.grad).norm()
        fast_error = (p_fast.grad - p_exact.grad).norm()
        assert fast_error <= 2 * sdpa_error + 2e-2 * reference, (name, float(fast_error), float(sdpa_error))
    fast.save_pretrained(tmp_path)
    assert CPU_SDPA not in (tmp_path / "config.json").read_text()
