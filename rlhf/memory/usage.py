"""What this machine and process use now, as opposed to the estimate: free RAM or GPU memory, the process's resident
set, and a stage's measured peak. psutil and torch are imported where called: `rlhf memory` and the preflight stay
light."""

from __future__ import annotations

import os
from typing import Any


def machine_ram() -> tuple[float, float]:
    """This machine's available and total RAM in bytes."""
    import psutil

    memory = psutil.virtual_memory()
    return float(memory.available), float(memory.total)


def available_memory(device_type: str, device_index: int | None = None) -> float:
    """Free bytes of the CUDA device, or the machine's available RAM on CPU."""
    if device_type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device_index or 0)
        return float(free)
    import psutil

    return float(psutil.virtual_memory().available)


def process_rss() -> float:
    import psutil

    return float(psutil.Process(os.getpid()).memory_info().rss)


def peak_memory_mb(device: Any) -> float:
    """Peak GPU memory where there is one (since the last `reset_peak_memory`), else the process's peak resident
    set size (over the whole process: a later stage's figure includes the earlier ones' peak)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except ImportError:  # pragma: no cover - non-POSIX
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss / 2**20


def reset_peak_memory(device: Any) -> None:
    """Start a stage's peak count afresh on a GPU (the process's peak RSS on CPU cannot be reset)."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
