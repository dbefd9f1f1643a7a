"""`make gpu-check` (``python -m benchmarks.gpu_check --out DIR``): every GPU figure of docs/benchmark.md from one
command on a machine with one CUDA GPU, in 10 minutes or less, written as one table (DIR/gpu_check.md and
DIR/gpu_check.json).

Needs torch with CUDA and transformers; the PPO rows need the library's light dependencies (pydantic, PyYAML,
safetensors), the LoRA row peft, the pipeline rows Prefect, MLflow, pandas and pyarrow. What is not installed is
taken from ``.gpu-deps/`` of the checkout (``make gpu-deps`` fills it, within the 64 MiB a device run carries);
a row whose needs are missing is skipped with the reason. TRL's peers run only where ``trl`` imports (the peer
columns are empty, with the reason, elsewhere).

Every row is time-boxed: a row whose estimate exceeds what is left of ``--budget-s`` is skipped and says so.
``--dry-run`` runs the same rows on the CPU bench shapes (a few seconds; tests/test_bench.py runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_report import NEEDS, ROOT, Row, environment, missing, write_table

REAL_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Plan:
    """What the rows run: the shapes (the GPU shapes, or tiny CPU ones in a dry run), updates and decode modes."""

    device: torch.device
    dtype: torch.dtype
    shapes: dict[str, Any]  # the rows' names of the shapes ("gpt2-124m", "llama-1b", "smollm2") -> BenchShape
    updates: int
    large_updates: int
    decode_modes: tuple[str, ...]
    dry_run: bool


def make_plan(dry_run: bool) -> Plan:
    from .shapes import SHAPES, BenchShape

    if dry_run:  # tiny shapes of the same architectures, so that the test of the command takes seconds
        gpt2 = BenchShape("gpt2", 2, 2, 64, 1000, batch_size=16, prompt_len=8, response_len=8)
        llama = BenchShape("llama", 2, 4, 64, 1000, 16, 8, 8, n_kv_head=2, intermediate_size=128)
        shapes = {"gpt2-124m": gpt2, "llama-1b": llama, "smollm2": replace(llama, batch_size=8)}
        return Plan(torch.device("cpu"), torch.float32, shapes, 2, 2, ("dynamic", "static"), True)
    smollm2 = replace(SHAPES["cpu-llama"], n_layer=30, device="cuda")  # SmolLM2-135M's 30 layers
    shapes = {"gpt2-124m": SHAPES["gpt2-124m"], "llama-1b": SHAPES["llama-1b"], "smollm2": smollm2}
    return Plan(torch.device("cuda"), torch.bfloat16, shapes, 10, 5, ("dynamic", "compiled"), False)


# ---------------------------------------------------------------------------------------------------------- rows


def card_row(plan: Plan, results: dict) -> Row:
    from .limit import copy_bandwidth, matmul_peak

    dev = plan.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    peak16, n16 = matmul_peak(torch.bfloat16, dev, n=4096 if dev.type == "cuda" else 256)
    figures = {"device": name, "bf16 matmul TFLOP/s": peak16 / 1e12, "matmul n": n16}
    if dev.type == "cuda":
        figures["copy GB/s"] = copy_bandwidth(dev) / 1e9
        figures["memory GiB"] = torch.cuda.get_device_properties(dev).total_memory / 2**30
    results["card"] = figures | {"peak16": peak16}
    return Row("card", figures=figures)


def decode_row(plan: Plan, results: dict) -> Row:
    """Generated tokens/s of gpt2-124m's policy in each decode mode, and the share of bandwidth."""
    from rlhf.rollout.generation import GenerationSettings
    from rlhf.rollout.static_decode import COMPILE_LOG

    from .decode_bench import policy_model, time_decode
    from .limit import copy_bandwidth, generation_traffic, weights_read_per_step

    shape = plan.shapes["gpt2-124m"]
    model = policy_model(shape, plan.device, plan.dtype)
    settings = GenerationSettings(shape.response_len, temperature=1.0, stop_token_ids=(), pad_token_id=0)
    figures: dict[str, Any] = {}
    failures = len(COMPILE_LOG.failures)
    for mode in plan.decode_modes:
        before = COMPILE_LOG.seconds
        tps = [time_decode(model, shape, replace(settings, decode=mode), plan.dtype, shape.batch_size, 2)]
        tps.append(time_decode(model, shape, replace(settings, decode=mode), plan.dtype, shape.batch_size, 2))
        figures[f"{mode} tokens/s"] = statistics.median(tps)
        if COMPILE_LOG.seconds > before:
            figures[f"{mode} compile s"] = COMPILE_LOG.seconds - before
    best = max(figures[f"{m} tokens/s"] for m in plan.decode_modes)
    if plan.device.type == "cuda":
        elem = 2
        traffic = generation_traffic(
            weights_read_per_step(model), shape.n_layer, shape.n_kv_head or shape.n_head, shape.n_embd // shape.n_head,
            shape.batch_size, shape.prompt_len, shape.response_len, elem,
        )  # fmt: skip
        seconds = shape.batch_size * shape.response_len / best
        bandwidth = results.get("card", {}).get("copy GB/s", copy_bandwidth(plan.device) / 1e9) * 1e9
        figures["bandwidth share %"] = 100 * traffic.total_bytes / seconds / bandwidth
        figures["ms/token"] = 1000 * seconds / shape.response_len
    failed = COMPILE_LOG.failures[failures:]
    note = f"torch.compile failed, decoded uncompiled: {failed[0]}" if failed else ""
    return Row(f"decode gpt2-124m (batch {shape.batch_size}, {shape.response_len} tokens)", figures=figures, note=note)


