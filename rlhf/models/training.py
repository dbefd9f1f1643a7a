"""What a model needs to be trained here: AdamW, gradient checkpointing, no dropout, LoRA adapters (the CPU kernels
are in `rlhf.models.cpu_kernels`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PreTrainedModel

from rlhf.config import LoraConfig
from rlhf.errors import ConfigError
from rlhf.models.device import MODEL_BUILD_LOCK
from rlhf.models.sharding import transformer_blocks


def unwrap(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (its layers carry the adapters)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


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


def freeze_lower_layers(model: nn.Module, n: int) -> int:
    """Freeze the input embeddings and the first `n` transformer blocks of `model` (no gradients, so no optimizer
    state and no activations kept for backward below the first trained block); returns the trainable parameter
    count. Position embeddings and blocks are found as FSDP finds them (`transformer_blocks`); tied output
    embeddings stay frozen with the input ones. A ConfigError when the model has no more than `n` blocks."""

    if n <= 0:
        return sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = transformer_blocks(model)
    if n >= len(blocks):
        raise ConfigError(
            f"reward.frozen_layers ({n}) must be less than the model's {len(blocks)} transformer blocks: the top "
            "blocks and the head are what trains"
        )
    trunk = getattr(unwrap(model), "base_model", model)
    for embedding in (trunk.get_input_embeddings(), *_position_embeddings(trunk)):
        embedding.requires_grad_(False)
    for block in blocks[:n]:
        block.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _position_embeddings(model: nn.Module) -> list[nn.Module]:
    """Learned position embeddings (GPT-2's wpe, OPT's embed_positions): below every block like the token ones."""
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in ("wpe", "embed_positions")]


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
