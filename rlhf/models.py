"""The one place models and tokenizers are built or loaded.

Every stage loads checkpoints through the ``Auto*`` classes from a path or hub id, exactly as it would load
``gpt2``; the tiny bootstrap model is saved with ``save_pretrained`` and loaded the same way.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from rlhf.config import RuntimeConfig
from rlhf.errors import ConfigError

hf_logging.set_verbosity_error()  # load reports and shard progress bars are noise in pipeline logs
hf_logging.disable_progress_bar()

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device is '{name}' but CUDA is not available on this machine")
    return device


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`runtime.dtype` on `device`: 'auto' is bfloat16 on a CUDA device that supports it, else float32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Autocast in `dtype` (bfloat16 or float16) on CUDA devices; a no-op for float32 and on other devices."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return torch.autocast("cuda", dtype=dtype)
    return nullcontext()


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 style) on the task's text, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None
    )


def build_tiny_gpt2(
    tokenizer: PreTrainedTokenizerBase, n_layer: int, n_head: int, n_embd: int, n_positions: int, seed: int
) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def _load_kwargs(revision: str | None, trust_remote_code: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision:
        kwargs["revision"] = revision
    return kwargs


def load_options(runtime: RuntimeConfig, device: torch.device, trainable: bool) -> dict[str, Any]:
    """Keyword arguments of `load_causal_lm` / `load_reward_model` under `runtime`.

    A trained model gets float32 master weights (a bf16 checkpoint too) and computes under `autocast`; a frozen
    one (reference, reward model, evaluation) is loaded in the runtime dtype.
    """
    return {
        "trust_remote_code": runtime.trust_remote_code,
        "dtype": torch.float32 if trainable else compute_dtype(runtime.dtype, device),
        "attn_implementation": runtime.attn_implementation,
    }


def _from_pretrained(auto_class: Any, name: str, attn_implementation: str | None, **kwargs: Any) -> PreTrainedModel:
    """`auto_class.from_pretrained` with an attention kernel; 'sdpa' falls back to the model's default (eager) for
    architectures without an sdpa implementation (Gemma-2: its attention logits are soft-capped)."""
    try:
        return auto_class.from_pretrained(name, attn_implementation=attn_implementation, **kwargs)
    except ValueError:
        if attn_implementation != "sdpa":
            raise
    return auto_class.from_pretrained(name, **kwargs)  # transformers' choice: sdpa where it can, else eager


def load_tokenizer(name: str, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer; one without a pad token pads with its EOS token (masks, not ids, mark padding here)."""
    tok = AutoTokenizer.from_pretrained(name, **_load_kwargs(revision, trust_remote_code))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    name: str,
    device: torch.device,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "sdpa",
) -> PreTrainedModel:
    """A causal LM with weights in `dtype` (whatever dtype the checkpoint was saved in)."""
    kwargs = _load_kwargs(revision, trust_remote_code)
    model = _from_pretrained(AutoModelForCausalLM, name, attn_implementation, dtype=dtype, **kwargs)
    return model.to(device)


def token_ids(value: int | list[int] | None) -> list[int]:
    """The ids of a config field that holds none, one id or a list of them (Llama 3.1's eos_token_id)."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _pad_id(name: str, config: Any, kwargs: dict[str, Any]) -> int | None:
    """The pad id of a reward model: the tokenizer's (its EOS when it has no pad token), else the first EOS id."""
    try:
        return load_tokenizer(name, **kwargs).pad_token_id
    except (OSError, ValueError):  # a checkpoint without a tokenizer
        return next(iter(token_ids(config.eos_token_id)), None)


def _as_scalar_head(config: Any, name: str, kwargs: dict[str, Any]) -> None:
    """Make `config` a one-output regression head: a classifier checkpoint's labels and problem type go (the next
    stage loads what this one saves), and the pad id becomes one int (the tokenizer's)."""
    config.problem_type = None  # regression with one label, whatever the checkpoint was trained for
    config.num_labels = 1  # resets id2label / label2id to one label
    if not isinstance(config.pad_token_id, int):
        config.pad_token_id = _pad_id(name, config, kwargs)


def load_reward_model(
    name: str,
    device: torch.device,
    revision: str | None = None,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "sdpa",
) -> PreTrainedModel:
    """A sequence classifier with one output: a fresh scalar head when `name` is a causal LM checkpoint or a
    classifier with another number of labels, the trained one when it is a reward model."""
    kwargs = _load_kwargs(revision, trust_remote_code)
    config = AutoConfig.from_pretrained(name, **kwargs)
    labels = config.num_labels
    _as_scalar_head(config, name, kwargs)
    model = _from_pretrained(
        AutoModelForSequenceClassification,
        name,
        attn_implementation,
        config=config,
        dtype=dtype,
        ignore_mismatched_sizes=labels != 1,  # a classifier's head: a fresh scalar head replaces it
        **kwargs,
    )
    return model.to(device)


def unwrap(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (its layers carry the adapters)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def fuse_gelu(model: nn.Module) -> int:
    """Swap transformers' Python tanh-GELU (``gelu_new``: six element-wise ops) for torch's fused kernel.

    Same formula (differences ~1e-7 in float32); a large share of a small model's time on CPU. Returns the count.
    """
    from transformers.activations import GELUTanh, NewGELUActivation

    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is NewGELUActivation:
                setattr(module, name, GELUTanh())
                swapped += 1
    return swapped


def adamw(params, lr: float, eps: float = 1e-8, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW with the fused kernel where torch has one for the parameters' device (one call, not one per tensor)."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=True)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)


def hidden_width(model: PreTrainedModel) -> int:
    """Width of the backbone's last hidden state, what the LM head reads (OPT-350m projects its hidden_size down to
    word_embed_proj_dim)."""
    head = model.get_output_embeddings()
    return head.in_features if isinstance(head, nn.Linear) else model.config.hidden_size


def lm_logits(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """The LM head on backbone hidden states, as the model's own forward computes its logits (Gemma-2's final
    soft-cap: cap * tanh(logits / cap)). Shape: (b, t, h) -> (b, t, v)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in backward, non-reentrant (gradients reach LoRA adapters behind frozen inputs)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name in recent transformers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_gradient_checkpointing(model: PreTrainedModel) -> None:
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_gradient_checkpointing(model: PreTrainedModel) -> bool:
    """Whether `enable_gradient_checkpointing` is on for `model`."""
    return any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules())


def is_local_checkpoint(name: str) -> bool:
    return Path(name).is_dir()


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding. Shape: (b, t) -> (b, t)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _score_head(model: PreTrainedModel) -> nn.Module:
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ConfigError(f"{type(model).__name__} has no scalar head named 'score' or 'classifier'")


def token_scores(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The scalar head at every position (value estimates; a reward model reads the last real one).

    Shape: (b, t) -> (b, t).
    """
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state
    return _score_head(model)(hidden).squeeze(-1).float()


def sequence_scores(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Reward-model score at the last real (non-pad) token of each row. Shape: (b, t) -> (b,)."""
    per_token = token_scores(model, input_ids, attention_mask)
    last = last_real_index(attention_mask)
    return per_token.gather(1, last.unsqueeze(1)).squeeze(1)


def last_real_index(attention_mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of a mask (works for left and right padding). Shape: (b, t) -> (b,)."""
    t = attention_mask.shape[1]
    positions = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    return (positions * attention_mask.long()).argmax(dim=1)


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
