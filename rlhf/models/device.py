"""Device and compute dtype of a run, autocast, and the process's CPU settings (torch's threads, the allocator)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from rlhf.config import RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.models.cpu_bf16 import NARROWEST_BF16, CpuBf16Check, cpu_bf16_check

# Building a model is not thread-safe: transformers and peft patch module-level state while they do (weight init
# switched off, parameters created on the meta device), so a model built in another thread at that moment gets
# meta tensors. Concurrent sweep variants run in threads of one process: every model is built under this lock.
MODEL_BUILD_LOCK = threading.RLock()

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"runtime.device is '{name}' but CUDA is not available on this machine")
    return device


def compute_dtype(
    name: str, device: torch.device, cpu_check: CpuBf16Check | None = None, width: int | None = None
) -> torch.dtype:
    """`runtime.dtype` on `device`. 'auto': bfloat16 on a CUDA device that supports it; on a CPU bfloat16 (autocast)
    where the CPU multiplies bf16 natively, the measured check passes (`rlhf.models.cpu_bf16`: `cpu_check`, or this
    machine's cached verdict where None) and the model is at least NARROWEST_BF16 wide (`width`; None: unknown, taken
    as wide), else float32; float32 elsewhere. A named dtype is that dtype."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        narrow = width is not None and width < NARROWEST_BF16
        return torch.bfloat16 if not narrow and (cpu_check or cpu_bf16_check()).passed else torch.float32
    return torch.float32


def run_dtype(runtime: RuntimeConfig, device: torch.device) -> torch.dtype:
    """The dtype a run under `runtime` computes in on `device`: `compute_dtype` of its `runtime.dtype` at its model's
    width (`RuntimeConfig.model_width`)."""
    return compute_dtype(runtime.dtype, device, width=runtime.model_width)


def resolved_dtype_name(name: str, device_type: str, width: int | None = None) -> str:
    """`runtime.dtype` `name` resolved on a device of `device_type` ('cpu', 'cuda', ...) for a model of width `width`,
    as a name ('float32', 'bfloat16', 'float16'): what the cache keys and the memory estimate take."""
    dtype = compute_dtype(name, torch.device(device_type), width=width)
    return next(key for key, value in DTYPES.items() if value == dtype)


def dtype_reason(
    name: str, device: torch.device, cpu_check: CpuBf16Check | None = None, width: int | None = None
) -> str:
    """Why `runtime.dtype` `name` computes in `compute_dtype(name, device, cpu_check, width)` there, in a few words
    (the summary's header and the run's log)."""
    if name != "auto":
        return f"runtime.dtype: {name}"
    if device.type == "cuda":
        return "runtime.dtype: auto (bfloat16 where the GPU supports it)"
    if device.type == "cpu":
        check = cpu_check or cpu_bf16_check()
        if check.passed and width is not None and width < NARROWEST_BF16:
            return f"runtime.dtype: auto (the model's width {width} is under {NARROWEST_BF16}, where bf16 does not pay)"
        return f"runtime.dtype: auto ({check.reason()})"
    return "runtime.dtype: auto (float32 off CUDA and CPU)"


def autocast_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype `autocast(device, dtype)` multiplies in: `dtype` where it turns autocast on, else float32."""
    if (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)) or (
        device.type == "cpu" and dtype == torch.bfloat16
    ):
        return dtype
    return torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Autocast in `dtype`: bfloat16 or float16 on CUDA devices, bfloat16 on a CPU (matmuls in bfloat16 with float32
    accumulation, fast on CPUs with AVX-512 BF16 or AMX); a no-op for float32 and elsewhere."""
    if autocast_dtype(device, dtype) == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def configure_cpu(threads: int | None) -> None:
    """torch's CPU threads (None keeps torch's default), glibc's malloc kept from handing freed memory back
    (`keep_freed_memory`); tokenizers stay single-threaded unless told otherwise. Every stage calls it first."""
    if threads:
        torch.set_num_threads(threads)
    keep_freed_memory()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to `n` inside the block, the count before it restored after it (also on an
    exception); None leaves the count as it is."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# glibc malloc: blocks above MMAP_THRESHOLD get their own mapping, and free memory above TRIM_THRESHOLD at the top of
# the heap goes back to the kernel (docs/benchmark.md "The allocator")
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.cache  # the thresholds are the process's: every stage calls configure_cpu, the first one sets them
def keep_freed_memory() -> bool:
    """Fixes glibc's malloc thresholds at MMAP_THRESHOLD and TRIM_THRESHOLD; whether it did. By default glibc maps
    blocks of a few MiB afresh and trims the heap's top, so the activations a training step frees and allocates again
    come back as new pages, each a page fault (docs/benchmark.md "The allocator"); with these thresholds the freed
    memory is reused. Once per process, like jemalloc or tcmalloc (which PyTorch recommends on CPUs). Left alone
    where the user set glibc's malloc tunables (GLIBC_TUNABLES, MALLOC_*_), and off glibc (musl's mallopt is a
    no-op; other systems lack it)."""
    if not sys.platform.startswith("linux"):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def device_names(name: str = "auto") -> list[str]:
    """The devices a run configured with `name` may use: every CUDA device for 'auto' or 'cuda' (['cuda:0', ...]),
    the one named ('cuda:1'), or ['cpu']."""
    device = resolve_device(name)
    if device.type != "cuda":
        return [device.type]
    if device.index is not None:
        return [f"cuda:{device.index}"]
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
