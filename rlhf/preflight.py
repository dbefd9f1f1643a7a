"""Checks that run before anything is loaded: a bad path or an unreachable model is one sentence, early."""

from __future__ import annotations

import os
from pathlib import Path

from rlhf.config import PipelineConfig
from rlhf.data.prepare import check_source
from rlhf.errors import ConfigError


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def check_model_reference(key: str, name: str) -> None:
    """A model reference is a local checkpoint folder or, with hub access, a hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{key}: folder {name} has no config.json (is it a save_pretrained checkpoint?)")
        return
    if name.startswith((".", "/", "~")) or path.suffix:
        raise ConfigError(f"{key}: checkpoint folder {name} does not exist")
    if hub_offline():
        raise ConfigError(
            f"{key}: '{name}' is not a local folder and hub downloads are off (HF_HUB_OFFLINE=1); "
            "download it first or run with HF_HUB_OFFLINE=0"
        )


def preflight(config: PipelineConfig) -> None:
    """Everything that can be checked without loading a model or reading the data set."""
    check_source(config.data)
    if config.sft.model is not None:
        check_model_reference("sft.model", config.sft.model)
