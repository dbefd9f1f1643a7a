"""What each `ppo.on_overoptimisation` would have kept, from recorded runs: the user's question "with the defaults, how
good is the policy I get, next to the best policy the run passed through?" (docs/overoptimisation.md), answered
from the periodic evaluations of runs trained to their end (`trained_to_end`; `rlhf.sweeps.alarm_check --kept`).

For each such run (`alarm_check.alarm_table`'s rows) the gold of the policy each mode keeps:

- `warn`: the last update's policy (the final periodic evaluation, which runs after the last update);
- `stop`: the policy of the last quiet periodic evaluation before the alarm (no rule, no evidence:
  `rlhf.eval.overoptimisation.kept_index`); the last update's where it never fires;
- `keep_best`: that mode's own pick, replayed as `rlhf.ppo.periodic_eval.EvalGuard` makes it (`keep_best_index`),

set beside the run's best periodic gold and SFT's (the gold at update 0). A mode's **share of the best gain** on a
run is (kept - SFT) / (best - SFT): 1 where it kept the best policy the run passed through, 0 where it kept no more
than the SFT policy, below 0 where it kept worse. The best is the largest gold over the evaluations, update 0's
among them, so it is never below SFT's; where it equals SFT's (no evaluation beat the SFT policy, a run with **no
gain**) the share is undefined: NaN, left out of the means and the worst run and counted apart ("no gain"). What
such a run loses still counts among the collapsed. A run **ends collapsed** under a mode when the policy it keeps is
GOLD_FALL (0.2) or more below the run's best.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from rlhf.eval.overoptimisation import (
    CONFIRM,
    GOLD_FALL,
    JUMP_PER_KL,
    SURPRISAL_JUMP,
    SURPRISAL_RISE,
    kept_index,
    replay_alarm,
)
from rlhf.metrics import PERIODIC_EVAL, PERIODIC_SCORE

MODES = {"warn": "gold_final", "stop": "gold_if_stopped", "keep_best": "gold_if_kept_best"}
NO_GAIN = 1e-9  # a best gain over SFT this small or smaller is none: the share is NaN there
KEPT_COLUMNS = ["run", "task", "objective", "kl_coef", "seed", "half", "sft", "best"]


def keep_best_index(evals: pd.DataFrame, quiet: list[bool], alarm_step: int) -> int | None:
    """The row of `evals` (a run's periodic evaluations in step order) whose policy `ppo.on_overoptimisation:
    keep_best` makes final, replayed as `EvalGuard.observe` picks it: at every evaluation before the alarm (all of
    them where it never fires, update 0's, the SFT policy's, among them) that is `quiet` (the replayed alarm's: no
    rule, no evidence), its conservative score (the ensemble's minimum where that evaluation logged one, the score
    otherwise) replaces the best so far only where it is strictly higher (the first of equal scores stays; a NaN never
    wins). None where no evaluation was picked (then the guard keeps the last update's policy)."""
    best, best_score = None, float("-inf")
    minimum = f"{PERIODIC_EVAL}ensemble_min"
    for i, row in enumerate(evals.to_dict("records")):
        if 0 <= alarm_step <= row["step"]:
            break
        if not quiet[i]:
            continue
        value = row.get(minimum, float("nan"))
        score = value if value == value else row[PERIODIC_SCORE]
        if score > best_score:
            best, best_score = i, score
    return best


def gain_share(kept: float, sft: float, best: float) -> float:
    """(kept - sft) / (best - sft): the share of the run's best gain over the SFT policy a kept policy holds; NaN
    where the run had no gain (its best at most NO_GAIN above SFT's)."""
    gain = best - sft
    return (kept - sft) / gain if gain > NO_GAIN else float("nan")


def trained_to_end(table: pd.DataFrame) -> pd.Series:
    """Which runs of `alarm_check.alarm_table` trained to their end, so that every mode's pick is among their
    evaluations: those made with `warn` or `keep_best` (`ppo.on_overoptimisation`; not logged: runs made before the
    setting, which trained on), and those made with `stop` whose alarm never fired."""
    mode = table["mode"].fillna("") if "mode" in table else pd.Series("", index=table.index)
    quiet = table["alarm_step"] < 0 if "alarm_step" in table else False
    return mode.isin(["", "warn", "keep_best"]) | ((mode == "stop") & quiet)


def kept_table(table: pd.DataFrame) -> pd.DataFrame:
    """One row per run of `alarm_check.alarm_table` trained to its end (`trained_to_end`): what it is, SFT's gold
    (update 0), its best periodic gold, and for each mode the gold it keeps, its share of the best gain (`gain_share`)
    and whether it ends collapsed (GOLD_FALL or more below the best)."""
    runs = table[trained_to_end(table)]
    out = pd.DataFrame({c: runs[c] for c in KEPT_COLUMNS if c in runs and c not in ("sft", "best")})
    out["sft"], out["best"] = runs["gold_start"], runs["gold_peak"]
    for mode, column in MODES.items():
        out[mode] = runs[column]
        out[f"{mode} share"] = [
            gain_share(k, s, b) for k, s, b in zip(runs[column], out["sft"], out["best"], strict=True)
        ]
        out[f"{mode} collapsed"] = out["best"] - out[mode] >= GOLD_FALL - 1e-9
    return out.reset_index(drop=True)


def _summary_row(runs: pd.DataFrame) -> dict[str, object]:
    row: dict[str, object] = {"runs": len(runs), "no gain": int(runs["warn share"].isna().sum())}
    for mode in MODES:
        shares = runs[f"{mode} share"]
        row[f"{mode}: mean share"] = shares.mean()
        if shares.notna().any():
            worst = runs.loc[shares.idxmin()]
            row[f"{mode}: worst"] = f"{shares.min():.2f} ({worst.get('run', '?')})"
        else:
            row[f"{mode}: worst"] = "-"
        row[f"{mode}: collapsed"] = int(runs[f"{mode} collapsed"].sum())
    return row


def kept_summary(kept: pd.DataFrame) -> pd.DataFrame:
    """`kept_table` summarised per estimator (objective), per task and over all runs: the runs, those with no gain,
    and per mode the mean share of the best gain (over the runs with a gain), the worst run's share and name, and the
    runs that end collapsed."""
    rows = {}
    for by in ("objective", "task"):
        if by in kept:
            for name, runs in kept.groupby(by):
                rows[str(name)] = _summary_row(runs)
    rows["all runs"] = _summary_row(kept)
    return pd.DataFrame.from_dict(rows, orient="index")


def markdown(frame: pd.DataFrame, digits: int = 3) -> str:
    """`frame` as a markdown table, numbers to `digits` places."""
    return frame.round(digits).to_markdown(floatfmt=f".{digits}f")


def kept_picture(kept: pd.DataFrame, path: Path, title: str) -> None:
    """Each mode's share of the best gain per estimator, as a PNG: a bar for the mean over the runs with a gain, a
    dot for each run (a ring where the run ends collapsed), and the issue's goals (95% on average, 85% at worst)."""
    from matplotlib.figure import Figure

    objectives = sorted(kept["objective"].unique())
    colours = {"warn": "tab:grey", "stop": "tab:blue", "keep_best": "tab:green"}
    figure = Figure(figsize=(8.0, 4.8))
    ax = figure.subplots()
    width = 0.8 / len(MODES)
    for k, mode in enumerate(MODES):
        for j, objective in enumerate(objectives):
            runs = kept[kept["objective"] == objective]
            shares = runs[f"{mode} share"]
            x = j - 0.4 + width * (k + 0.5)
            label = mode if j == 0 else None
            ax.bar(x, shares.mean(), width * 0.9, color=colours[mode], alpha=0.45, label=label)
            known = shares.notna()
            collapsed = runs[f"{mode} collapsed"]
            ax.scatter([x] * int((known & ~collapsed).sum()), shares[known & ~collapsed], s=10, color=colours[mode])
            ax.scatter(
                [x] * int((known & collapsed).sum()),
                shares[known & collapsed],
                s=22,
                facecolors="none",
                edgecolors="tab:red",
                linewidths=0.9,
            )
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.axhline(0.95, color="tab:orange", linestyle="--", linewidth=0.8, label="goal: mean 0.95")
    ax.axhline(0.85, color="tab:orange", linestyle=":", linewidth=0.8, label="goal: worst 0.85")
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_xticks(range(len(objectives)), objectives, fontsize=8)
    ax.set_ylabel("kept gold, share of the run's best gain over SFT")
    ax.set_title(f"{title} (red rings: kept {GOLD_FALL} or more below the best)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncols=5, frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def report(table: pd.DataFrame, picture: str | None, title: str, levers: dict[str, float] | None = None) -> list[str]:
    """The kept-policy tables of `alarm_check.alarm_table`'s runs as markdown lines (per run, then the summary), and
    the picture where `picture` names a PNG file; replayed under `with_lever`'s `levers` where any is given."""
    lever = ""
    if levers:
        table = with_lever(table, **levers)
        lever = " (replayed with " + ", ".join(f"{name} {value:g}" for name, value in levers.items()) + ")"
        title += "\n" + lever.strip()
    kept = kept_table(table)
    if kept.empty:
        return ["no run trained to its end (made with warn or keep_best, or with a stop whose alarm never fired)"]
    shown = [c for c in kept.columns if not c.endswith("collapsed")]
    lines = [
        f"\nwhat each ppo.on_overoptimisation keeps, {len(kept)} runs trained to their end"
        f"{lever} (share: (kept - SFT) / (best - SFT); collapsed: kept {GOLD_FALL} or more below the best):\n",
        markdown(kept[shown].set_index("run") if "run" in kept else kept[shown]),
        "\nper estimator, per task and over all runs:\n",
        markdown(kept_summary(kept)),
    ]
    if picture:
        kept_picture(kept, Path(picture), title)
    return lines


LEVERS = ("confirm", "evidence_rise", "surprisal_jump", "jump_per_kl", "every")  # `with_lever`'s, as CLI options


def add_lever_arguments(parser: argparse.ArgumentParser) -> None:
    """`alarm_check --kept`'s levers (`with_lever`), each left out where not given (the shipped setting)."""
    levers = parser.add_argument_group("--kept's levers: the alarm replayed with other settings than the shipped")
    levers.add_argument("--confirm", type=int, help=f"the rule holding this many evaluations in a row ({CONFIRM})")
    levers.add_argument(
        "--evidence-rise", type=float, help=f"evidence: the surprisal risen this much ({SURPRISAL_RISE})"
    )
    levers.add_argument(
        "--surprisal-jump", type=float, help=f"evidence: the surprisal's rise per update ({SURPRISAL_JUMP})"
    )
    levers.add_argument(
        "--jump-per-kl", type=float, help=f"a jump counts where it is this much per KL nat ({JUMP_PER_KL})"
    )
    levers.add_argument("--every", type=int, help="read every so many of the recorded evaluations (1)")


def given_levers(args: argparse.Namespace) -> dict[str, float]:
    """The levers `add_lever_arguments` parsed that were given."""
    return {name: getattr(args, name) for name in LEVERS if getattr(args, name) is not None}


def with_lever(table: pd.DataFrame, every: int = 1, **levers: float) -> pd.DataFrame:
    """`alarm_check.alarm_table`'s runs with the alarm and what `stop` and `keep_best` keep replayed under other
    settings (docs/overoptimisation.md; the issue's item 2): `levers` are the alarm's (`replay_alarm`: `confirm`,
    `evidence_rise`, `surprisal_jump`, ...), and `every` reads every so many of the recorded evaluations (and the
    last), as a run evaluated that many times less often would have made them. `alarm_step` (-1: none),
    `gold_if_stopped` and `gold_if_kept_best` replaced; the best gold stays the best over every recorded evaluation.
    Each is a guard a run could keep live."""
    out = table.copy()
    alarms, stopped, best = [], [], []
    for _, row in out.iterrows():
        rows, in_distribution_std = row["alarm_inputs"]
        read = [i for i in range(len(rows)) if i % every == 0 or i == len(rows) - 1]
        rows, gold = [rows[i] for i in read], [row["gold_curve"][i] for i in read]
        alarm = replay_alarm(rows, in_distribution_std, **levers)
        alarm_step = alarm.fired.step if alarm.fired else -1
        alarms.append(alarm_step)
        stopped.append(gold[kept_index(alarm)])
        stats = pd.DataFrame(rows)
        evals = stats.rename(columns={c: f"{PERIODIC_EVAL}{c}" for c in stats.columns if c != "step"})
        picked = keep_best_index(evals, alarm.quiet, alarm_step)
        best.append(gold[-1] if picked is None else gold[picked])
    out["alarm_step"], out["gold_if_stopped"], out["gold_if_kept_best"] = alarms, stopped, best
    return out


FRESH_HEADING = "## Fresh runs, made after the surprisal condition was fixed"


def recorded_runs(path: Path) -> pd.DataFrame:
    """The per-run tables of docs/alarm-grid.md (the grid's two halves, and the fresh runs after its section
    FRESH_HEADING) as `alarm_check.alarm_table`'s columns: what `kept_table` reads where the runs' store is not kept.
    Those tables hold each run's gold at update 0, its peak, its final gold and what 'stop' and 'keep_best' kept."""
    lines = path.read_text(encoding="utf-8").splitlines()
    fresh_from = lines.index(FRESH_HEADING) if FRESH_HEADING in lines else len(lines)
    rows = []
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 12 or not cells[3 + (i < fresh_from)].isdigit():
            continue  # not a run's row (a header, a rule, another table): a run's has its seed there
        if i < fresh_from:
            half, task, objective, kl, seed, start, peak, final, _falls, _alarm, stop, best = cells
        else:
            task, objective, kl, seed, start, peak, final, _falls, _alarm, _earlier, stop, best = cells
            half = "fresh"
        rows.append(
            {
                "run": f"{task} {objective} kl {kl} seed {seed}",
                "half": half,
                "task": task,
                "objective": objective,
                "gold_start": float(start),
                "gold_peak": float(peak.split()[0]),
                "gold_final": float(final),
                "gold_if_stopped": float(stop),
                "gold_if_kept_best": float(best),
            }
        )
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> None:
    """`python -m rlhf.sweeps.alarm_kept docs/alarm-grid.md [--half held-out] [--picture PNG]`: the kept shares of
    the runs a recorded table lists (`recorded_runs`), as markdown."""

    parser = argparse.ArgumentParser(description="what each alarm setting keeps, from a recorded per-run table")
    parser.add_argument("table", type=Path)
    parser.add_argument("--half", choices=["held-out", "tuning", "fresh"], action="append")
    parser.add_argument("--picture", type=Path)
    args = parser.parse_args(argv)
    runs = recorded_runs(args.table)
    if args.half:
        runs = runs[runs["half"].isin(args.half)]
    kept = kept_table(runs)
    print(f"{len(kept)} runs ({', '.join(args.half or ['every half'])})\n")
    print(markdown(kept_summary(kept), 2))
    if args.picture:
        kept_picture(kept, args.picture, f"{len(kept)} recorded runs ({', '.join(args.half or ['all'])})")


if __name__ == "__main__":
    main()
