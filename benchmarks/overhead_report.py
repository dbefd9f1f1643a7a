"""The report of benchmarks/overhead_bench.py: the runs' times side by side (A: the Prefect flow with MLflow, B: the
library alone), A's own accounting, MLflow's share of the PPO training loop, and whether both variants gave the same
result figures. Used by the bench after its runs and by `--report` on runs saved with `--json`."""

from __future__ import annotations

import os
import statistics

# the stages' task names (rlhf/stages.py imports nothing of Prefect's, whose import time would count in B, the
# library-alone variant, which imports this module)
from rlhf.stages import stages_of

STAGES = tuple(stage.task for stage in stages_of())  # the default pipeline's

# result figures both variants must agree on (the first ones present are compared)
FIGURES = (
    "reward/best_eval_accuracy",
    "ppo/objective/scores",
    "ppo/objective/kl",
    "eval/kl",
    "eval/win_rate_rm",
    "eval/policy_score",
    "eval/sft_score",
    "eval/win_rate_gold",
)
TARGET_PIPELINE, TARGET_MLFLOW = 3.0, 2.0  # per cent


def median_range(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    text = fmt.format(statistics.median(values))
    return text if len(values) == 1 else f"{text} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def compare_figures(runs: dict[str, list[dict]]) -> tuple[bool, list[str]]:
    """Every result figure of every run against the first library run's (relative difference <= 1e-6)."""
    reference = runs["library"][0]["figures"]
    lines, same = [], True
    for key in FIGURES:
        if key not in reference:
            continue
        values = [run["figures"].get(key, float("nan")) for variant in runs.values() for run in variant]
        worst = max(abs(v - reference[key]) / max(abs(reference[key]), 1e-12) for v in values)
        same &= worst <= 1e-6
        lines.append(f"  {key:<28}{reference[key]:.6g}  (largest relative difference {worst:.1e})")
    return same, lines


def report(runs: dict[str, list[dict]], config: str) -> list[str]:
    prefect, library = runs["prefect"], runs["library"]

    def col(variant: list[dict], key: str) -> list[float]:
        return [run["times"][key] for run in variant if key in run["times"]]

    def row(label: str, key: str, b_key: str | None = None) -> str:
        a, b = col(prefect, key), col(library, b_key or key)
        over = ""
        if a and b:
            over = f"{(statistics.median(a) - statistics.median(b)) / statistics.median(b):+.1%}"
            over += f" ({statistics.median(a) - statistics.median(b):+.2f} s)"
        return f"{label:<34}{median_range(a):<24}{median_range(b):<24}{over}"

    for run in prefect + library:
        times = run["times"]
        startup = ("mlflow_store", "prefect_database", "prefect_server")
        times["startup"] = sum(times.get(k, 0.0) for k in startup)
        times["pipeline+startup"] = times["pipeline"] + times["startup"]
    for run in prefect:
        run["times"]["flow_own"] = run["times"]["pipeline"] - sum(run["times"][s] for s in STAGES)
    rounds = len(prefect)
    lines = [
        "",
        f"Orchestration overhead of {config}: {rounds} round(s) of A (Prefect flow + MLflow) and B (library alone),",
        f"alternating, each a fresh process with an empty output folder, MLflow store and PREFECT_HOME; "
        f"{os.cpu_count()} CPU cores",
        f"load average (1 min) around the runs: {median_range([r['load'] for r in prefect + library if 'load' in r])}",
        "median (min-max), seconds",
        f"{'':<34}{'A: Prefect + MLflow':<24}{'B: library alone':<24}overhead (A - B) / B",
    ]
    lines += [row(stage, stage) for stage in STAGES]
    lines.append(row("  its PPO training loop", "ppo_loop"))
    lines.append(f"{'flow itself (A: outside the stages)':<34}{median_range(col(prefect, 'flow_own')):<24}")
    lines.append(row("pipeline (all stages)", "pipeline"))
    lines.append(row("  + store, database, server start", "pipeline+startup"))
    lines.append(f"{'  MLflow store creation (A only)':<34}{median_range(col(prefect, 'mlflow_store')):<24}")
    lines.append(f"{'  Prefect database (A only)':<34}{median_range(col(prefect, 'prefect_database')):<24}")
    lines.append(f"{'  Prefect server start (A only)':<34}{median_range(col(prefect, 'prefect_server')):<24}")
    lines.append(row("imports", "imports"))
    lines.append(row("preflight", "preflight"))
    lines.append(row("whole process (spawn to exit)", "process"))
    lines += [
        "",
        "A's own accounting (the same runs): each stage's time less the library calls' time within it (the MLflow",
        "and Prefect calls of the library's log callbacks count as overhead), seconds",
    ]
    for stage in STAGES:
        own = [
            r["times"][stage] - r["seconds"].get(f"{stage}|library", 0.0) + r["seconds"].get(f"{stage}|in_library", 0.0)
            for r in prefect
        ]
        lines.append(f"  {stage:<32}{median_range(own)}")
    outside = [
        r["times"]["pipeline"]
        - sum(r["seconds"].get(f"{s}|library", 0.0) - r["seconds"].get(f"{s}|in_library", 0.0) for s in STAGES)
        for r in prefect
    ]
    lines.append(f"  {'whole pipeline':<32}{median_range(outside)}")
    for run, value in zip(prefect, outside, strict=True):
        run["times"]["outside_library"] = value
        run["times"]["library_alone"] = run["times"]["pipeline"] - value
    accounted = [100 * r["times"]["outside_library"] / r["times"]["library_alone"] for r in prefect]
    lines.append(f"  {'as a share of the library time':<32}{median_range(accounted)}%")
    updates = prefect[0]["updates"]
    shares = [100 * r["seconds"].get("ppo_loop|mlflow", 0.0) / r["times"]["ppo_loop"] for r in prefect]
    per_update = [1000 * r["seconds"].get("ppo_loop|mlflow", 0.0) / r["updates"] for r in prefect]
    # every metric write of the PPO stage, also the steps a batching logger still held when the loop ended
    writes = (
        "train_policy_ppo|mlflow.log_steps",
        "train_policy_ppo|mlflow.log_metrics",
        "train_policy_ppo|mlflow.end_run",
    )
    stage_shares = [
        100 * sum(r["seconds"].get(k, 0.0) for k in writes) / r["times"]["ppo_loop"]
        for r in prefect
        if writes[0] in r["seconds"] or writes[1] in r["seconds"]
    ]
    progress = [100 * r["seconds"].get("ppo_loop|prefect_progress", 0.0) / r["times"]["ppo_loop"] for r in prefect]
    writer = [r["seconds"].get("ppo_loop|mlflow_writer", 0.0) for r in prefect]
    writer_shares = [100 * w / r["times"]["ppo_loop"] for w, r in zip(writer, prefect, strict=True)]
    lines += [
        "",
        f"MLflow in the PPO training loop ({updates} updates), the training thread waiting on it: "
        f"{median_range(per_update)} ms per update, {median_range(shares)}% of the loop's time",
        f"the PPO stage's metric writes and run end, in the loop or after it: {median_range(stage_shares)}% of the "
        "loop's time",
        f"MLflow's metrics writer thread during the PPO loop (beside the training thread, sharing its cores): "
        f"{median_range(writer)} s, {median_range(writer_shares)}% of the loop's time",
        f"Prefect progress logger in the PPO training loop: {median_range(progress, '{:.3f}')}% of the loop's time",
        "MLflow time per stage (A; Tracker calls incl. run creation, params, artifacts, models), seconds:",
    ]
    for stage in (*STAGES, "flow"):
        own = median_range([r["seconds"].get(f"{stage}|mlflow", 0.0) for r in prefect])
        beside = [r["seconds"].get(f"{stage}|mlflow_writer", 0.0) for r in prefect]
        also = f" (and {median_range(beside)} in writer threads)" if any(beside) else ""
        lines.append(f"  {stage:<32}{own}{also}")
    methods = sorted({k for r in prefect for k in r["seconds"] if k.startswith("mlflow.")})
    by_method = {m: [r["seconds"].get(m, 0.0) for r in prefect] for m in methods}
    top = sorted(by_method, key=lambda m: -statistics.median(by_method[m]))[:8]
    lines.append(
        "MLflow time by Tracker method (A), seconds: " + ", ".join(f"{m[7:]} {median_range(by_method[m])}" for m in top)
    )
    cached = {s for r in prefect for s in r["cached"]}
    if cached:
        lines.append(f"WARNING: stages served from a cache in A: {sorted(cached)}")
    share = statistics.median(shares)
    if not library:  # A's runs alone (--variants prefect): its own accounting is the figure
        return [*lines, f"overhead (A's own accounting): {statistics.median(accounted):.1f}%"]
    same, figure_lines = compare_figures(runs)
    lines += ["", "result figures (B's first run; all runs of both variants against it):", *figure_lines]
    lines.append("the same in both variants" if same else "WARNING: the variants' result figures differ")
    a, b = statistics.median(col(prefect, "pipeline")), statistics.median(col(library, "pipeline"))
    overhead = 100 * (a - b) / b
    lines += [
        f"targets: pipeline overhead <= {TARGET_PIPELINE:g}%: {'met' if overhead <= TARGET_PIPELINE else 'NOT met'} "
        f"({overhead:.1f}% A against B; {statistics.median(accounted):.1f}% by A's own accounting); "
        f"MLflow share of a PPO update "
        f"<= {TARGET_MLFLOW:g}%: {'met' if share <= TARGET_MLFLOW else 'NOT met'} ({share:.2f}%)",
        f"overhead: {overhead:.1f}%",
    ]
    return lines
