"""The one place checkpoints are loaded: every stage loads through the ``Auto*`` classes from a path or hub id,
exactly as it would load ``gpt2``; the tiny bootstrap model is saved with ``save_pretrained`` and loaded the same
way."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from rlhf.config import RuntimeConfig
from rlhf.models.device import compute_dtype

hf_logging.set_verbosity_error()  # load reports and shard progress bars are noise in pipeline logs
hf_logging.disable_progress_bar()

# Building a model is not thread-safe: transformers and peft patch module-level state while they do (weight init
# switched off, parameters created on the meta device), so a model built in another thread at that moment gets
# meta tensors. Concurrent sweep variants run in threads of one process: every model is built under this lock.
MODEL_BUILD_LOCK = threading.RLock()


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
    with MODEL_BUILD_LOCK:
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


def as_scalar_head(config: Any, name: str, kwargs: dict[str, Any]) -> None:
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
    as_scalar_head(config, name, kwargs)
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


def is_local_checkpoint(name: str) -> bool:
    """Whether `name` is a folder on this machine (else a hub id)."""
    return Path(name).is_dir()
