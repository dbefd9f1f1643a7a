"""Reward-model over-optimisation (Gao et al. 2022, "Scaling Laws for Reward Model Overoptimization"): the gold
and proxy (reward-model) scores of PPO's periodic evaluations against the square root of the KL to the SFT policy,
one point per evaluation of every variant of a sweep.

The histories are the ``periodic_eval/*`` metrics of each variant's PPO run (``ppo.eval_every``; see
docs/overoptimisation.md). `collect_histories` reads them from a sweep's MLflow runs, `overoptimisation_plot`
draws the figure, `summarize` computes its figures (peak gold, the KL at the peak, the proxy at the largest KL),
and `report` does all three and writes the files. ``python -m rlhf.sweeps.overoptimisation --sweep NAME`` runs `report`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rlhf.config import TrackingConfig
from rlhf.metrics import PERIODIC_GOLD, PERIODIC_KL, PERIODIC_SCORE
from rlhf.stages import PPO
from rlhf.sweeps.plots import save_figure
from rlhf.tracking.client import RunRecord, Tracker, experiment_names
from rlhf.tracking.store import store_exists

SCORE, GOLD, KL = PERIODIC_SCORE, PERIODIC_GOLD, PERIODIC_KL
HISTORY_KEYS = [SCORE, GOLD, KL]
RESULTS_FROM_TAG = "rlhf.results_from_run"  # a pipeline run served from the cache names the run that computed it
GOLD_COLOR, PROXY_COLOR = "tab:orange", "tab:blue"


@dataclass
class OveroptimisationSummary:
    """The figures of an over-optimisation plot. KLs are mean KL(policy || SFT) per response (nats)."""

    n_variants: int
    n_points: int  # evaluations with finite gold, proxy and KL (those drawn and summarised)
    n_nonfinite: int  # evaluations left out because a value was NaN or infinite (reported, never hidden)
    sft_gold: float  # the first evaluation (step 0: the SFT policy), mean over variants
    sft_proxy: float
    peak_gold: float
    kl_at_peak_gold: float
    step_at_peak_gold: int
    variant_at_peak_gold: str
    largest_kl: float
    proxy_at_largest_kl: float
    gold_at_largest_kl: float
    variant_at_largest_kl: str

    def as_metrics(self) -> dict[str, float]:
        """The numeric figures as metrics ``overoptimisation/<name>`` (for the sweep's MLflow run)."""
        return {f"overoptimisation/{k}": float(v) for k, v in asdict(self).items() if not isinstance(v, str)}


@dataclass
class OveroptimisationReport:
    summary: OveroptimisationSummary
    figure: Path
    points: Path  # every evaluation of every variant, as CSV


def _points(histories: Mapping[str, pd.DataFrame]) -> tuple[pd.DataFrame, int]:
    """All evaluations as one frame (variant, step, score, gold, kl, sqrt_kl), and how many were not finite."""
    frames = []
    for variant, history in histories.items():
        missing = [k for k in ("step", *HISTORY_KEYS) if k not in history.columns]
        if missing:
            raise ValueError(f"the history of variant {variant!r} has no {', '.join(missing)}")
        frame = history[["step", *HISTORY_KEYS]].rename(columns={SCORE: "score", GOLD: "gold", KL: "kl"})
        frames.append(frame.assign(variant=variant))
    if not frames:
        raise ValueError("no histories: the sweep has no PPO run with periodic evaluations (ppo.eval_every)")
    every = pd.concat(frames, ignore_index=True)
    finite = np.isfinite(every[["score", "gold", "kl"]].to_numpy(dtype=float)).all(axis=1)
    kept = every[finite].copy()
    kept["sqrt_kl"] = np.sqrt(kept["kl"].clip(lower=0.0))  # a slightly negative k1 estimate is 0
    return kept.sort_values(["variant", "step"]).reset_index(drop=True), int((~finite).sum())


def summarize(histories: Mapping[str, pd.DataFrame]) -> OveroptimisationSummary:
    """Peak gold and the KL at which it peaks, and the proxy (and gold) at the largest KL, over every evaluation of
    every variant. `histories[variant]` has columns step, periodic_eval/score, periodic_eval/gold, periodic_eval/kl."""
    points, nonfinite = _points(histories)
    if points.empty:
        raise ValueError(f"no evaluation has finite gold, proxy and KL ({nonfinite} with NaN or infinite values)")
    peak = points.loc[points["gold"].idxmax()]
    far = points.loc[points["kl"].idxmax()]
    first = points[points["step"] == points.groupby("variant")["step"].transform("min")]
    return OveroptimisationSummary(
        n_variants=int(points["variant"].nunique()),
        n_points=len(points),
        n_nonfinite=nonfinite,
        sft_gold=float(first["gold"].mean()),
        sft_proxy=float(first["score"].mean()),
        peak_gold=float(peak["gold"]),
        kl_at_peak_gold=float(peak["kl"]),
        step_at_peak_gold=int(peak["step"]),
        variant_at_peak_gold=str(peak["variant"]),
        largest_kl=float(far["kl"]),
        proxy_at_largest_kl=float(far["score"]),
        gold_at_largest_kl=float(far["gold"]),
        variant_at_largest_kl=str(far["variant"]),
    )


def _trend(points: pd.DataFrame, column: str, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """The trend through the points of all variants: the mean of the first evaluations (the SFT policy, KL 0),
    then the means of `column` over equal-count bins of sqrt(KL) of the other evaluations."""
    first = points["step"] == points.groupby("variant")["step"].transform("min")
    x, y = points.loc[~first, "sqrt_kl"].to_numpy(), points.loc[~first, column].to_numpy()
    order = np.argsort(x)
    groups = [g for g in np.array_split(order, min(bins, len(x))) if len(g)] if len(x) else []
    start_x, start_y = points.loc[first, "sqrt_kl"].mean(), points.loc[first, column].mean()
    return (
        np.array([start_x, *(x[g].mean() for g in groups)]),
        np.array([start_y, *(y[g].mean() for g in groups)]),
    )


def overoptimisation_plot(
    histories: Mapping[str, pd.DataFrame],
    path: str | Path,
    title: str = "Reward-model over-optimisation",
    bins: int = 8,
) -> Path:
    """Gold (left axis) and proxy reward-model score (right axis) against sqrt(KL to SFT): one point per evaluation
    of every variant, a light line per variant (in update order), a thick line from the SFT point through the
    means of equal-count bins of sqrt(KL) of the later points, and a star at the peak gold."""
    points, nonfinite = _points(histories)
    summary = summarize(histories)
    fig = Figure(figsize=(7.6, 5.2), layout="constrained")
    gold_ax = fig.add_subplot()
    proxy_ax = gold_ax.twinx()
    for ax, column, color, name in (
        (gold_ax, "gold", GOLD_COLOR, "gold reward"),
        (proxy_ax, "score", PROXY_COLOR, "proxy (reward-model score)"),
    ):
        for _, variant in points.groupby("variant"):
            ax.plot(variant["sqrt_kl"], variant[column], color=color, alpha=0.25, linewidth=0.9)
        ax.scatter(points["sqrt_kl"], points[column], color=color, s=14, alpha=0.7, zorder=3, label=name)
        bx, by = _trend(points, column, bins)
        ax.plot(bx, by, color=color, linewidth=2.6, zorder=4, label=f"{name}: mean over sqrt(KL) bins")
        ax.set_ylabel(name, color=color)
        ax.tick_params(axis="y", colors=color)
    gold_ax.scatter(
        [math.sqrt(max(summary.kl_at_peak_gold, 0.0))], [summary.peak_gold], marker="*", s=220, color="black",
        zorder=5, label=f"peak gold {summary.peak_gold:.3f} at KL {summary.kl_at_peak_gold:.2f}",
    )  # fmt: skip
    handles = [h for ax in (gold_ax, proxy_ax) for h in ax.get_legend_handles_labels()[0]]
    labels = [lb for ax in (gold_ax, proxy_ax) for lb in ax.get_legend_handles_labels()[1]]
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=7)
    gold_ax.set_xlabel("sqrt(mean KL(policy || SFT) per response)")
    note = f"{summary.n_variants} variants, {summary.n_points} evaluations"
    note += f" ({nonfinite} left out: NaN or inf)" if nonfinite else ""
    gold_ax.set_title(f"{title}\n{note}", fontsize=10)
    gold_ax.grid(alpha=0.3)
    return save_figure(fig, path, dpi=130)


def sweep_run(tracker: Tracker, sweep: str) -> RunRecord:
    """The sweep run named by its run id (or an id prefix) or its sweep name (the newest of that name)."""
    sweeps = tracker.search_runs("tags.run_type = 'sweep'")
    found = [r for r in sweeps if r.run_id.startswith(sweep) or sweep in (r.name, r.tags.get("sweep.name"))]
    if not found:
        raise LookupError(f"no sweep run with id or name '{sweep}' in this experiment")
    return found[0]


def _ppo_run(tracker: Tracker, pipeline_run: RunRecord) -> RunRecord | None:
    """A pipeline run's PPO child run, or that of the run it was served from when its PPO came from the cache."""
    for run_id in (pipeline_run.run_id, pipeline_run.tags.get(RESULTS_FROM_TAG)):
        if run_id:
            children = tracker.child_runs(run_id, PPO.task)
            if children:
                return children[0]
    return None


def collect_histories(tracker: Tracker, sweep_run_id: str) -> dict[str, pd.DataFrame]:
    """``{variant label: periodic evaluation history}`` of a sweep's variants (the pipeline runs under the sweep
    run), each a frame with columns step, periodic_eval/score, periodic_eval/gold, periodic_eval/kl; variants without
    periodic evaluations are left out."""
    histories = {}
    for run in tracker.child_runs(sweep_run_id):
        if not run.is_pipeline_run:
            continue
        ppo = _ppo_run(tracker, run)
        if ppo is None:
            continue
        history = tracker.metric_histories(ppo.run_id, HISTORY_KEYS)
        if not history.empty and history[KL].notna().any():
            histories[run.tags.get("sweep.variant", run.name)] = history
    return histories


def report(tracker: Tracker, sweep_run_id: str, out_dir: str | Path) -> OveroptimisationReport | None:
    """The over-optimisation figure (``overoptimisation.png``), its points (``overoptimisation_points.csv``) and
    summary of one sweep, written to `out_dir`; None when no variant has periodic evaluations (ppo.eval_every 0).
    Raises ValueError when evaluations exist but none has finite gold, proxy and KL."""
    histories = collect_histories(tracker, sweep_run_id)
    if not histories:
        return None
    out = Path(out_dir)
    figure = overoptimisation_plot(histories, out / "overoptimisation.png")
    points, _ = _points(histories)
    points.to_csv(out / "overoptimisation_points.csv", index=False)
    return OveroptimisationReport(summarize(histories), figure, out / "overoptimisation_points.csv")


def format_summary(summary: OveroptimisationSummary) -> str:
    s = summary
    left_out = f" ({s.n_nonfinite} NaN/inf left out)" if s.n_nonfinite else ""
    return "\n".join(
        [
            f"{s.n_variants} variants, {s.n_points} evaluations{left_out}",
            f"SFT policy (step 0):     gold {s.sft_gold:.3f}, proxy {s.sft_proxy:.3f}",
            f"peak gold reward:        {s.peak_gold:.3f} at KL {s.kl_at_peak_gold:.2f} "
            f"({s.variant_at_peak_gold}, update {s.step_at_peak_gold})",
            f"largest KL:              {s.largest_kl:.2f} ({s.variant_at_largest_kl})",
            f"  proxy / gold there:    {s.proxy_at_largest_kl:.3f} / {s.gold_at_largest_kl:.3f}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", required=True, help="sweep run id (or prefix) or sweep name")
    parser.add_argument("--tracking-uri", default=TrackingConfig().uri, help="MLflow tracking URI")
    parser.add_argument("--experiment", default=TrackingConfig().experiment, help="MLflow experiment name")
    parser.add_argument("--out", default="outputs/overoptimisation", help="folder for the PNG and the CSV")
    args = parser.parse_args(argv)
    if not store_exists(args.tracking_uri) or args.experiment not in experiment_names(args.tracking_uri):
        print(f"error: no experiment '{args.experiment}' at {args.tracking_uri}", file=sys.stderr)
        return 2
    tracker = Tracker(args.tracking_uri, args.experiment)
    try:
        run = sweep_run(tracker, args.sweep)
        result = report(tracker, run.run_id, args.out)
    except (LookupError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if result is None:
        print(f"error: no variant of sweep {run.name} has periodic evaluations (ppo.eval_every)", file=sys.stderr)
        return 2
    print(format_summary(result.summary))
    print(f"wrote {result.figure}\nwrote {result.points}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
