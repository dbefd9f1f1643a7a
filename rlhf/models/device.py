"""Device and compute dtype of a run, autocast, and torch's CPU threads."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch

from rlhf.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device is '{name}' but CUDA is not available on this machine")
    return device


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`runtime.dtype` on `device`: 'auto' is bfloat16 on a CUDA device that supports it, else float32."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return DTYPES[name]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (the AVX-512 BF16 or AMX flags of Linux's /proc/cpuinfo): there
    bf16 matmuls run about twice as fast as float32 ones; elsewhere they are emulated and slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Autocast in `dtype`: bfloat16 or float16 on CUDA devices, bfloat16 on a CPU (matmuls in bfloat16 with float32
    accumulation, fast on CPUs with AVX-512 BF16 or AMX); a no-op for float32 and elsewhere."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return torch.autocast("cuda", dtype=dtype)
    if device.type == "cpu" and dtype == torch.bfloat16:
        return torch.autocast("cpu", dtype=dtype)
    return nullcontext()


def set_threads(threads: int | None) -> None:
    """torch's CPU threads (None keeps torch's default); tokenizers stay single-threaded unless told otherwise."""
    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def device_names(name: str = "auto") -> list[str]:
    """The devices a run configured with `name` may use: every CUDA device for 'auto' or 'cuda' (['cuda:0', ...]),
    the one named ('cuda:1'), or ['cpu']."""
    device = resolve_device(name)
    if device.type != "cuda":
        return [device.type]
    if device.index is not None:
        return [f"cuda:{device.index}"]
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
