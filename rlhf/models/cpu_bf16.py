"""Whether bf16 autocast pays on this CPU: `runtime.dtype: auto`'s choice on a CPU (`rlhf.models.device.compute_dtype`).

Three conditions, all required (docs/models.md "Precision"); the first two are the machine's:
1. the CPU multiplies bf16 natively: its flags (Linux's /proc/cpuinfo) name AVX-512 BF16 or AMX-BF16. Elsewhere torch
   emulates bf16 matmuls, slower than float32 ones, and nothing is measured;
2. a measured check passes: forward and backward of a linear layer of a small model's size (`CHECK_SHAPE`), with
   float32 master weights, as the trained models run, is at least `MIN_SPEEDUP` times faster under bf16 autocast than
   in float32, and a bf16-autocast matmul over a long inner dimension stays within `MAX_ERROR` of float64 (float32
   accumulation, as oneDNN's bf16 kernels do; a kernel that accumulated in bf16 would be off by several percent).

3. the model is at least `NARROWEST_BF16` wide (its hidden size). Narrower models spend their time in small kernels
   that autocast's casts slow down. A whole PPO update (GPT-2, 32 prompts, 24 + 24 tokens, 2 threads, a Xeon with AMX)
   ran under bf16 autocast at 0.77x float32's episodes/s at width 32, 0.87x at 64, 1.12x at 128 and 1.34x at 256.
   The run's width is `RuntimeConfig.model_width` (the embedded model's, or a local checkpoint's config.json); where
   it is unknown (a hub id) the model is taken to be wide, as every released checkpoint is.

The verdict is measured once per machine and torch version (about a second) and kept in `cache_file()`:
`$XDG_CACHE_HOME/rlhf-pipeline/cpu_bf16.json` (`~/.cache/...` by default), one entry per CPU model and torch
version; delete the file to measure again. `runtime.dtype: float32` or `bfloat16` skips all of this.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# the /proc/cpuinfo flags of CPUs whose bf16 dot products are native instructions
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# (tokens, in, out) of the timed linear layer: a micro-batch of a small model's tokens through an MLP projection,
# between the embedded default's (hidden 128, MLP 512) and SmolLM2-135M's (576, 1536)
CHECK_SHAPE = (1024, 256, 1024)
MIN_SPEEDUP = 1.2  # bf16 autocast at least this much faster than float32 (AMX: 3-6x; emulated bf16: below 1)
NARROWEST_BF16 = 128  # the narrowest model (hidden size) `auto` runs in bf16 on a CPU
# relative (Frobenius) error of a bf16-autocast matmul with a 4096-long inner dimension against float64: the inputs'
# and the output's bf16 rounding give about 3e-3 with float32 accumulation, several 1e-2 with bf16 accumulation
MAX_ERROR = 1e-2
_ERROR_SHAPE = (64, 4096, 256)  # (rows, inner, out) of the numerics check
_ROUNDS = 9  # timed rounds of each dtype, alternating; the fastest of each counts (robust to other jobs' load)


@dataclass(frozen=True)
class CpuBf16Check:
    """What decides `runtime.dtype: auto` on a CPU: the CPU's native bf16 flags and, where it has them, the measured
    speed-up of bf16 autocast over float32 and the error of a bf16-autocast matmul."""

    native: bool  # the CPU's flags name AVX-512 BF16 or AMX-BF16
    speedup: float | None = None  # float32 time / bf16-autocast time (CHECK_SHAPE); None: not measured
    error: float | None = None  # relative error against float64 (_ERROR_SHAPE); None: not measured

    @property
    def passed(self) -> bool:
        """bf16 autocast pays and its numerics hold: `auto` is bf16."""
        return (
            self.native
            and self.speedup is not None
            and self.speedup >= MIN_SPEEDUP
            and self.error is not None
            and self.error <= MAX_ERROR
        )

    def reason(self) -> str:
        """Why `auto` is what it is on this CPU, in a few words (the summary's header, the run's log)."""
        if not self.native:
            return "no native bf16 on this CPU (no AVX-512 BF16 or AMX)"
        measured = f"bf16 autocast measured {self.speedup:.2f}x float32, error {self.error:.1e}"
        if self.passed:
            return f"native bf16, {measured}"
        return f"native bf16, but {measured} (needs >= {MIN_SPEEDUP}x and <= {MAX_ERROR:.0e})"


def cpu_flags() -> frozenset[str]:
    """The CPU's flags from Linux's /proc/cpuinfo; empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(word for line in f if line.startswith("flags") for word in line.split(":", 1)[1].split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU of `flags` (None: this one's) multiplies bf16 natively (AVX-512 BF16 or AMX-BF16): there bf16
    matmuls can be faster than float32 ones; elsewhere they are emulated and slower."""
    return bool((cpu_flags() if flags is None else flags) & BF16_FLAGS)


def _timed_step(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, bf16: bool) -> float:
    """Seconds of one forward and backward of `x @ w.T`, float32 master weights, under bf16 autocast or not."""
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        y = F.linear(x, w)
    y.backward(grad.to(y.dtype))
    elapsed = time.perf_counter() - start
    x.grad = w.grad = None
    return elapsed


def measure_speedup(shape: tuple[int, int, int] = CHECK_SHAPE, rounds: int = _ROUNDS) -> float:
    """float32 time over bf16-autocast time of a linear layer's forward and backward on one torch thread (what
    one core gains; the fastest of `rounds` alternating rounds of each, after a warm-up)."""
    tokens, inner, out = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, inner, generator=gen).requires_grad_()
    w = (torch.randn(out, inner, generator=gen) / inner**0.5).requires_grad_()
    grad = torch.randn(tokens, out, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for bf16 in (False, True):  # warm-up: oneDNN builds its kernels for the shape on first use
            _timed_step(x, w, grad, bf16)
        best = {False: float("inf"), True: float("inf")}
        for _ in range(rounds):
            for bf16 in (False, True):
                best[bf16] = min(best[bf16], _timed_step(x, w, grad, bf16))
    finally:
        torch.set_num_threads(before)
    return best[False] / best[True]


def measure_error(shape: tuple[int, int, int] = _ERROR_SHAPE) -> float:
    """Relative (Frobenius) error of a bf16-autocast matmul against float64 (inf where it is not finite)."""
    rows, inner, out = shape
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(rows, inner, generator=gen), torch.randn(out, inner, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, w)
    exact = x.double() @ w.double().T
    error = float(torch.linalg.norm(y.double() - exact) / torch.linalg.norm(exact))
    return error if error == error and error != float("inf") else float("inf")


def check_cpu_bf16(flags: frozenset[str] | None = None) -> CpuBf16Check:
    """Measure what decides `auto` on the CPU of `flags` (None: this one's): nothing without native bf16 flags;
    else the speed-up and the error, measured on this machine (about a second)."""
    if not cpu_has_native_bf16(flags):
        return CpuBf16Check(native=False)
    return CpuBf16Check(native=True, speedup=measure_speedup(), error=measure_error())


def cache_file() -> Path:
    """Where the verdict is kept: $XDG_CACHE_HOME/rlhf-pipeline/cpu_bf16.json (~/.cache/... by default)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "rlhf-pipeline" / "cpu_bf16.json"


def machine_key() -> str:
    """The verdict's key: the CPU's model name, its native bf16 flags and torch's version (its kernels)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {' '.join(sorted(cpu_flags() & BF16_FLAGS)) or 'no native bf16'} | torch {torch.__version__}"


_VERDICTS: dict[Path, CpuBf16Check] = {}  # this process's verdicts, by cache file
_LOCK = threading.Lock()  # sweep variants ask from several threads: one measures, the others wait for its verdict


def cpu_bf16_check(path: Path | None = None) -> CpuBf16Check:
    """This machine's verdict: from this process's memory, else from the cache file `path` (None: `cache_file()`),
    else measured (`check_cpu_bf16`) and written there (atomically; a file that cannot be written is skipped: the
    verdict then holds for this process only)."""
    path = path or cache_file()
    with _LOCK:
        if path not in _VERDICTS:
            _VERDICTS[path] = _kept_or_measured(path)
        return _VERDICTS[path]


def _kept_or_measured(path: Path) -> CpuBf16Check:
    key, entries = machine_key(), {}
    try:
        entries = json.loads(path.read_text())
        kept = entries[key]
        verdict = CpuBf16Check(bool(kept["native"]), kept["speedup"], kept["error"])
    except (OSError, ValueError, KeyError, TypeError):
        verdict = check_cpu_bf16()
        entries = entries if isinstance(entries, dict) else {}
        entries[key] = asdict(verdict) | {"measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entries, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError:
            pass
    return verdict
