"""`rlhf bench`: PPO throughput on the fixed shapes of docs/benchmark.md, the limit report, and the peers.

    rlhf bench                           # the cpu shape, 2 CPU threads
    rlhf bench --shape cpu-long          # real vocabulary (32000), 128 sampled tokens
    rlhf bench --shape gpt2-124m         # GPU, bf16
    rlhf bench --shape llama-1b          # GPU, bf16, gradient checkpointing
    rlhf bench --peers --shape cpu-long  # TRL 0.19.1 and TRL 1.12.0 (each in its venv), then this project
    rlhf bench --estimator grpo --peers  # GRPO (4 samples a prompt) against TRL 1.12.0's GRPOTrainer

Prints per-update and median per-phase times, the peak memory, the limit report (per-phase FLOP/s against the
measured matmul peaks; generation's memory traffic on a GPU) and, last, `episodes/s: X`: the median over the
updates after the first. Every line of a figure names the dtype it ran in: this project's (`--dtype`, `auto` as the
pipeline resolves it) and each peer's (float32 and TRL's bf16 on a CPU with native bf16, the ratio to the faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from rlhf.models.cpu_bf16 import cpu_has_native_bf16
from rlhf.models.device import compute_dtype, configure_cpu, dtype_reason, resolve_device
from rlhf.rollout.static_decode import DECODE_MODES, resolve_decode

from .limit import (
    copy_bandwidth,
    format_table,
    format_traffic,
    generation_traffic,
    matmul_peak,
    phase_rows,
    weights_read_per_step,
)
from .shapes import SHAPES, cuda_refusal

ROOT = Path(__file__).resolve().parents[1]
PEER_SCRIPT = ROOT / "benchmarks" / "trl_peer.py"
# (label, virtual environment): `make bench PEER=1` creates them (docs/benchmark.md "Peers")
PEERS = (("TRL 0.19.1", ".bench-peer"), ("TRL 1.12.0", ".bench-peer-trl112"))
# the peers of each estimator of `--estimator`: TRL's PPOTrainer for gae, TRL 1.12.0's GRPOTrainer for grpo
ESTIMATOR_PEERS = {"gae": (PEERS, "ppo"), "grpo": (PEERS[1:], "grpo")}
MIN_UPDATES = 9  # the figure is the median of at least 8 updates after the first
# ppo.advantage_estimator values the bench runs (`--estimator`; also `benchmarks.paired_bench`'s settings)
ESTIMATORS = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
DECODES = ("auto", *DECODE_MODES)  # ppo.generation.decode


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def peer_dtypes(device: torch.device) -> tuple[str, ...]:
    """The dtypes each TRL peer runs in, so that its figure is its fastest on the machine at hand
    (docs/benchmark.md): float32 and TRL's bf16 on a CPU that multiplies bf16 natively (AVX-512 BF16 or AMX), float32
    on other CPUs (bf16 is emulated there, slower), bf16 on a GPU (TRL's default there)."""
    if device.type == "cuda":
        return ("bfloat16",)
    return ("float32", "bfloat16") if cpu_has_native_bf16() else ("float32",)


def run_peer(
    label: str,
    venv: str,
    shape: str,
    updates: int,
    threads: int | None,
    estimator: str = "ppo",
    dtype: str = "float32",
) -> float | None:
    """Runs benchmarks/trl_peer.py in `venv` in `dtype` (TRL's bf16=True for bfloat16), echoing (and logging to
    `<venv>.log`, `<venv>.bfloat16.log` in bf16) its output, each line labelled with the peer and its dtype; its
    episodes/s."""
    python = ROOT / venv / "bin" / "python"
    tag = f"[{label}, {dtype}]"
    if not python.exists():
        print(f"{tag} no {python}: `make bench PEER=1` creates it", flush=True)
        return None
    cmd = [str(python), str(PEER_SCRIPT), "--shape", shape, "--updates", str(updates), "--estimator", estimator]
    cmd += ["--bf16" if dtype == "bfloat16" else "--no-bf16"]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    figure = None
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its lines as they come
    log_name = f"{venv}.log" if dtype == "float32" else f"{venv}.{dtype}.log"
    with (
        open(ROOT / log_name, "w") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env) as proc,
    ):
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if line.startswith(("update ", "episodes/s", "peer")):
                print(f"{tag} {line.rstrip()}", flush=True)
            if line.startswith("episodes/s: "):
                figure = float(line.split(":", 1)[1])
    if proc.returncode != 0:
        print(f"{tag} failed (exit {proc.returncode}); its output is in {log_name}", flush=True)
        return None
    return figure


