"""How well each gold-free signal of `alarm_check.alarm_table`'s runs tells the runs whose gold falls from the rest:
its AUC and its means on both (`separation_table`), and the ROC curves of all of them (`roc_picture`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rlhf.eval.overoptimisation import GOLD_FALL


def auc(scores: pd.Series, positive: pd.Series) -> float:
    """The area under the ROC curve of `scores` for telling the positive runs from the others (ties count half;
    NaN scores left out): the chance that a random positive run scores above a random negative one."""
    known = scores.notna()
    pos, neg = scores[known & positive].tolist(), scores[known & ~positive].tolist()
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def separation_table(table: pd.DataFrame) -> pd.DataFrame:
    """Each signal's AUC for the runs whose gold falls, and its mean on falling and on healthy runs."""
    falls = table["falls"].astype(bool)
    rows = []
    for column in [c for c in table.columns if c.startswith("signal: ")]:
        rows.append(
            {
                "signal": column.removeprefix("signal: "),
                "auc": auc(table[column], falls),
                "mean (falls)": table.loc[falls, column].mean(),
                "mean (healthy)": table.loc[~falls, column].mean(),
            }
        )
    return pd.DataFrame(rows)


def roc_picture(table: pd.DataFrame, path: Path, title: str) -> None:
    """The ROC curves of the rule's score and of each signal against "gold fell GOLD_FALL or more", as a PNG."""
    from matplotlib.figure import Figure

    falls = table["falls"].astype(bool)
    figure = Figure(figsize=(6.4, 5.6))
    ax = figure.subplots()
    for column in [c for c in table.columns if c.startswith("signal: ")]:
        scores = table[column]
        known = scores.notna()
        if not (known & falls).any() or not (known & ~falls).any():
            continue
        thresholds = sorted(set(scores[known]), reverse=True)
        points = [(0.0, 0.0)]
        for t in thresholds:
            flagged = known & (scores >= t)
            points.append(
                ((flagged & ~falls).sum() / (known & ~falls).sum(), (flagged & falls).sum() / (known & falls).sum())
            )
        name = column.removeprefix("signal: ")
        width = 2.5 if name == "rule" else 1.0
        ax.plot(*zip(*points, strict=True), label=f"{name} (AUC {auc(scores, falls):.2f})", linewidth=width)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("false-alarm rate (healthy runs flagged)")
    ax.set_ylabel(f"recall (runs whose gold fell {GOLD_FALL} or more)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
