"""PNG plots for sweeps and run comparisons: reward against KL, and PPO training curves.

Figures are drawn with matplotlib's object API on the Agg canvas (no pyplot state, no display, thread-safe).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


class Point(NamedTuple):
    """One run on the reward-versus-KL plane."""

    label: str
    kl: float
    reward: float


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def save_figure(fig: Figure, path: str | Path, dpi: int = 120) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi)
    return path


def _label_lifts(points: Sequence[Point], near: float = 0.06, step: float = 9.0) -> list[float]:
    """A vertical offset (points) for each point's label: a label whose point lies within `near` of the plot's
    spans from earlier points' is lifted one `step` above the highest of theirs, so labels stay apart."""
    if not points:
        return []
    kls, rewards = [p.kl for p in points], [p.reward for p in points]
    span_x = (max(kls) - min(kls)) or 1.0
    span_y = (max(rewards) - min(rewards)) or 1.0
    lifts: list[float] = []
    for i, p in enumerate(points):
        close = [
            lifts[j]
            for j, q in enumerate(points[:i])
            if abs(p.kl - q.kl) / span_x < near and abs(p.reward - q.reward) / span_y < near
        ]
        lifts.append(max(close) + step if close else 0.0)
    return lifts


def reward_vs_kl(
    points: Sequence[Point],
    path: str | Path,
    reward_name: str = "reward",
    baseline: float | None = None,
    title: str = "Reward against KL(PPO || SFT)",
) -> Path:
    """Scatter of each run's mean reward against its mean KL from the SFT policy, each labelled with its `label`
    (a sweep's: its arm and swept values). Labels of points close together are stacked apart rather than drawn
    over each other.

    `baseline` (e.g. the SFT policy's reward, at KL 0) is drawn as a dashed horizontal line.
    """
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    ax = fig.add_subplot()
    shown = [p for p in points if _finite(p.kl, p.reward)]
    ax.scatter([p.kl for p in shown], [p.reward for p in shown], color="tab:blue", zorder=3)
    for p, lift in zip(shown, _label_lifts(shown), strict=True):
        ax.annotate(p.label, (p.kl, p.reward), textcoords="offset points", xytext=(4, 4 + lift), fontsize=8)
    if _finite(baseline):
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1)
        ax.scatter([0.0], [baseline], color="gray", marker="*", s=90, zorder=3, label="SFT policy (KL 0)")
        ax.legend(loc="best", fontsize=8)
    ax.margins(x=0.25, y=0.1)  # room for the labels
    # KL 0 (the SFT policy) stays in view, and so do runs whose k1 estimate of the KL came out slightly negative
    ax.set_xlim(left=min([0.0, *(p.kl for p in shown)]) - 0.05 * (ax.get_xlim()[1] - ax.get_xlim()[0]))
    ax.set_xlabel("mean KL(PPO || SFT) per response")
    ax.set_ylabel(reward_name)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if not shown:
        ax.text(0.5, 0.5, "no finished runs", transform=ax.transAxes, ha="center", va="center")
    return save_figure(fig, path)


def training_curves(
    curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    metrics: Sequence[str],
    path: str | Path,
    title: str = "PPO training curves",
) -> Path:
    """One panel per metric, one line per run: ``curves[run_label][metric] = [(step, value), ...]``."""
    fig = Figure(figsize=(5.0 * len(metrics), 3.8), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics, strict=True):
        for run_label, history in curves.items():
            series = history.get(metric) or []
            if series:
                ax.plot([s for s, _ in series], [v for _, v in series], label=run_label, linewidth=1.2)
        ax.set_title(metric)
        ax.set_xlabel("PPO update")
        ax.grid(alpha=0.3)
    if any(curves.values()) and len(curves) <= 12:
        axes[0].legend(loc="best", fontsize=7)
    fig.suptitle(title)
    return save_figure(fig, path)
