"""A study: the arms of a sweep (e.g. PPO, GRPO, RLOO, REINFORCE++, DPO) compared over repeated points (seeds) on
one SFT and reward model. `study_table` gives one row per arm, the mean over its finished runs with a 95% interval
(for win rates a Student-t interval on the logit scale, which stays inside 0% to 100%, and each run's value beside
it; for the other measures Student's t), and `frontier_plot` draws gold reward against sqrt(KL to SFT), one
colour per arm: the periodic evaluations of every online run (``ppo.eval_every``) as lines, every run's final
evaluation as a large marker.

No Prefect here, and MLflow only through `rlhf.tracking.client`: flows/sweep_run.py calls `report` and logs its files
on the sweep's run (docs/choosing-an-algorithm.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from scipy import stats
from scipy.special import expit, logit

from rlhf.eval.overoptimisation import ALARM_STEP_KEY
from rlhf.metrics import (
    EVAL_HACKING_EMPTY,
    EVAL_HACKING_LENGTH,
    EVAL_KL,
    EVAL_OVEROPTIMISATION_FLAG,
    EVAL_POLICY_GOLD,
    EVAL_WIN_RATE_GOLD,
    EVAL_WIN_RATE_GOLD_LC,
    PERIODIC_GOLD,
    PERIODIC_KL,
    TIME_POLICY_TRAIN,
)
from rlhf.sweeps.overoptimisation import collect_histories
from rlhf.sweeps.plots import save_figure
from rlhf.tracking.client import Tracker

# (column of the study table, the run's summary metrics (the first a run has), how the arm's runs combine: 'rate' a
# share in [0, 1] with its logit-scale interval, 'mean' with its t-interval, 'max' the largest)
MEASURES = (
    ("win_rate_gold", (EVAL_WIN_RATE_GOLD,), "rate"),
    ("win_rate_gold_lc", (EVAL_WIN_RATE_GOLD_LC,), "rate"),
    ("gold", (EVAL_POLICY_GOLD,), "mean"),
    ("kl", (EVAL_KL,), "mean"),
    ("train_s", (TIME_POLICY_TRAIN,), "mean"),
    ("peak_mb", ("memory/ppo_peak_mb", "memory/dpo_peak_mb"), "max"),  # the policy stage's measured peak
)
HACKING_FLAGS = (EVAL_HACKING_LENGTH, EVAL_HACKING_EMPTY)
# the over-optimisation alarm: at PPO's periodic evaluations (the update it fired after; -1: never) or on the
# evaluation stage's final policy against SFT (1: fired)
ALARM_METRICS = (ALARM_STEP_KEY, EVAL_OVEROPTIMISATION_FLAG)
STUDY_METRICS = tuple(metric for _, metrics, _ in MEASURES for metric in metrics) + HACKING_FLAGS + ALARM_METRICS


def alarmed(run: Mapping[str, Any]) -> bool:
    """Whether the over-optimisation alarm fired in `run` (its summary metrics)."""
    step, flag = (run.get(metric) for metric in ALARM_METRICS)
    return (_finite(step) and step >= 0) or (_finite(flag) and flag > 0)


def _finite(value: Any) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


def _measure(run: Mapping[str, Any], metrics: Sequence[str]) -> float:
    """The first of `metrics` the run has a finite value of, else NaN."""
    return next((float(run[m]) for m in metrics if _finite(run.get(m))), math.nan)


def interval95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval) of the finite `values`; the half-width is NaN below two values.

    >>> interval95([0.9, 0.8, 1.0])  # sd 0.1, se 0.1 / sqrt(3) = 0.0577, t(2) = 4.3027 -> 0.248
    (0.9, 0.248...)
    """
    x = np.asarray([v for v in values if _finite(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan
    if len(x) == 1:
        return float(x[0]), math.nan
    t = stats.t.ppf(0.975, len(x) - 1)  # two-sided 95% critical value of Student's t
    return float(x.mean()), float(t * x.std(ddof=1) / math.sqrt(len(x)))


# a rate of 0 or 1 has an infinite logit: rates are held this far inside [0, 1] on the logit scale (a tenth of a
# percent: below the resolution of an evaluation on a few hundred prompts)
RATE_EDGE = 1e-3


def rate_interval95(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of rates in [0, 1]: the mean of the finite `values`, and the 95% t-interval of their
    logits mapped back, so the interval never leaves [0, 1] however far the runs disagree (rates held within
    `RATE_EDGE` of the ends, the interval then widened to hold the mean); low and high are NaN below two values. A
    t-interval on the rates themselves passes 0% or 100% when runs split (e.g. 96%, 8%, 2%: 35% +- 132%).

    >>> [round(x, 3) for x in rate_interval95([0.9, 0.8, 0.95])]  # logits 2.197, 1.386, 2.944 -> 2.176 +- 1.936
    [0.883, 0.56, 0.984]
    """
    x = [float(v) for v in values if _finite(v)]
    if not x:
        return math.nan, math.nan, math.nan
    mean = float(np.mean(x))
    centre, half = interval95([float(logit(min(max(v, RATE_EDGE), 1.0 - RATE_EDGE))) for v in x])
    if not math.isfinite(half):
        return mean, math.nan, math.nan
    return mean, min(float(expit(centre - half)), mean), max(float(expit(centre + half)), mean)


def study_table(rows: Sequence[Mapping[str, Any]], arms: Sequence[str]) -> pd.DataFrame:
    """One row per arm (in `arms` order): runs finished out of started, then for each measure the mean over the
    finished runs with its 95% interval: for rates `<measure>_lo` and `<measure>_hi` (`rate_interval95`) and
    `<measure>_runs`, each run's value in the order of `rows`; for the others the t-interval's half-width
    (`<measure>_ci`); peak memory the largest. Then how many runs raised a reward-hacking flag (length or empty
    responses) and the over-optimisation alarm. `rows` are the sweep's ranking rows: `arm`, `status` and the summary
    metrics of `STUDY_METRICS`."""
    out = []
    for arm in arms:
        mine = [r for r in rows if r.get("arm") == arm]
        done = [r for r in mine if r.get("status") == "completed"]
        row: dict[str, Any] = {"arm": arm, "runs": f"{len(done)}/{len(mine)}"}
        for column, metrics, how in MEASURES:
            values = [_measure(run, metrics) for run in done]
            if how == "max":
                finite = [v for v in values if math.isfinite(v)]
                row[column] = max(finite) if finite else math.nan
            elif how == "rate":
                row[column], row[f"{column}_lo"], row[f"{column}_hi"] = rate_interval95(values)
                row[f"{column}_runs"] = [v for v in values if math.isfinite(v)]
            else:
                row[column], row[f"{column}_ci"] = interval95(values)
        flagged = sum(any(_finite(run.get(f)) and run[f] > 0 for f in HACKING_FLAGS) for run in done)
        row["hacking_flagged"] = f"{flagged}/{len(done)}"
        row["overoptimisation_alarm"] = f"{sum(alarmed(run) for run in done)}/{len(done)}"
        out.append(row)
    return pd.DataFrame(out)


# The study table's columns as people read it (the Markdown of make study and docs/choosing-an-algorithm.md, the
# Prefect table), the arm, its runs, then the gold win rate and the KL it cost side by side: (header, what it holds).
# The headers are short, as MLflow's Markdown view gives every column the same width and cuts a longer header off;
# `STUDY_LEGEND` says what each holds.
STUDY_COLUMNS = (
    ("arm", "the arm"),
    ("runs", "its runs finished of started"),
    ("win rate", "the gold win rate over SFT, the mean over its runs [95% interval, a t-interval on the logit scale]"),
    ("KL", "the mean KL to SFT ± the half-width of its 95% t-interval"),
    ("gold", "the mean gold reward ± the same"),
    ("LC win rate", "the length-controlled gold win rate [95% interval]"),
    ("each run %", "each run's gold win rate"),
    ("train s", "the policy stage's wall time ± the same"),
    ("peak MB", "the largest peak memory of the policy stage"),
    ("hacking", "runs that raised a reward-hacking flag"),
    ("alarm", "runs whose over-optimisation alarm fired"),
)
STUDY_HEADERS = tuple(header for header, _ in STUDY_COLUMNS)
STUDY_LEGEND = "; ".join(f"{header}: {what}" for header, what in STUDY_COLUMNS) + "."


def study_cells(table: pd.DataFrame) -> list[dict[str, str]]:
    """The study table's rows as text, keyed by `STUDY_HEADERS`: rates as 'mean [low, high]' with each run's value
    in a column of its own, the other intervals as 'mean ± half-width', 'n/a' where no run has a value."""

    def cell(row: pd.Series, column: str, fmt: str) -> str:
        mean, half = row.get(column, math.nan), row.get(f"{column}_ci", math.nan)
        if mean is None or not math.isfinite(mean):
            return "n/a"
        return format(mean, fmt) + ("" if half is None or not math.isfinite(half) else f" ± {format(half, fmt)}")

    def rate(row: pd.Series, column: str) -> str:
        mean, low, high = (row.get(f"{column}{end}", math.nan) for end in ("", "_lo", "_hi"))
        if mean is None or not math.isfinite(mean):
            return "n/a"
        return f"{mean:.1%}" + ("" if not math.isfinite(low) else f" [{low:.1%}, {high:.1%}]")

    def runs(row: pd.Series, column: str) -> str:
        values = row.get(f"{column}_runs")
        return ", ".join(f"{100 * v:.1f}" for v in values) if isinstance(values, list) and values else "n/a"

    out = []
    for _, row in table.iterrows():
        peak = row.get("peak_mb", math.nan)
        values = (
            str(row["arm"]),
            str(row["runs"]),
            rate(row, "win_rate_gold"),
            cell(row, "kl", ".2f"),
            cell(row, "gold", ".3f"),
            rate(row, "win_rate_gold_lc"),
            runs(row, "win_rate_gold"),
            cell(row, "train_s", ".0f"),
            "n/a" if not math.isfinite(peak) else f"{peak:.0f}",
            str(row["hacking_flagged"]),
            str(row["overoptimisation_alarm"]),
        )
        out.append(dict(zip(STUDY_HEADERS, values, strict=True)))
    return out


def format_study(table: pd.DataFrame) -> str:
    """The study table as Markdown (`study_cells`), its legend below it (docs/choosing-an-algorithm.md prints this)."""
    lines = ["| " + " | ".join(STUDY_HEADERS) + " |", "|" + " --- |" * len(STUDY_HEADERS)]
    lines += ["| " + " | ".join(row.values()) + " |" for row in study_cells(table)]
    return "\n".join([*lines, "", STUDY_LEGEND])


def frontier_points(
    rows: Sequence[Mapping[str, Any]], histories: Mapping[str, pd.DataFrame], arm_of: Mapping[str, str]
) -> pd.DataFrame:
    """Every point of the frontier: (arm, run, kind, step, gold, kl, sqrt_kl). `histories` maps a variant label to
    its periodic evaluations (columns step, periodic_eval/gold, periodic_eval/kl: rlhf.sweeps.overoptimisation) and
    `arm_of` a variant label to its arm; each finished row adds its final evaluation (kind 'final')."""
    records = []
    for label, history in histories.items():
        if label not in arm_of:
            continue
        for _, h in history.iterrows():
            step, gold, kl = int(h["step"]), h.get(PERIODIC_GOLD), h.get(PERIODIC_KL)
            records.append((arm_of[label], label, "periodic", step, gold, kl))
    for row in rows:
        if row.get("status") == "completed" and row.get("label") in arm_of:
            records.append((row["arm"], row["label"], "final", -1, row.get(EVAL_POLICY_GOLD), row.get(EVAL_KL)))
    frame = pd.DataFrame(records, columns=["arm", "run", "kind", "step", "gold", "kl"])
    frame[["gold", "kl"]] = frame[["gold", "kl"]].astype(float)
    frame = frame[np.isfinite(frame["gold"]) & np.isfinite(frame["kl"])].copy()
    frame["sqrt_kl"] = np.sqrt(frame["kl"].clip(lower=0.0))
    return frame.reset_index(drop=True)


def frontier_plot(points: pd.DataFrame, arms: Sequence[str], path: str | Path, title: str = "") -> Path:
    """Gold reward against sqrt(KL to SFT), one colour per arm: each online run's periodic evaluations as a thin
    line in update order, each run's final evaluation as a large marker."""
    fig = Figure(figsize=(7.6, 5.2), layout="constrained")
    ax = fig.add_subplot()
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(arms)}
    for arm in arms:
        mine = points[points["arm"] == arm]
        for _, run in mine[mine["kind"] == "periodic"].groupby("run"):
            run = run.sort_values("step")
            ax.plot(run["sqrt_kl"], run["gold"], color=colours[arm], alpha=0.45, linewidth=1.0, marker=".")
        final = mine[mine["kind"] == "final"]
        ax.scatter(
            final["sqrt_kl"], final["gold"], color=colours[arm], s=70, edgecolor="black", zorder=4,
            label=f"{arm} ({len(final)} run{'s' if len(final) != 1 else ''})",
        )  # fmt: skip
    ax.set_xlabel("sqrt(mean KL(policy || SFT) per response)")
    ax.set_ylabel("mean gold reward")
    ax.set_title(title or "Gold reward against KL to SFT: lines periodic evaluations, markers final", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=130)


@dataclass
class StudyReport:
    table: pd.DataFrame
    markdown: str
    files: list[Path]  # study_table.csv, study_table.md, frontier_points.csv, frontier.png


def report(
    tracker: Tracker,
    sweep_run_id: str,
    rows: Sequence[Mapping[str, Any]],
    arm_of: Mapping[str, str],
    out_dir: str | Path,
    title: str = "",
    note: str = "",
) -> StudyReport:
    """The study table and the frontier of a sweep with arms, written to `out_dir`. `rows` are the sweep's rows
    (`arm`, `label`, `status`, summary metrics), `arm_of` maps each variant label to its arm (in the arms' order);
    `note` (e.g. that the runs check the plumbing, not learning) is a line above the Markdown table."""
    arms = list(dict.fromkeys(arm_of.values()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = study_table(rows, arms)
    markdown = (f"{note}\n\n" if note else "") + format_study(table)
    table.to_csv(out / "study_table.csv", index=False)
    (out / "study_table.md").write_text(markdown + "\n")
    points = frontier_points(rows, collect_histories(tracker, sweep_run_id), arm_of)
    points.to_csv(out / "frontier_points.csv", index=False)
    figure = frontier_plot(points, arms, out / "frontier.png", title)
    return StudyReport(
        table, markdown, [out / "study_table.csv", out / "study_table.md", out / "frontier_points.csv", figure]
    )
