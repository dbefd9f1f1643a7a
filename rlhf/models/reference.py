"""The frozen reference of a trained model: a copy that computes under the run's autocast exactly what the trained
model computes at the same weights (KL 0 and ratio 1 at the start of PPO), in less memory than a float32 copy."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from rlhf.config import RuntimeConfig
from rlhf.models.device import autocast_dtype, run_dtype
from rlhf.models.loading import from_pretrained_with, hub_kwargs

# The layers whose parameters autocast hands to its matrix multiplies (linear, addmm) in the compute dtype, weight and
# bias alike: held in that dtype, they give the values autocast would have cast them to (round to nearest even).
_AUTOCAST_MATMULS = (nn.Linear, Conv1D)


def autocast_lowered_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of `model` that a reference copy may hold in the autocast dtype without changing what it
    computes under autocast (`match_autocast`), by name: the weights and biases of its linear (and GPT-2 Conv1D)
    layers, except a parameter another kind of module also uses (tied input embeddings are looked up, not
    multiplied) and the LM head's bias (the fused CPU LM head adds it in float32, `rlhf.ops.linear_logprobs`).
    Everything else (embeddings, norms, rotary buffers) stays float32: the trained model computes those in float32
    under autocast, and a bf16 copy would round the residual stream. Works on a meta-device model (no data read)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_bias = getattr(head, "bias", None)
    elsewhere = {
        id(param)
        for module in model.modules()
        if not isinstance(module, _AUTOCAST_MATMULS)
        for param in module.parameters(recurse=False)
    }
    lowered: dict[str, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, _AUTOCAST_MATMULS):
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) in elsewhere or param is head_bias or not param.is_floating_point():
                continue
            lowered[f"{prefix}.{name}" if prefix else name] = param
    return lowered


def match_autocast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Make a frozen float32 copy of a trained model compute under autocast in `dtype` exactly what the trained
    model (float32 master weights under the same autocast) computes at the same weights, in less memory: the
    parameters autocast casts anyway (`autocast_lowered_parameters`) are stored in `dtype`, the rest stay float32.
    A no-op for float32. Returns `model`."""
    if dtype == torch.float32:
        return model
    for param in autocast_lowered_parameters(model).values():
        param.data = param.data.to(dtype)
    return model


def reference_bytes(params: int, lowered: int, element_size: int) -> int:
    """Bytes of the parameters of the reference `load_reference_lm` makes of a model of `params` parameters, of which
    `lowered` are autocast-lowered (`autocast_lowered_parameters`; counted on a meta-device model by the memory
    estimate), for autocast with `element_size`-byte elements (4: no autocast, everything float32)."""
    return lowered * element_size + (params - lowered) * 4


def load_reference_lm(name: str, runtime: RuntimeConfig, device: torch.device) -> PreTrainedModel:
    """The frozen reference of a policy trained from `name` (PPO with full fine-tuning): it computes under the
    run's autocast exactly what the policy computes at the same weights, so that the KL to it is 0 and the ratio 1
    at the start, in every runtime dtype. The policy holds float32 master weights under autocast (`load_options`), so
    its residual stream, norms and embeddings are float32; a reference loaded in bf16 would round them (a first-update
    KL of 0.07 measured on a GPU). Loaded in float32, then `match_autocast`: matmul weights in the dtype autocast
    multiplies in (`autocast_dtype`); all float32 where the run computes without autocast (float32, float16 on a
    CPU), as the policy does."""
    kwargs = hub_kwargs(None, runtime.trust_remote_code)
    model = from_pretrained_with(AutoModelForCausalLM, name, runtime.attn_implementation, dtype=torch.float32, **kwargs)
    return match_autocast(model, autocast_dtype(device, run_dtype(runtime, device))).to(device)