def limit_report(bench, summary: dict[str, float]) -> None:
    """The FLOPs of one extra, untimed update against the matmul peaks; on a GPU, generation's memory traffic."""
    from .ppo_bench import PHASES

    device, shape = bench.device, bench.shape
    flops = bench.count_phase_flops()
    (peak32, n32), (peak16, n16) = matmul_peak(torch.float32, device), matmul_peak(torch.bfloat16, device)
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"limit (FLOPs of one untimed update, FlopCounterMode; matmul peaks on {where}): "
        f"fp32 {peak32 / 1e9:.1f} GFLOP/s ({n32}x{n32}), bf16 {peak16 / 1e9:.1f} GFLOP/s ({n16}x{n16})"
    )
    rows = phase_rows({p: summary[p] for p in PHASES}, flops)
    print("\n".join("  " + line for line in format_table(rows, peak32, peak16).splitlines()))
    if device.type == "cuda":
        policy = bench.models.policy
        elem = bench.dtype.itemsize if bench.dtype in (torch.bfloat16, torch.float16) else 4
        traffic = generation_traffic(
            weights_read_per_step(policy),
            shape.n_layer,
            shape.n_kv_head or shape.n_head,
            shape.n_embd // shape.n_head,
            shape.batch_size,
            shape.prompt_len,
            shape.response_len,
            elem,
        )
        print("  " + format_traffic(traffic, summary["time/generate"], copy_bandwidth(device)))
        tokens_per_s = shape.batch_size * shape.response_len / summary["time/generate"]
        print(f"  generated tokens/s: {tokens_per_s:.0f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="cpu")
    parser.add_argument(
        "--updates", type=int, default=10, help=f"timed updates (the first is excluded; >= {MIN_UPDATES})"
    )
    parser.add_argument("--device", default=None, help="default: the shape's (cpu shapes: cpu; GPU shapes: cuda)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the shape's, 2)")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: the pipeline's runtime.dtype auto on this machine (bfloat16 on a GPU; on a CPU bfloat16 where it "
        "multiplies bf16 natively and the measured check passes, else float32: docs/models.md); float32 and bfloat16 "
        "force one",
    )
    parser.add_argument(
        "--estimator",
        choices=ESTIMATORS,
        default="gae",
        help="ppo.advantage_estimator; the critic-free ones sample 4 responses a prompt (docs/benchmark.md)",
    )
    parser.add_argument(
        "--decode",
        choices=DECODES,
        default="auto",
        help="ppo.generation.decode: auto is compiled (a static KV cache, CUDA graphs) on CUDA, dynamic on a CPU",
    )
    parser.add_argument(
        "--compile-training",
        action="store_true",
        help="runtime.compile_training: the policy's and value model's training forwards under torch.compile (the "
        "first update pays the compile)",
    )
    parser.add_argument("--no-limit", action="store_true", help="skip the limit report (FLOPs, matmul peaks)")
    parser.add_argument("--peers", action="store_true", help="run the TRL peers first, each in its own venv")
    parser.add_argument("--rounds", type=int, default=1, help="with --peers: alternate peers and this project")
    return parser.parse_args(argv)


