"""Kernels that make small and mid-sized models fast on a CPU, in float32 and under bfloat16 autocast: the tanh-GELU
through a sigmoid in float32 and as torch's one-pass exact GELU in bfloat16, and attention in float32 where torch's
bf16 CPU attention backward is slow. `use_cpu_kernels` puts both into a loaded model; on other devices they call
torch's own kernels."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# tanh-GELU as x * sigmoid(u), u = 2 sqrt(2/pi) (x + 0.044715 x^3): the same function, since 1 + tanh(y) = 2 sigmoid(2y)
_GELU_C1 = 2 * math.sqrt(2 / math.pi)
_GELU_C3 = _GELU_C1 * 0.044715


def _gelu_sigmoid(x: Tensor) -> Tensor:
    """sigmoid(u) of the sigmoid form of tanh-GELU, in a fresh buffer (three element-wise passes: addcmul makes
    C1 + C3 x^2 in one)."""
    return torch.addcmul(x.new_tensor(_GELU_C1), x, x, value=_GELU_C3).mul_(x).sigmoid_()


class _SigmoidFormGELU(torch.autograd.Function):
    """tanh-GELU and its derivative through sigmoid(u): d/dx [x s(u)] = s + x s (1 - s) u'(x), computed in float32,
    the output and the input's gradient in the input's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        wide = x.float()
        s = _gelu_sigmoid(wide)
        ctx.save_for_backward(wide, s)
        return (wide * s).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        x, s = ctx.saved_tensors
        # where |x| > 1e4, s (1 - s) is 0: the clamp keeps x u'(x) finite there (inf * 0 would be NaN)
        bounded = x.clamp(-1e4, 1e4)
        slope = torch.addcmul(x.new_tensor(_GELU_C1), bounded, bounded, value=3 * _GELU_C3).mul_(bounded)  # x u'(x)
        s_ds = torch.addcmul(s, s, s, value=-1)  # s (1 - s)
        derivative = torch.addcmul(s, slope, s_ds, out=slope)  # six element-wise passes in all
        return derivative.mul_(grad).to(grad.dtype)


class CpuFastTanhGELU(nn.Module):
    """The tanh-approximated GELU, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, on CPU tensors.

    float32: computed as ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``, the same function (``1 + tanh(y) = 2
    sigmoid(2y)``; results within float32 rounding, about 1e-6), because torch's CPU tanh kernel is several times
    slower than its sigmoid (forward and backward about 2.5x faster than ``F.gelu(approximate="tanh")`` on an AVX2
    CPU).

    bfloat16 (autocast's linear outputs): the exact GELU, ``x Phi(x)``, in torch's one-pass bf16 kernel, forward and
    backward. The tanh form approximates it to within 4.7e-4 (its derivative to 8.7e-4), the size of the rounding of
    a bf16 output itself (on average 3e-4 to 9e-4 for inputs of standard deviation 0.5 to 4). The tanh form costs
    six element-wise passes (the sigmoid form) or torch's one-pass kernel with its slow tanh; the exact one is one
    fast pass: the `cpu` bench's GRPO update was 15% shorter with it (docs/benchmark.md "Paired comparisons").
    nanoGPT runs GPT-2's released weights with the exact form. Policy, reference and reward models all compute it,
    so the first update's KL stays exactly 0 and its ratio 1.

    torch's fused tanh kernel everywhere else (CUDA, float16)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return F.gelu(x, approximate="tanh")
        if x.dtype == torch.bfloat16:
            return F.gelu(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _SigmoidFormGELU.apply(x)
        wide = x.float()
        return _gelu_sigmoid(wide).mul_(wide).to(x.dtype)


def fuse_gelu(model: nn.Module) -> int:
    """Swap transformers' tanh-GELU modules for `CpuFastTanhGELU`: the Python ``gelu_new`` (six element-wise ops;
    GPT-2, Phi), ``gelu_fast`` and ``gelu_pytorch_tanh`` (Gemma) compute the same function (differences ~1e-6 in
    float32), a large share of a small model's time on CPU. Returns the count."""
    from transformers import activations

    tanh_gelus = tuple(
        getattr(activations, name)
        for name in ("NewGELUActivation", "FastGELUActivation", "GELUTanh", "PytorchGELUTanh")
        if hasattr(activations, name)
    )
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) in tanh_gelus:
                setattr(module, name, CpuFastTanhGELU())
                swapped += 1
    return swapped


# transformers' attention-function registry name of `_float32_cpu_sdpa`
CPU_SDPA = "sdpa_float32_on_cpu"


def _float32_cpu_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' sdpa attention, in float32 for half-precision CPU tensors (the output rounded back): torch's
    bf16 flash-attention backward on a CPU is several times slower than its float32 one (7.1 against 1.1 ms per
    layer at 16 x 48 tokens, 4 heads), and the casts cost a few percent of that. Elsewhere unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or query.dtype == torch.float32:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back to bfloat16
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(query.dtype), weights


def _register_cpu_sdpa() -> bool:
    """Register `_float32_cpu_sdpa` (and sdpa's mask builder under its name) with transformers; False where this
    transformers has no attention registry (older than 4.48 or so)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register(CPU_SDPA, _float32_cpu_sdpa)
    AttentionMaskInterface.register(CPU_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return True


def use_cpu_attention(model: nn.Module) -> bool:
    """Switch a CPU model that uses transformers' sdpa attention to `_float32_cpu_sdpa`; whether it did. The choice is
    the loaded model's alone: `save_pretrained` does not write it into the checkpoint's config."""
    config = getattr(model, "config", None)
    params = next(model.parameters(), None)
    if config is None or params is None or params.device.type != "cpu":
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    if not _register_cpu_sdpa():
        return False
    model.set_attn_implementation(CPU_SDPA)
    return True


def use_cpu_kernels(model: nn.Module) -> None:
    """`fuse_gelu` and `use_cpu_attention` on a loaded model (a peft wrapper's base model included)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    fuse_gelu(base)
    use_cpu_attention(base)