def _trl_peer(shape: str, estimator: str, updates: int) -> str:
    """TRL's figure on the same shape where trl imports here, else why the column is empty."""
    if importlib.util.find_spec("trl") is None:
        return "TRL not installed here"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trl_peer.py"), "--shape", shape, "--updates", str(updates)]
    out = subprocess.run(cmd + ["--estimator", estimator], capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("episodes/s: ")]
    return lines[-1].split(":", 1)[1].strip() + " episodes/s" if lines else f"failed (exit {out.returncode})"


def bench_row(plan: Plan, results: dict, shape_name: str, estimator: str, updates: int, flops: bool) -> Row:
    """Episodes/s of the bench shape (this project), per-phase times, peak memory; with `flops` the MFU of the
    optimisation against the measured bf16 peak."""
    from rlhf.memory import reset_peak_memory
    from rlhf.rollout.static_decode import COMPILE_LOG

    from .ppo_bench import Bench, run_bench

    shape = plan.shapes[shape_name]
    reset_peak_memory(plan.device)
    bench = Bench(shape, plan.device, plan.dtype, updates, estimator=estimator)  # decode auto: compiled on CUDA
    decode = bench.settings.decode
    summary = run_bench(bench, log=lambda line: print("  " + line, flush=True))
    figures = {
        "episodes/s": summary["episodes/s"],
        "generate s": summary["time/generate"],
        "optimize s": summary["time/optimize"],
        "peak MiB": summary["memory/peak_mb"],
        "generated tokens/s": shape.batch_size * shape.response_len / summary["time/generate"],
    }
    if flops:
        opt = bench.count_phase_flops()["time/optimize"]
        figures["optimize TFLOP/s"] = opt / summary["time/optimize"] / 1e12
        peak = results.get("card", {}).get("peak16")
        if peak:
            figures["MFU % (measured bf16 peak)"] = 100 * opt / summary["time/optimize"] / peak
    results.setdefault("peaks", {})[(shape_name, estimator)] = summary["memory/peak_mb"]
    peer = "" if plan.dry_run else _trl_peer(shape_name, "ppo" if estimator == "gae" else estimator, updates)
    ratio = ""
    if peer.endswith("episodes/s"):
        ratio = f"ratio {summary['episodes/s'] / float(peer.split()[0]):.2f}x"
    decode += " (torch.compile failed: uncompiled)" if COMPILE_LOG.failures else ""
    note = f"median of updates 2-{updates}, decode {decode}" + (f"; {ratio}" if ratio else "")
    return Row(f"{shape_name} {estimator}", figures=figures, peer=peer, note=note)


