"""What a model needs to be trained here: fused GELU, AdamW, gradient checkpointing, no dropout, LoRA adapters."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlhf.config import LoraConfig
from rlhf.errors import ConfigError
from rlhf.models.loading import MODEL_BUILD_LOCK


def unwrap(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (its layers carry the adapters)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# tanh-GELU as x * sigmoid(u), u = 2 sqrt(2/pi) (x + 0.044715 x^3): the same function, since 1 + tanh(y) = 2 sigmoid(2y)
_GELU_C1 = 2 * math.sqrt(2 / math.pi)
_GELU_C3 = _GELU_C1 * 0.044715


def _gelu_sigmoid(x: Tensor) -> Tensor:
    """sigmoid(u) of the sigmoid form of tanh-GELU, in a fresh buffer (three element-wise passes: addcmul makes
    C1 + C3 x^2 in one)."""
    return torch.addcmul(x.new_tensor(_GELU_C1), x, x, value=_GELU_C3).mul_(x).sigmoid_()


class _SigmoidFormGELU(torch.autograd.Function):
    """tanh-GELU and its derivative through sigmoid(u): d/dx [x s(u)] = s + x s (1 - s) u'(x)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        s = _gelu_sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        x, s = ctx.saved_tensors
        # where |x| > 1e4, s (1 - s) is 0: the clamp keeps x u'(x) finite there (inf * 0 would be NaN)
        bounded = x.clamp(-1e4, 1e4)
        slope = bounded * bounded
        slope.mul_(3 * _GELU_C3).add_(_GELU_C1).mul_(bounded)  # x u'(x)
        s_ds = s * s
        torch.sub(s, s_ds, out=s_ds)  # s (1 - s)
        return slope.mul_(s_ds).add_(s).mul_(grad)


class CpuFastTanhGELU(nn.Module):
    """The tanh-approximated GELU, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, computed on float32 CPU
    tensors as ``x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))``: the same function (``1 + tanh(y) = 2 sigmoid(2y)``;
    results within float32 rounding, about 1e-6), because torch's CPU tanh kernel is several times slower than its
    sigmoid (forward and backward about 2.5x faster than ``F.gelu(approximate="tanh")`` on an AVX2 CPU). torch's
    fused kernel everywhere else (CUDA, half precision)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return F.gelu(x, approximate="tanh")
        if torch.is_grad_enabled() and x.requires_grad:
            return _SigmoidFormGELU.apply(x)
        return _gelu_sigmoid(x).mul_(x)


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


def adamw(params: Iterable[nn.Parameter], lr: float, eps: float = 1e-8, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one for the parameters' device (one call, not one per tensor)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in backward, non-reentrant (gradients reach LoRA adapters behind frozen inputs)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name in recent transformers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Undo `enable_gradient_checkpointing` (before a model is saved)."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_gradient_checkpointing(model: PreTrainedModel) -> bool:
    """Whether `enable_gradient_checkpointing` is on for `model`."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def disable_dropout(model: nn.Module) -> None:
    """PPO needs ratio == 1 before the first step: no dropout anywhere, in train mode too.

    Dropout modules get p = 0, and so do the float rates that layers pass to functional dropout in train mode
    (OPT's ``self.dropout``, ``attention_dropout`` handed to the attention kernel, OPT's ``layerdrop``).
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "drop" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def lora_targets(model_type: str, configured: list[str] | None) -> list[str] | str:
    """The modules LoRA adapts: the configured ones, else peft's default for the model type, else 'all-linear'
    (every linear layer but the output layer) for types peft has no default for (Phi-3's fused projections)."""
    if configured is not None:
        return configured
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    return list(defaults[model_type]) if model_type in defaults else "all-linear"


def apply_lora(policy: PreTrainedModel, lora_cfg: LoraConfig) -> nn.Module:
    """`policy` wrapped by peft with trainable LoRA adapters (its base weights frozen)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ConfigError("ppo.lora.enabled needs peft: pip install -e '.[lora]'") from err
    lora = PeftLoraConfig(
        task_type="CAUSAL_LM",
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_targets(policy.config.model_type, lora_cfg.target_modules),
    )
    with MODEL_BUILD_LOCK:
        return get_peft_model(policy, lora)
