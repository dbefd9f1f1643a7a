"""A run's model config and device, read without loading anything: the SFT model's ``config.json`` (or the bootstrap
GPT-2's, or a GGUF file's metadata), its positions, and the device type ``runtime.device`` names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf.config import SFTConfig
from rlhf.errors import ConfigError


def config_value(cfg: Any, *names: str) -> Any:
    """The first of `names` that `cfg` sets (architectures name the same size differently)."""
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return None


def model_positions(cfg: Any) -> int | None:
    """The longest sequence a config's model accepts (positions of its embedding or rotary table)."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return config_value(text, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def read_model_config(sft: SFTConfig, trust_remote_code: bool = False, model_config: str | Path | None = None) -> Any:
    """The SFT model's config: `model_config` (a config.json or its folder) when given, the bootstrap GPT-2's
    when ``sft.model`` is None, else ``config.json`` of ``sft.model`` (a local folder or, with hub access, an id;
    only that file is read; `trust_remote_code`: runtime's), or the metadata of its GGUF file."""
    from transformers import AutoConfig, GPT2Config

    if model_config is not None:
        path = Path(model_config)
        fields = json.loads((path if path.is_file() else path / "config.json").read_text())
        fields = {k: v for k, v in fields.items() if not k.startswith("_")}
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if sft.model is None:
        boot = sft.bootstrap
        return GPT2Config(
            vocab_size=boot.vocab_size,
            n_positions=boot.n_positions,
            n_embd=boot.n_embd,
            n_layer=boot.n_layer,
            n_head=boot.n_head,
            bos_token_id=0,
            eos_token_id=0,
        )
    from rlhf.models.gguf import gguf_config, gguf_path, gguf_reference  # heavy: torch (a GGUF model's shape)

    ref = gguf_reference(sft.model, sft.gguf_file)
    if ref is not None:  # a GGUF file: its metadata is the config
        return gguf_config("sft.model", gguf_path("sft.model", ref, sft.revision))
    try:
        return AutoConfig.from_pretrained(sft.model, revision=sft.revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"sft.model: could not read the config of '{sft.model}': {first}") from None


def config_device_type(device: str) -> str:
    """'cuda' or 'cpu': where `device` (runtime.device) puts the models ('auto': CUDA where this machine has it; MPS,
    with memory shared with the CPU, is estimated as a CPU). Nothing is initialised on the device."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"
