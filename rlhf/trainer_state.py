"""The resume state of the single-model trainers (SFT, reward model), saved atomically and loaded back.

A state folder holds the model weights (``model.safetensors``, tied weights handled), any extra tensor files, and
``trainer_state.pt`` with the optimizer, scheduler, Python and torch RNG states and the trainer's own fields
(step, data order, ...). It is only ever loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_file, save_model
from torch import Tensor, nn

from rlhf.checkpoints import atomic_dir, rng_state_tuple

STATE_FILE = "trainer_state.pt"
MODEL_FILE = "model.safetensors"


def save_trainer_state(
    folder: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng: random.Random,
    fields: dict[str, Any],
    tensor_files: dict[str, dict[str, Tensor]] | None = None,
) -> None:
    """Write the whole state to `folder` in one rename: a crash mid-save leaves the previous state intact."""
    with atomic_dir(folder) as tmp:
        save_model(model, str(tmp / MODEL_FILE))
        for name, tensors in (tensor_files or {}).items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / name)
        state = {
            **fields,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "python_rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
        }
        torch.save(state, tmp / STATE_FILE)


def load_trainer_state(
    folder: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng: random.Random,
    device: torch.device,
) -> dict[str, Any] | None:
    """Restore model, optimizer, scheduler and RNGs from `folder`; returns the saved fields (None: no state)."""
    folder = Path(folder)
    if not (folder / STATE_FILE).is_file():
        return None
    saved = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    load_model(model, folder / MODEL_FILE, device=str(device))
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    rng.setstate(rng_state_tuple(saved["python_rng"]))
    torch.set_rng_state(saved["torch_rng"])
    return saved
