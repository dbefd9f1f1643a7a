"""The limit report of `rlhf bench` (docs/benchmark.md "The limit"): each phase's achieved FLOP/s against the
measured matmul peak, and on a GPU the bytes generation reads per token against the measured memory bandwidth.

FLOPs are those of `torch.utils.flop_counter.FlopCounterMode`: matmuls, convolutions and attention (forward and
backward; element-wise work such as softmax, GELU, layer norms and AdamW counts zero).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's registry has the CUDA attention kernels but not the CPU flash kernel that sdpa picks on the CPU
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
}


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """(fn's result, the FLOPs it ran in this thread: forward and backward). Work in other threads is not seen."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        out = fn(*args, **kwargs)
    return out, counter.get_total_flops()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_matmul(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b)
    synchronize(device)
    return time.perf_counter() - t0


def matmul_peak(
    dtype: torch.dtype, device: torch.device, n: int = 2048, reps: int = 5, max_s: float = 2.0
) -> tuple[float, int]:
    """(FLOP/s, size): the best of `reps` timed n x n matmuls in `dtype` on `device` (the current torch threads on
    a CPU) after a warm-up. Where a 512 x 512 probe says one n x n matmul would take over `max_s` (bf16 on a CPU
    without bf16 instructions runs at a fraction of fp32), the largest smaller power of two that does not."""
    gen = torch.Generator(device=device).manual_seed(0)

    def operands(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.randn(size, size, generator=gen, device=device).to(dtype) for _ in range(2))

    probe = operands(512)
    _time_matmul(*probe, device)
    probe_rate = 2 * 512**3 / min(_time_matmul(*probe, device) for _ in range(3))
    while n > 512 and 2 * n**3 / probe_rate > max_s:
        n //= 2
    a, b = operands(n)
    _time_matmul(a, b, device)
    best = min(_time_matmul(a, b, device) for _ in range(reps))
    return 2 * n**3 / best, n


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, reps: int = 5) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once), the best of `reps`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


@dataclass(frozen=True)
class PhaseRow:
    phase: str
    seconds: float
    flops: int

    @property
    def flop_per_s(self) -> float:
        return self.flops / self.seconds if self.seconds > 0 else 0.0

    def percent_of(self, peak: float) -> float:
        return 100.0 * self.flop_per_s / peak if peak > 0 else 0.0


def phase_rows(seconds: dict[str, float], flops: dict[str, int]) -> list[PhaseRow]:
    """One row per phase (in `seconds`' order) and a total."""
    rows = [PhaseRow(p.removeprefix("time/"), seconds[p], flops.get(p, 0)) for p in seconds]
    rows.append(PhaseRow("total", sum(r.seconds for r in rows), sum(r.flops for r in rows)))
    return rows


def format_table(rows: list[PhaseRow], peak_fp32: float, peak_bf16: float) -> str:
    lines = [
        f"{'phase':<11} {'seconds':>8} {'GFLOP':>9} {'GFLOP/s':>9} {'% fp32 peak':>12} {'% bf16 peak':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r.phase:<11} {r.seconds:>8.4f} {r.flops / 1e9:>9.3f} {r.flop_per_s / 1e9:>9.2f} "
            f"{r.percent_of(peak_fp32):>11.1f}% {r.percent_of(peak_bf16):>11.1f}%"
        )
    return "\n".join(lines)


def weights_read_per_step(model: nn.Module) -> int:
    """Parameters one decoding step reads in full: all but the embedding tables it only gathers rows from (an
    embedding tied to the LM head is read in full by the head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = getattr(head, "weight", None)
    gathered = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not head_weight
    )
    return sum(p.numel() for p in model.parameters()) - gathered


@dataclass(frozen=True)
class GenerationTraffic:
    """Bytes read from memory by the `response_len` forward calls of KV-cached sampling of a batch: the first (the
    prefill of the prompts) and each later one read every weight once; the later ones also read the cache of the
    `prompt_len + i` positions so far (keys and values, every layer) for every row."""

    weight_bytes: int  # per forward call
    kv_bytes: int  # summed over the calls
    calls: int
    tokens: int  # generated tokens (batch x response_len)

    @property
    def total_bytes(self) -> int:
        return self.calls * self.weight_bytes + self.kv_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.total_bytes / self.tokens


def generation_traffic(
    weight_params: int,
    n_layer: int,
    n_kv_head: int,
    head_dim: int,
    batch: int,
    prompt_len: int,
    response_len: int,
    elem_bytes: int,
) -> GenerationTraffic:
    kv_per_position = 2 * n_layer * n_kv_head * head_dim * elem_bytes  # keys and values of one row's position
    positions = sum(prompt_len + i for i in range(1, response_len))  # call i reads p + i positions (its own too)
    return GenerationTraffic(
        weight_bytes=weight_params * elem_bytes,
        kv_bytes=batch * kv_per_position * positions,
        calls=response_len,
        tokens=batch * response_len,
    )


def format_traffic(t: GenerationTraffic, seconds: float, bandwidth: float) -> str:
    achieved = t.total_bytes / seconds if seconds > 0 else 0.0
    return (
        f"generation memory traffic: {t.weight_bytes / 1e6:.1f} MB of weights per forward call x {t.calls} calls + "
        f"{t.kv_bytes / 1e9:.3f} GB of KV cache = {t.bytes_per_token / 1e6:.3f} MB per generated token; "
        f"{achieved / 1e9:.1f} GB/s achieved, {100 * achieved / bandwidth:.1f}% of the measured "
        f"{bandwidth / 1e9:.0f} GB/s (device copy); bandwidth-bound minimum {t.total_bytes / bandwidth:.4f} s"
    )