def first_update_row(plan: Plan, results: dict, lora: bool) -> Row:
    """The first update's KL (policy against reference on the first rollout) and probability ratios (the first
    minibatch, before any optimizer step) under bf16, as the trainer runs them (the first epoch's order drawn before
    sampling), with the pipeline's reference (`match_autocast`, the bench's; LoRA: the policy with its adapters
    off): both should be exactly 0 and 1."""
    from rlhf.config import LoraConfig
    from rlhf.models.training import apply_lora
    from rlhf.ppo.optimise import optimize
    from rlhf.ppo.prompts import PromptBatch
    from rlhf.ppo.state import fresh_state
    from rlhf.ppo.update import compute_advantages, first_epoch_order, generate_and_score, refresh_kl

    from .ppo_bench import Bench

    shape = plan.shapes["smollm2"]
    dtype = torch.bfloat16
    bench = Bench(shape, plan.device, dtype, 2, decode="dynamic")  # the same tokens; no compile warm-up to pay
    if lora:
        models = bench.models
        models.policy = apply_lora(models.policy, LoraConfig(enabled=True))
        models.reference = None  # the policy with its adapters off, as the trainer does with LoRA
        bench.state = fresh_state(models, bench.cfg, bench.seed, plan.device)
    query, mask = bench.query()
    batch, execution = PromptBatch(query, mask, list(range(len(query)))), bench.plan()
    order = first_epoch_order(bench.cfg, bench.state.shuffle_generator, len(query))
    rollout = generate_and_score(
        bench.models, batch, None, bench.cfg, bench.settings, bench.state.sample_generator, execution, order
    )
    compute_advantages(rollout, bench.cfg, bench.state.kl_ctl.value)
    result = optimize(bench.models, bench.state, rollout, bench.cfg, execution)
    refresh_kl(rollout, bench.cfg)
    scored = rollout.scored
    kl = (scored.logprobs - scored.ref_logprobs)[scored.resp.mask.bool()]
    first = result.minibatch_stats[0]
    figures = {
        "KL mean": float(kl.mean()),
        "KL max |.|": float(kl.abs().max()),
        "ratio mean (minibatch 1)": first["policy/ratio_mean"],
        "ratio var (minibatch 1)": first.get("policy/ratio_var", float("nan")),
        "approxkl (minibatch 1)": first.get("policy/approxkl", float("nan")),
    }
    real = REAL_GGUF.is_file()
    what = "SmolLM2-135M architecture, random init" if not real or plan.dry_run else "SmolLM2-135M"
    why = "" if real else f" ({REAL_GGUF.name}, 94 MiB, is over the 64 MiB a device run carries)"
    return Row(f"first update bf16, {'LoRA' if lora else 'full fine-tuning'}", figures=figures, note=what + why)


def memory_row(plan: Plan, results: dict) -> Row:
    """`rlhf memory`'s PPO-stage estimate against the peak the bench rows measured, for each of their configs."""
    from rlhf.config import load_config
    from rlhf.memory import GIB, estimate, shape_of

    from .shapes import model_config

    figures = {}
    for (shape_name, estimator), peak_mb in results.get("peaks", {}).items():
        shape = plan.shapes[shape_name]
        group = 1 if estimator == "gae" else 4
        overrides = [
            f"runtime.dtype={'bfloat16' if plan.device.type == 'cuda' else 'float32'}",
            f"runtime.device={plan.device.type}",
            f"ppo.advantage_estimator={estimator}",
            f"ppo.samples_per_prompt={group}",
            f"ppo.batch_size={shape.batch_size}",
            f"ppo.num_mini_batches={shape.num_mini_batches}",
            f"ppo.max_new_tokens={shape.response_len}",
            f"ppo.max_prompt_tokens={shape.prompt_len}",
            f"ppo.gradient_checkpointing={str(shape.gradient_checkpointing).lower()}",
            "ppo.eval_every=0",
        ]
        config = load_config(str(ROOT / "conf" / "default.yaml"), overrides)
        est = next(e for e in estimate(config, shape_of(model_config(shape)), plan.device.type) if e.stage == "ppo")
        figures[f"{shape_name} {estimator}: estimate/measured GiB"] = (
            f"{est.total / GIB:.2f}/{peak_mb / 1024:.2f} ({est.total / GIB / (peak_mb / 1024):.2f}x)"
        )
    if not figures:
        return Row("memory estimate against the peak", "skipped", note="no bench row ran")
    return Row("memory estimate against the peak", figures=figures, note="the PPO stage's estimate, rlhf memory")


