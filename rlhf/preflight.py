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
    check_ppo_processes(config)


def check_ppo_processes(config: PipelineConfig) -> None:
    """runtime.ppo_processes splits the PPO batches evenly and, on CUDA, has a device per process."""
    n = config.runtime.ppo_processes
    if n == 1:
        return
    from rlhf.ppo.distributed import check_world_size

    try:
        check_world_size(config.ppo, n)
    except ConfigError as err:
        raise ConfigError(f"runtime.ppo_processes={n}: {err}") from None
    import torch

    device = config.runtime.device
    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if wants_cuda and n > torch.cuda.device_count():
        raise ConfigError(
            f"runtime.ppo_processes ({n}) is more than the {torch.cuda.device_count()} CUDA devices of this machine"
        )
