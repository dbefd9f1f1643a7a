"""Compare the pipeline runs of an MLflow experiment side by side.

    python -m rlhf.sweeps.compare --experiment rlhf-ppo [--tracking-uri sqlite:///mlruns/mlflow.db] \
        [--out outputs/compare]

Prints the parameters that differ between the runs and their final metrics (one column per run), and writes
``compare.csv`` (one row per run), ``reward_vs_kl.png`` (each run's mean reward against its KL from the SFT policy) and
``training_curves.png`` (``objective/scores`` and ``objective/kl`` per PPO update, from the ``train_policy_ppo``
child runs) into the output folder. Everything is read through :mod:`rlhf.tracking.client`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from rlhf.config import TrackingConfig
from rlhf.metrics import (
    EVAL_HACKING_EMPTY,
    EVAL_HACKING_LENGTH,
    EVAL_KL,
    EVAL_POLICY_EMPTY,
    EVAL_POLICY_GOLD,
    EVAL_POLICY_LENGTH,
    EVAL_POLICY_SCORE,
    EVAL_POLICY_STOP,
    EVAL_SFT_GOLD,
    EVAL_SFT_LENGTH,
    EVAL_SFT_SCORE,
    EVAL_WIN_RATE_GOLD,
    EVAL_WIN_RATE_GOLD_LC,
    EVAL_WIN_RATE_RM,
    EVAL_WIN_RATE_RM_LC,
    OBJECTIVE_KL,
    OBJECTIVE_SCORES,
    REWARD_BEST_EVAL_ACCURACY,
)
from rlhf.stages import PPO
from rlhf.sweeps.overoptimisation import sweep_run
from rlhf.sweeps.plots import Point, reward_vs_kl, training_curves
from rlhf.sweeps.ranking import reward_metric
from rlhf.tracking.client import RunRecord, Tracker, experiment_names
from rlhf.tracking.default_view import mlflow_compare_url
from rlhf.tracking.store import store_exists

# Final metrics of a pipeline run (logged on the parent run by the flow), in display order.
SUMMARY_METRICS = (
    REWARD_BEST_EVAL_ACCURACY,
    EVAL_WIN_RATE_GOLD,
    EVAL_POLICY_GOLD,
    EVAL_SFT_GOLD,
    EVAL_WIN_RATE_RM,
    EVAL_POLICY_SCORE,
    EVAL_SFT_SCORE,
    EVAL_KL,
    EVAL_WIN_RATE_RM_LC,
    EVAL_WIN_RATE_GOLD_LC,
    EVAL_POLICY_LENGTH,
    EVAL_SFT_LENGTH,
    EVAL_POLICY_EMPTY,
    EVAL_POLICY_STOP,
    EVAL_HACKING_LENGTH,
    EVAL_HACKING_EMPTY,
)
CURVE_METRICS = (OBJECTIVE_SCORES, OBJECTIVE_KL)
# Parameters that differ between runs without changing what was trained.
IGNORED_PARAM_PREFIXES = ("run_name", "tracking.", "runtime.output_dir", "runtime.progress")


@dataclass
class Comparison:
    """The compared runs, the parameters that differ between them, the side-by-side table and written files."""

    runs: list[RunRecord]
    differing: list[str]
    table: pd.DataFrame
    files: list[Path] = field(default_factory=list)


def differing_params(runs: list[RunRecord]) -> list[str]:
    """Parameter keys whose values are not the same in every run (a key missing from a run counts as different)."""
    keys = sorted({k for r in runs for k in r.params if not k.startswith(IGNORED_PARAM_PREFIXES)})
    return [k for k in keys if len({r.params.get(k) for r in runs}) > 1]


def _number(text: str | None) -> float | str | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return text


def side_by_side(runs: list[RunRecord], params: list[str], metrics: list[str]) -> pd.DataFrame:
    """Rows: run id, status, the given params and metrics; one column per run (named by run name)."""
    columns = {}
    for run in runs:
        column = {"run_id": run.run_id[:12], "status": run.status}
        column |= {f"param {k}": _number(run.params.get(k)) for k in params}
        column |= {k: run.metrics.get(k) for k in metrics}
        name = run.name if run.name not in columns else f"{run.name} ({run.run_id[:6]})"
        columns[name] = column
    return pd.DataFrame(columns)


def ppo_run(tracker: Tracker, run: RunRecord) -> RunRecord | None:
    """The PPO child run of a pipeline run (none when the stage was served from the cache)."""
    children = tracker.child_runs(run.run_id, PPO.task)
    return children[0] if children else None


def reward_key(runs: list[RunRecord]) -> str:
    """Gold reward when every run has one (the synthetic task), else the reward-model score."""
    return reward_metric([EVAL_POLICY_GOLD in r.metrics for r in runs])


def compare(tracker: Tracker, runs: list[RunRecord], out_dir: str | Path, all_params: bool = False) -> Comparison:
    """Build the side-by-side table; write ``compare.csv``, ``reward_vs_kl.png`` and ``training_curves.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    differing = differing_params(runs)
    shown = sorted({k for r in runs for k in r.params}) if all_params else differing
    metrics = [m for m in SUMMARY_METRICS if any(m in r.metrics for r in runs)]
    table = side_by_side(runs, shown, metrics)
    table.T.to_csv(out / "compare.csv", index_label="run")  # one row per run

    key = reward_key(runs)
    finished = [r for r in runs if key in r.metrics and EVAL_KL in r.metrics]
    points = [Point(r.name, r.metrics[EVAL_KL], r.metrics[key]) for r in finished]
    baselines = [r.metrics[key.replace("ppo", "sft")] for r in finished if key.replace("ppo", "sft") in r.metrics]
    baseline = sum(baselines) / len(baselines) if baselines else None
    files = [reward_vs_kl(points, out / "reward_vs_kl.png", key, baseline)]

    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for run in runs:
        child = ppo_run(tracker, run)
        if child is not None:
            curves[run.name] = {m: tracker.metric_history(child.run_id, m) for m in CURVE_METRICS}
    files.append(training_curves(curves, CURVE_METRICS, out / "training_curves.png"))
    return Comparison(runs=runs, differing=differing, table=table, files=[out / "compare.csv", *files])