def print_peer_ratios(
    peers,
    dtypes: tuple[str, ...],
    peer_figures: dict[tuple[str, str], list[float]],
    figure: float,
    ours: str,
    rounds: int,
) -> None:
    """Each peer's figure in each of its dtypes, this project's ratio to each, and the ratio to the best peer in its
    fastest dtype (docs/benchmark.md); `ours`: this project's dtype."""
    medians = {key: statistics.median(v) for key, v in peer_figures.items() if v}
    for label, _ in peers:
        for dtype in dtypes:
            key = (label, dtype)
            shown = f"{medians[key]:.2f}" if key in medians else "failed"
            ratio = f"; this project ({ours}) / it: {figure / medians[key]:.2f}x" if key in medians else ""
            print(f"peer {label} ({dtype}) episodes/s: {shown}{ratio}")
    if medians:
        best = max(medians, key=medians.get)
        print(
            f"ratio to the best peer ({best[0]}, {best[1]}: its fastest dtype here) of this project ({ours}): "
            f"{figure / medians[best]:.2f}x ({rounds} round(s), side by side)"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    if (args.device or shape.device).startswith("cuda") and not torch.cuda.is_available():
        print(cuda_refusal(args.shape), file=sys.stderr)
        return 2
    from .ppo_bench import PHASES, Bench, run_bench  # heavy: transformers (after the cheap refusals above)

    threads = args.threads or shape.threads
    configure_cpu(threads)  # torch's threads and the allocator, as every pipeline stage sets them
    device = resolve_device(args.device or shape.device)
    # 'auto': what the pipeline's runtime.dtype auto runs on this machine for a model of the shape's width
    dtype = compute_dtype(args.dtype, device, width=shape.n_embd)
    ours = dtype_name(dtype)
    print(
        f"PPO bench: shape={args.shape} {shape} estimator={args.estimator} device={device} "
        f"threads={torch.get_num_threads()} dtype={ours} decode={resolve_decode(args.decode, device)}"
        + (" compile_training=on" if args.compile_training else "")
    )
    reason = dtype_reason(args.dtype, device, width=shape.n_embd)
    print(f"dtype {ours}: {reason.replace('runtime.dtype', '--dtype', 1)}")
    if args.updates < MIN_UPDATES:
        print(f"note: {args.updates} updates: fewer than {MIN_UPDATES}, not a benchmark figure")
    peers, peer_estimator = ESTIMATOR_PEERS.get(args.estimator, ((), ""))
    if args.peers and not peers:
        print(f"note: no peer runs --estimator {args.estimator} (peers: gae, grpo); this project alone")
    peers = peers if args.peers else ()
    dtypes = peer_dtypes(device)
    peer_figures: dict[tuple[str, str], list[float]] = {(label, d): [] for label, _ in peers for d in dtypes}
    figures: list[float] = []
    rounds = max(1, args.rounds if peers else 1)
    for round_ in range(rounds):
        for (label, venv), peer_dtype in ((peer, d) for peer in peers for d in dtypes):
            figure = run_peer(label, venv, args.shape, args.updates, args.threads, peer_estimator, peer_dtype)
            if figure is not None:
                peer_figures[(label, peer_dtype)].append(figure)
        torch.set_num_threads(threads)
        if rounds > 1:
            print(f"this project ({ours}), round {round_ + 1}/{rounds}:")
        bench = Bench(
            shape, device, dtype, args.updates, estimator=args.estimator, decode=args.decode,
            compile_training=args.compile_training,
        )  # fmt: skip
        summary = run_bench(bench)
        figures.append(summary["episodes/s"])
    print(f"median per update (updates after the first), {ours}:")
    for key in (*PHASES, "time/total"):
        print(f"  {key:<18} {summary[key]:.4f} s")
    print(f"  peak memory        {summary['memory/peak_mb']:.0f} MiB ({'GPU' if device.type == 'cuda' else 'RSS'})")
    if not args.no_limit:
        limit_report(bench, summary)
    figure = statistics.median(figures)
    if peers:
        print_peer_ratios(peers, dtypes, peer_figures, figure, ours, rounds)
    print(f"this project ({ours}) episodes/s: {figure:.2f}")
    print(f"episodes/s: {figure:.2f}")  # the last line: the figure alone (in the dtype the lines above name)
    return 0