def pipeline_row(plan: Plan, results: dict, config: str, budget: float) -> Row:
    """The pipeline (`rlhf run`) in a fresh process, output and tracking in a temp folder; wall time and the
    summary it prints."""
    name = "make run-real" if "real" in config else "make run (default pipeline)"
    if "real" in config and not REAL_GGUF.is_file():
        return Row(name, "skipped", note=f"no {REAL_GGUF.name} (94 MiB: over the 64 MiB a device run carries)")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        env = {**os.environ, "PREFECT_HOME": f"{tmp}/prefect", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env |= {"DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path[1:]])
        cmd = [sys.executable, "-m", "flows.cli", "run", "--config", config, "runtime.progress=false"]
        cmd += [f"runtime.output_dir={tmp}/out", f"tracking.uri=sqlite:///{tmp}/mlflow.db"]
        cmd += [f"tracking.artifact_location={tmp}/art"]
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=budget)
        except subprocess.TimeoutExpired:
            return Row(name, "failed", note=f"not finished within the {budget:.0f} s left", seconds=budget)
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [""]
        return Row(name, "failed", note=f"exit {out.returncode}: {tail[0][:200]}")
    summary = [line.strip() for line in out.stdout.splitlines() if ":" in line][-8:]
    return Row(name, figures={"wall s": wall}, note="; ".join(summary))


# ---------------------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Check:
    name: str
    needs: str  # a key of NEEDS, or "" (torch and transformers only)
    estimate_s: float  # on an H100, compile warm-ups included (a guess until measured); skipped past the time left
    run: Callable[[Plan, dict, float], Row]
    gpu_only: bool = False


def checks(plan: Plan) -> list[Check]:
    u, lu = plan.updates, plan.large_updates
    return [
        Check("card", "", 20, lambda p, r, b: card_row(p, r)),
        Check("decode", "ppo", 90, lambda p, r, b: decode_row(p, r)),
        Check("gpt2-124m gae", "ppo", 100, lambda p, r, b: bench_row(p, r, "gpt2-124m", "gae", u, True)),
        Check("gpt2-124m grpo", "ppo", 60, lambda p, r, b: bench_row(p, r, "gpt2-124m", "grpo", u, False)),
        Check("llama-1b gae", "ppo", 150, lambda p, r, b: bench_row(p, r, "llama-1b", "gae", lu, True)),
        Check("first update bf16 full", "ppo", 30, lambda p, r, b: first_update_row(p, r, lora=False)),
        Check("first update bf16 LoRA", "lora", 30, lambda p, r, b: first_update_row(p, r, lora=True)),
        Check("memory", "ppo", 5, lambda p, r, b: memory_row(p, r)),
        Check("pipeline", "pipeline", 150, lambda p, r, b: pipeline_row(p, r, "conf/default.yaml", b), True),
        Check("run-real", "real", 240, lambda p, r, b: pipeline_row(p, r, "conf/real.yaml", b), True),
    ]


def run_checks(
    plan: Plan, budget_s: float, only: set[str] | None, on_row: Callable[[list[Row]], None] | None = None
) -> list[Row]:
    """The rows in order, each time-boxed; `on_row(rows so far)` after each (the table is rewritten, so a run cut
    off by the machine's time limit still leaves the rows it finished)."""
    start, results, rows = time.perf_counter(), {}, []
    for check in checks(plan):
        if only and check.name not in only:
            continue
        left = budget_s - (time.perf_counter() - start)
        lacking = missing(NEEDS.get(check.needs, ()))
        if plan.dry_run and check.gpu_only:
            rows.append(Row(check.name, "skipped", note="dry run: the pipeline rows run on the GPU machine only"))
        elif lacking:
            rows.append(Row(check.name, "skipped", note=f"needs {', '.join(lacking)} (make gpu-deps, or install)"))
        elif check.estimate_s > left:
            rows.append(
                Row(check.name, "skipped", note=f"needs ~{check.estimate_s:.0f} s, {left:.0f} s of the budget left")
            )
        else:
            print(f"[gpu-check] {check.name} ({left:.0f} s left)", flush=True)
            t0 = time.perf_counter()
            try:
                row = check.run(plan, results, left)
            except Exception as err:  # a failed row is reported and the others still run
                row = Row(check.name, "failed", note=f"{type(err).__name__}: {str(err)[:300]}")
            row.seconds = time.perf_counter() - t0
            row.note = f"dry run, tiny shape; {row.note}" if plan.dry_run else row.note
            rows.append(row)
        print(f"[gpu-check] {rows[-1].check}: {rows[-1].status} {rows[-1].cells()[2]} {rows[-1].note}", flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "outputs/gpu-check", help="folder of the table")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds for all rows (rows past it are skipped)")
    parser.add_argument(
        "--dry-run", action="store_true", help="the CPU bench shapes, a few seconds: a test of the command"
    )
    parser.add_argument("--rows", default="", help="comma-separated check names (default: all)")
    args = parser.parse_args(argv)
    env = environment()
    print(f"[gpu-check] {json.dumps(env)}", flush=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU and this machine has none (--dry-run runs the CPU shapes)", file=sys.stderr)
        write_table(Path(args.out), env, [Row("card", "skipped", note="no CUDA device")])
        return 2
    from rlhf.models.device import configure_cpu

    configure_cpu(2 if args.dry_run else None)
    plan = make_plan(args.dry_run)
    only = set(filter(None, args.rows.split(","))) or None
    rows = run_checks(plan, args.budget_s, only, on_row=lambda done: write_table(Path(args.out), env, done))
    write_table(Path(args.out), env, rows)
    print((Path(args.out) / "gpu_check.md").read_text())
    return 0 if all(r.status != "failed" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