def select_runs(
    tracker: Tracker, last: int | None, run_ids: list[str] | None = None, sweep: str | None = None
) -> list[RunRecord]:
    """Pipeline runs, newest first: the given ids, or one sweep's variants (by sweep run id or name), or the last N."""
    runs = tracker.pipeline_runs()
    if run_ids:
        runs = [r for r in runs if any(r.run_id.startswith(i) for i in run_ids)]
    if sweep:
        runs = [r for r in runs if sweep in (r.tags.get("sweep_run_id"), r.tags.get("sweep.name"))]
    return runs[:last] if last else runs


def format_comparison(comparison: Comparison) -> str:
    """The table as text, with a line on what differs."""
    with pd.option_context("display.width", 200, "display.max_columns", 50, "display.max_colwidth", 40):
        text = comparison.table.to_string(float_format=lambda v: f"{v:.4g}", na_rep="-")
    differs = ", ".join(comparison.differing) or "nothing (same config)"
    lines = [f"{len(comparison.runs)} pipeline runs; parameters that differ: {differs}", "", text, ""]
    lines += [f"wrote {path}" for path in comparison.files]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default=TrackingConfig().experiment, help="MLflow experiment name")
    parser.add_argument(
        "--tracking-uri", default=TrackingConfig().uri, help="MLflow tracking URI (SQLite file or server URL)"
    )
    parser.add_argument("--out", default="outputs/compare", help="folder for compare.csv and the PNG plots")
    parser.add_argument("--last", type=int, default=10, help="compare the N most recent pipeline runs (0: all)")
    parser.add_argument("--runs", nargs="+", metavar="RUN_ID", help="compare these runs (ids or id prefixes)")
    parser.add_argument("--sweep", help="compare the variants of one sweep (sweep run id or sweep name)")
    parser.add_argument("--all-params", action="store_true", help="show every parameter, not only those that differ")
    args = parser.parse_args(argv)

    if not store_exists(args.tracking_uri):
        print(f"error: no MLflow store at {args.tracking_uri}; run the pipeline first (make run)", file=sys.stderr)
        return 2
    names = experiment_names(args.tracking_uri)
    if args.experiment not in names:
        found = ", ".join(names) or "none"
        print(f"error: experiment '{args.experiment}' is not in {args.tracking_uri} (found: {found})", file=sys.stderr)
        return 2
    tracker = Tracker(args.tracking_uri, args.experiment)
    runs = select_runs(tracker, args.last or None, args.runs, args.sweep)
    if not runs:
        print(f"error: no pipeline runs match in experiment '{args.experiment}'", file=sys.stderr)
        return 2
    print(format_comparison(compare(tracker, runs, args.out, args.all_params)))
    # MLflow's Compare button leaves the model-training view; this link stays in it
    url = mlflow_compare_url(tracker.experiment_id, [r.run_id for r in runs])
    print(f"the same runs side by side in MLflow (make mlflow-ui): {url}")
    # the named sweep's study, or the newest study of the experiment (make compare shows it without arguments)
    study = study_of(tracker, args.sweep, args.out) if args.sweep else newest_study(tracker, args.out)
    if study:
        print(study)
    return 0


def newest_study(tracker: Tracker, out: str) -> str:
    """The study of the newest sweep run with arms (a study_table.md artifact), or ''."""
    for run in tracker.search_runs("tags.run_type = 'sweep'"):
        text = study_of(tracker, run.run_id, out)
        if text:
            return text
    return ""


def study_of(tracker: Tracker, sweep: str, out: str) -> str:
    """A study sweep's table (per arm, mean and 95% interval over seeds) and where its frontier plot is; '' for a
    sweep without arms."""
    try:
        run = sweep_run(tracker, sweep)
    except LookupError:
        return ""
    table = tracker.download_artifact(run.run_id, "study_table.md", out)
    if table is None:
        return ""
    figure = tracker.download_artifact(run.run_id, "frontier.png", out)
    lines = ["", f"== Study {run.tags.get('sweep.name', run.name)}: per arm, mean and 95% interval", table.read_text()]
    return "\n".join([*lines, f"wrote {figure}" if figure else ""])


if __name__ == "__main__":
    sys.exit(main())
