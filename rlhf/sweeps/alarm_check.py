"""The over-optimisation alarm checked against gold: every PPO-stage run with periodic evaluations and a gold
reward in MLflow experiments, its gold curve, where the alarm fires, what each `ppo.on_overoptimisation` keeps, and
how well each gold-free signal tells the runs whose gold falls from the rest (docs/overoptimisation.md).

    python -m rlhf.sweeps.alarm_check --experiment rlhf-ppo [--experiment rlhf-overoptimisation] [--filter NAME]
        [--half held-out] [--out table.csv] [--roc roc.png]

Each run's alarm is replayed from its logged periodic_eval/* history with today's rule (`rlhf.eval.overoptimisation`),
so runs logged before a change of the rule are judged by the new one. Every run belongs to one half of the study,
"tuning" or "held-out", fixed by what the run is (`held_out`) before any run is looked at: thresholds are chosen on
the tuning half and reported on the held-out one.

**The KL-drift factor per objective** (`tune_kl_drift`, on the tuning half only). What is tuned is the KL-drift
condition's factor (`KL_DRIFT_FACTOR`: the KL must grow past that many times an earlier evaluation's, plus
`KL_DRIFT_NATS`, while the score stalls), not a scale on the rule's whole score: it is the condition that fires on
healthy GRPO-like runs, whose KL keeps growing after the score plateaus, and how fast the KL grows once the score has
stalled depends on the estimator (where its KL term acts). The distinct-bigram condition reads the responses alone,
whatever trained them, and stays as it is, as do the 1-nat floor (the KL estimate's noise) and the ensemble
conditions. The rule, fixed before the held-out half is read:

- For a set of tuning runs, the factors searched are the default and every larger one. The falls the default alarms
  before their last update must stay alarmed before it (recall first). If the default already has the fewest false
  alarms among the factors that keep them, the default stays. Otherwise the factor is the geometric middle of the
  interval of factors that keep every such fall and have the fewest false alarms: its lower end the factor at which
  the last false alarm removed still fires, its upper end the largest factor that still keeps every fall. If no
  fall bounds that interval (it is open above), the runs cannot set the factor.
- An objective's own tuning runs set its factor when they hold at least `MIN_FALLS` runs whose gold falls and
  `MIN_HEALTHY` healthy runs, and their falls bound it. Otherwise its family's tuning runs, pooled, set it. The
  families are where the estimator's KL term acts (`Estimator.kl_in`): in the loss (GRPO, Dr. GRPO, DAPO, GSPO),
  where nothing in the reward holds the KL once the score plateaus, or in the reward (PPO, RLOO, REINFORCE++). A
  family that cannot set it either leaves the default, and an objective the grid did not run gets the default.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlhf.config.estimators import ESTIMATORS, objective_label
from rlhf.eval.overoptimisation import (
    DISTINCT_DROP,
    GOLD_FALL,
    KL_DRIFT_FACTOR,
    KL_DRIFT_NATS,
    OveroptimisationAlarm,
    alarm_inputs,
    replay,
)
from rlhf.metrics import PERIODIC_EVAL, PERIODIC_GOLD, PERIODIC_SCORE
from rlhf.tracking.client import Tracker

GROUP_DISTINCT = "group/distinct_responses"  # a training statistic (critic-free estimators with groups)
PERIODIC_KEYS = ["score", "score_std", "gold", "kl", "distinct_2", "identical_share", "near_identical_share"]
PERIODIC_KEYS += ["repetition", "ensemble_mean", "ensemble_min", "ensemble_std", "disagreement_ratio"]
HALVES = ("tuning", "held-out")


def held_out(identity: str) -> bool:
    """Whether the run `identity` names (its task, objective, KL coefficient and policy seed) is in the held-out
    half of the study: the parity of its SHA-256, fixed before the grid ran (conf/sweeps/alarm_grid.yaml)."""
    return int(hashlib.sha256(identity.encode()).hexdigest(), 16) % 2 == 1


def run_identity(experiment: str, params: dict[str, str]) -> dict[str, str]:
    """What a PPO-stage run is, from its parameters: its task (the experiment), objective, KL coefficient and
    policy seed, the identity string `held_out` reads, and the half it is in."""
    objective = objective_label(
        params.get("ppo.advantage_estimator", "gae"), params.get("ppo.importance_sampling_level", "token")
    )
    kl_coef, seed = params.get("ppo.kl_coef", "?"), params.get("seed", "?")
    identity = f"{experiment}|{objective}|kl_coef={kl_coef}|seed={seed}"
    estimator = ESTIMATORS.get(params.get("ppo.advantage_estimator", "gae"))
    return {
        "task": experiment,
        "objective": objective,
        "family": f"KL in the {estimator.kl_in}" if estimator else "?",  # where the estimator's KL term acts
        "kl_coef": kl_coef,
        "seed": seed,
        "identity": identity,
        "half": HALVES[held_out(identity)],
    }


def evaluations(history: pd.DataFrame) -> pd.DataFrame:
    """The rows of a run's merged history (periodic_eval/* and training statistics) that are periodic evaluations."""
    return history[history[PERIODIC_SCORE].notna()].reset_index(drop=True)


def _ratio_drop(values: pd.Series) -> float:
    """1 less the smallest later value over the first (step 0, the SFT policy's): how far a diversity measure fell."""
    later = values.iloc[1:].dropna()
    first = values.iloc[0]
    if later.empty or not first or first != first:
        return float("nan")
    return 1.0 - float(later.min()) / float(first)


def rule_trace(evals: pd.DataFrame) -> tuple[float, list[bool]]:
    """The alarm's rule over a run's evaluations: whether its conditions hold at each one (the alarm fires at the
    first), and the rule as one number a run can be ranked by, without gold: the largest, over the evaluations, of
    the KL-drift ratio (`OveroptimisationAlarm.kl_drift_ratio`) and the distinct-bigram condition's ratio (the SFT
    policy's distinct-2 times DISTINCT_DROP over the evaluation's); 1 or more where the rule fires."""
    alarm, best, holds = OveroptimisationAlarm(), 0.0, []
    for row in evals.to_dict("records"):
        stats = {k.removeprefix(PERIODIC_EVAL): v for k, v in row.items() if isinstance(k, str) and v == v}
        if alarm.baseline is not None:
            best = max(best, alarm.kl_drift_ratio(stats))
            base = alarm.baseline["distinct_2"]
            best = max(best, DISTINCT_DROP * base / stats["distinct_2"] if stats["distinct_2"] > 0 else float("inf"))
        alarm.check(int(row["step"]), stats)
        holds.append(bool(alarm.history[-1][1]))
    return best, holds


def _rule_score(evals: pd.DataFrame) -> float:
    return rule_trace(evals)[0]


# What each evaluation shows of a collapse, without gold (higher: more like one), for confirming the rule's alarm:
# the share of answers that are nearly another prompt's, how far the scores' spread across prompts and the distinct
# bigrams fell from the SFT policy's, the share of a group's samples that repeat another.
PER_EVALUATION: dict[str, Callable[[pd.DataFrame], pd.Series]] = {
    "near_identical_share": lambda e: e[f"{PERIODIC_EVAL}near_identical_share"],
    "identical_share": lambda e: e[f"{PERIODIC_EVAL}identical_share"],
    "score_std_fall": lambda e: 1 - e[f"{PERIODIC_EVAL}score_std"] / e[f"{PERIODIC_EVAL}score_std"].iloc[0],
    "distinct_2_fall": lambda e: 1 - e[f"{PERIODIC_EVAL}distinct_2"] / e[f"{PERIODIC_EVAL}distinct_2"].iloc[0],
    "group_repeats": lambda e: 1 - e[GROUP_DISTINCT],
}


# The gold-free signals the study ranks runs by, each higher where a run looks more like a collapse: a function of
# the run's evaluations (step 0 first)
SIGNALS: dict[str, Callable[[pd.DataFrame], float]] = {
    "rule": _rule_score,
    "near_identical_share (max)": lambda e: float(e[f"{PERIODIC_EVAL}near_identical_share"].iloc[1:].max()),
    "identical_share (max)": lambda e: float(e[f"{PERIODIC_EVAL}identical_share"].iloc[1:].max()),
    "distinct_2 (fall from SFT)": lambda e: _ratio_drop(e[f"{PERIODIC_EVAL}distinct_2"]),
    "score_std (fall from SFT)": lambda e: _ratio_drop(e[f"{PERIODIC_EVAL}score_std"]),
    "group distinct samples (1 - min)": lambda e: 1.0 - float(e[GROUP_DISTINCT].iloc[1:].min()),
    "repetition (max)": lambda e: float(e[f"{PERIODIC_EVAL}repetition"].iloc[1:].max()),
    "disagreement_ratio (max)": lambda e: float(e[f"{PERIODIC_EVAL}disagreement_ratio"].iloc[1:].max()),
}


def signal_scores(evals: pd.DataFrame) -> dict[str, float]:
    """Every signal of `SIGNALS` on one run's evaluations (NaN where the run did not log what it reads)."""
    scores = {}
    for name, signal in SIGNALS.items():
        try:
            scores[f"signal: {name}"] = signal(evals)
        except KeyError:
            scores[f"signal: {name}"] = float("nan")
    return scores


def kept_best_gold(evals: pd.DataFrame, alarm_step: int) -> float:
    """The gold of the policy `ppo.on_overoptimisation: keep_best` keeps: the evaluation before the alarm (all of
    them where it never fires) with the best conservative score (the ensemble's minimum; the score with one model)."""
    before = evals if alarm_step < 0 else evals[evals["step"] < alarm_step]
    column = f"{PERIODIC_EVAL}ensemble_min"
    score = before[column] if column in before and before[column].notna().all() else before[PERIODIC_SCORE]
    return float(before[PERIODIC_GOLD][score.idxmax()])


def alarm_table(tracker: Tracker, experiment: str, name_filter: str = "") -> pd.DataFrame:
    """One row per finished PPO-stage run with periodic_eval/gold (run names containing `name_filter`): what it is,
    the alarm replayed against its gold, the gold each ppo.on_overoptimisation keeps, and its signals. A run made
    again (the same task, objective, KL coefficient and seed) counts once: the newest."""
    rows, seen = [], set()
    for run in tracker.search_runs("tags.stage = 'train_policy_ppo' and attributes.status = 'FINISHED'"):
        identity = run_identity(experiment, run.params)
        if name_filter not in run.name or identity["identity"] in seen:
            continue
        seen.add(identity["identity"])
        keys = [f"{PERIODIC_EVAL}{k}" for k in PERIODIC_KEYS] + [GROUP_DISTINCT]
        history = tracker.metric_histories(run.run_id, keys)
        if history.empty or PERIODIC_GOLD not in history or history[PERIODIC_GOLD].isna().all():
            continue
        evals = evaluations(history)
        replayed = replay(evals.drop(columns=[GROUP_DISTINCT]))
        per_evaluation = {f"per_eval: {name}": series(evals).tolist() for name, series in PER_EVALUATION.items()}
        rows.append(
            {
                "run": run.name,
                **identity,
                **replayed,
                "gold_if_kept_best": kept_best_gold(evals, int(replayed["alarm_step"])),
                **signal_scores(evals),
                "eval_steps": evals["step"].tolist(),
                "gold_curve": evals[PERIODIC_GOLD].tolist(),
                "rule_holds": rule_trace(evals)[1],
                "factor_curve": factor_curve(evals),
                **per_evaluation,
            }
        )
    return pd.DataFrame(rows)


def confirmed_alarms(table: pd.DataFrame, signal: str, threshold: float) -> pd.Series:
    """The update each run's alarm fires at under the rule confirmed by `signal` (a `PER_EVALUATION` name): the first
    evaluation where the rule's conditions hold and the signal is at `threshold` or more (-1: never)."""

    def first(row: pd.Series) -> int:
        for step, holds, value in zip(row["eval_steps"], row["rule_holds"], row[f"per_eval: {signal}"], strict=True):
            if holds and value == value and value >= threshold:
                return int(step)
        return -1

    return table.apply(first, axis=1)


def alarm_counts(table: pd.DataFrame, alarm_steps: pd.Series) -> dict[str, int]:
    """Recall and false alarms of the alarm updates `alarm_steps` (one per run of `table`)."""
    falls = table["falls"].astype(bool)
    caught = falls & (alarm_steps >= 0) & (alarm_steps < table["last_step"])
    return {
        "falls": int(falls.sum()),
        "caught": int(caught.sum()),
        "healthy": int((~falls).sum()),
        "false_alarms": int((~falls & (alarm_steps >= 0)).sum()),
    }


def tune_confirmation(tuning: pd.DataFrame) -> list[dict[str, float | str]]:
    """For each `PER_EVALUATION` signal, the largest threshold that keeps every fall the rule alone alarms in time on
    the tuning half alarmed in time, and the false alarms left there (the signal's values on the tuning runs are the
    candidates): a confirmation can only take alarms away."""
    found = []
    caught_by_rule = alarm_counts(tuning, tuning["alarm_step"])["caught"]
    for signal in PER_EVALUATION:
        values = sorted({v for row in tuning[f"per_eval: {signal}"] for v in row if v == v}, reverse=True)
        for threshold in values:
            counts = alarm_counts(tuning, confirmed_alarms(tuning, signal, threshold))
            if counts["caught"] == caught_by_rule:
                found.append({"signal": signal, "threshold": threshold, **counts})
                break
    return sorted(found, key=lambda row: row["false_alarms"])


MIN_FALLS, MIN_HEALTHY = 2, 2  # the tuning runs an objective needs to set its own KL-drift factor (module docstring)


@dataclass(frozen=True)
class FactorCurve:
    """Where the rule's alarm fires on one run as a function of the KL-drift factor, every other threshold as it is:
    the update it fires after (-1: never) at each factor of `cuts`, where one of the KL-drift condition's
    comparisons flips, and on each open interval around them (`between`: below the first cut, between two, above the
    last). The alarm is the same everywhere inside one interval."""

    cuts: tuple[float, ...]
    at_cut: tuple[int, ...]
    between: tuple[int, ...]

    def alarm_step(self, factor: float) -> int:
        k = bisect_left(self.cuts, factor)
        if k < len(self.cuts) and self.cuts[k] == factor:
            return self.at_cut[k]
        return self.between[k]


def _alarm_step(rows: list[dict[str, float]], in_distribution_std: float, factor: float) -> int:
    alarm = OveroptimisationAlarm(in_distribution_std, factor)
    for row in rows:
        if alarm.check(int(row["step"]), row) is not None:
            return alarm.fired.step
    return -1


def factor_curve(evals: pd.DataFrame) -> FactorCurve:
    """The run's `FactorCurve`, from its evaluations (`evaluations`): the cuts are the positive ratios
    (KL_i - KL_DRIFT_NATS) / KL_j of an evaluation's KL to an earlier one's after the SFT policy's, the factors at
    which `KL_i >= factor * KL_j + KL_DRIFT_NATS` changes; the alarm is replayed at each and inside each interval."""
    rows, in_distribution_std = alarm_inputs(evals.drop(columns=[GROUP_DISTINCT], errors="ignore"))
    kls = [row.get("kl") for row in rows]
    cuts = sorted(
        {
            (kls[i] - KL_DRIFT_NATS) / kls[j]
            for i in range(len(kls))
            for j in range(1, i)
            if kls[i] is not None and kls[j] and (kls[i] - KL_DRIFT_NATS) / kls[j] > 0
        }
    )
    inside = (
        [cuts[0] / 2, *((a + b) / 2 for a, b in zip(cuts, cuts[1:], strict=False)), cuts[-1] * 2] if cuts else [1.0]
    )
    return FactorCurve(
        tuple(cuts),
        tuple(_alarm_step(rows, in_distribution_std, c) for c in cuts),
        tuple(_alarm_step(rows, in_distribution_std, f) for f in inside),
    )


def _counts_at(runs: pd.DataFrame, factor: float) -> tuple[frozenset[int], int]:
    """The falls of `runs` (by index) alarmed before their last update at the KL-drift factor `factor`, and the
    number of healthy runs alarmed."""
    steps = runs["factor_curve"].map(lambda curve: curve.alarm_step(factor))
    alarmed = steps >= 0
    falls = runs["falls"].astype(bool)
    caught = frozenset(runs.index[falls & alarmed & (steps < runs["last_step"])])
    return caught, int((~falls & alarmed).sum())


def tune_factor(runs: pd.DataFrame, default: float = KL_DRIFT_FACTOR) -> dict:
    """The KL-drift factor the runs `runs` (tuning runs, with `factor_curve`, `falls` and `last_step`) set, by the
    module docstring's rule: `factor` (None: they cannot set it: no fall bounds it), `kept` (the falls the default
    catches in time, all kept), the false alarms at the default and at `factor`, and the interval (`low`, `high`]."""
    cuts = sorted({c for curve in runs["factor_curve"] for c in curve.cuts if c > default})
    # the factor is searched at the default, every cut above it and one factor inside each interval between them
    inside = [(a + b) / 2 for a, b in zip([default, *cuts], cuts, strict=False)]
    top = 2 * cuts[-1] if cuts else 2 * default
    points = sorted({default, *cuts, *inside, top})
    target, at_default = _counts_at(runs, default)
    counted = [(f, *_counts_at(runs, f)) for f in points]
    feasible = [(f, false) for f, caught, false in counted if target <= caught]
    fewest = min(false for _, false in feasible)
    found = {"set on": len(runs), "falls kept": len(target), "false alarms at default": at_default}
    found |= {"false alarms": fewest, "low": None}
    if at_default == fewest:
        return found | {"factor": default, "high": None, "why": "the default has the fewest false alarms"}
    first = next(i for i, (_, false) in enumerate(feasible) if false == fewest)
    last = first
    while last + 1 < len(feasible) and feasible[last + 1][1] == fewest:
        last += 1
    low, high = feasible[first - 1][0], feasible[last][0]
    if high == top:
        return found | {"factor": None, "high": None, "why": "no fall bounds the factor"}
    factor = math.sqrt(low * high)
    rounded = round(factor, 2)
    factor = rounded if low < rounded <= high else factor
    why = f"between {low:.3f} (the last false alarm removed) and {high:.3f} (the last factor keeping every fall)"
    return found | {"factor": factor, "low": low, "high": high, "why": why}


def tune_kl_drift(tuning: pd.DataFrame, default: float = KL_DRIFT_FACTOR) -> pd.DataFrame:
    """One row per objective of the tuning runs `tuning` (`alarm_table`'s rows of the tuning half): its runs, falls
    and healthy runs, what set its factor (its own runs, its family's pooled runs, or the default; module docstring),
    the factor and the false alarms and falls kept on the runs that set it."""
    rows = []
    for objective, runs in tuning.groupby("objective"):
        falls, healthy = int(runs["falls"].sum()), int((~runs["falls"].astype(bool)).sum())
        own = tune_factor(runs, default) if falls >= MIN_FALLS and healthy >= MIN_HEALTHY else None
        row = {"objective": objective, "family": runs["family"].iloc[0], "runs": len(runs), "falls": falls}
        row["healthy"] = healthy
        if own is not None and own["factor"] is not None:
            rows.append(row | {"set by": "its own runs", **own})
            continue
        family = tuning[tuning["family"] == row["family"]]
        pooled = tune_factor(family, default)
        few = "too few tuning runs" if own is None else own["why"]
        if pooled["factor"] is not None:
            rows.append(row | {**pooled, "set by": f"its family ({few}): {len(family)} runs"})
        else:
            rows.append(row | {**pooled, "factor": default, "set by": f"the default ({few}; family: {pooled['why']})"})
    return pd.DataFrame(rows)


def with_factors(table: pd.DataFrame, factors: dict[str, float], default: float = KL_DRIFT_FACTOR) -> pd.DataFrame:
    """`table` with each run's alarm at its objective's KL-drift factor (`factors`; `default` for an objective not
    in it): `kl_drift_factor`, `alarm_step`, `gold_at_alarm`, `gold_if_stopped` (the gold of the evaluation before
    the alarm, the last where there is none), `lead` (updates from the alarm to the first evaluation GOLD_FALL below
    the peak so far) and `late` (the alarm came after that evaluation), the last two for runs whose gold falls."""
    out = table.copy()
    out["kl_drift_factor"] = out["objective"].map(lambda o: factors.get(o, default))
    out["alarm_step"] = [c.alarm_step(f) for c, f in zip(out["factor_curve"], out["kl_drift_factor"], strict=True)]

    def gold(row: pd.Series, before: bool) -> float:
        steps, curve = row["eval_steps"], row["gold_curve"]
        if row["alarm_step"] < 0:
            return float(curve[-1]) if before else float("nan")
        i = steps.index(row["alarm_step"])
        return float(curve[i - 1] if before else curve[i])

    out["gold_at_alarm"] = out.apply(gold, axis=1, before=False)
    out["gold_if_stopped"] = out.apply(gold, axis=1, before=True)
    caught = out["falls"].astype(bool) & (out["alarm_step"] >= 0) & (out["alarm_step"] < out["last_step"])
    out["lead"] = (out["fall_step"] - out["alarm_step"]).where(caught)
    out["late"] = caught & (out["alarm_step"] > out["fall_step"])
    return out


def factor_report(table: pd.DataFrame) -> pd.DataFrame:
    """Per objective and over all runs of `table` (`with_factors`' output): runs whose gold falls and those alarmed
    before their last update, healthy runs and those alarmed, late alarms, the lead times, the mean gold of the
    policy 'stop' keeps."""

    def figures(runs: pd.DataFrame) -> dict:
        falls = runs["falls"].astype(bool)
        caught = falls & (runs["alarm_step"] >= 0) & (runs["alarm_step"] < runs["last_step"])
        return {
            "factor": ", ".join(f"{f:g}" for f in sorted(set(runs["kl_drift_factor"]))),
            "falls": int(falls.sum()),
            "alarmed": int(caught.sum()),
            "healthy": int((~falls).sum()),
            "false alarms": int((~falls & (runs["alarm_step"] >= 0)).sum()),
            "late": int(runs["late"].sum()),
            "leads": [int(x) for x in runs.loc[caught, "lead"]],
            "gold with stop": float(runs["gold_if_stopped"].mean()),
        }

    rows = [{"objective": objective, **figures(runs)} for objective, runs in table.groupby("objective")]
    return pd.DataFrame([*rows, {"objective": "all", **figures(table)}]).set_index("objective")


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


def choice_table(table: pd.DataFrame) -> pd.DataFrame:
    """The mean gold of what each ppo.on_overoptimisation keeps, per objective and over all runs."""
    modes = {"warn": "gold_final", "stop": "gold_if_stopped", "keep_best": "gold_if_kept_best", "(peak)": "gold_peak"}
    grouped = table.groupby("objective")[list(modes.values())].mean()
    grouped.loc["all runs"] = table[list(modes.values())].mean()
    grouped.columns = list(modes)
    grouped["runs"] = table.groupby("objective").size().reindex(grouped.index).fillna(len(table)).astype(int)
    return grouped


def summary_lines(table: pd.DataFrame) -> list[str]:
    """Recall (runs whose gold falls, alarmed before their last evaluation), false alarms and lead times, over all
    runs and per objective."""
    falls, healthy = table[table["falls"]], table[~table["falls"]]
    caught = falls[(falls["alarm_step"] >= 0) & (falls["alarm_step"] < falls["last_step"])]
    leads = (caught["fall_step"] - caught["alarm_step"]).tolist()
    lines = [
        f"runs whose gold falls {GOLD_FALL} or more below its peak: {len(falls)}, alarmed: {len(caught)}",
        f"healthy runs: {len(healthy)}, alarmed: {int((healthy['alarm_step'] >= 0).sum())}",
        f"lead time (updates from the alarm to the gold's fall): {leads}",
        f"mean gold, final policy {table['gold_final'].mean():.3f}; the policy 'stop' keeps "
        f"{table['gold_if_stopped'].mean():.3f}; 'keep_best' keeps {table['gold_if_kept_best'].mean():.3f}",
    ]
    if "objective" in table:
        for objective, runs in table.groupby("objective"):
            ok = runs[~runs["falls"]]
            fell = runs[runs["falls"]]
            hit = fell[(fell["alarm_step"] >= 0) & (fell["alarm_step"] < fell["last_step"])]
            lines.append(
                f"  {objective}: falls {len(fell)} (alarmed {len(hit)}), healthy {len(ok)} "
                f"(alarmed {int((ok['alarm_step'] >= 0).sum())})"
            )
    return lines


def _counts(counts: dict) -> str:
    return (
        f"falls alarmed {counts['caught']} of {counts['falls']}, false alarms {counts['false_alarms']} of "
        f"{counts['healthy']}"
    )


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--experiment", action="append", help="an experiment to read (repeat for several)")
    parser.add_argument("--filter", default="", help="only runs whose name contains this")
    parser.add_argument("--half", choices=[*HALVES, "all"], default="all", help="only the runs of this half")
    parser.add_argument("--out", help="also write the table to this CSV file")
    parser.add_argument("--roc", help="also draw the ROC curves of the signals into this PNG file")
    args = parser.parse_args(argv)
    experiments = args.experiment or ["rlhf-ppo"]
    tables = [alarm_table(Tracker(args.tracking_uri, name), name, args.filter) for name in experiments]
    every = (
        pd.concat([t for t in tables if not t.empty], ignore_index=True)
        if any(not t.empty for t in tables)
        else pd.DataFrame()
    )
    table = every
    if not table.empty and args.half != "all":
        table = table[table["half"] == args.half].reset_index(drop=True)
    if table.empty:
        print("no PPO run with periodic evaluations and a gold reward")
        return
    traces = ("reasons", "identity", "eval_steps", "gold_curve", "rule_holds", "factor_curve")
    shown = [c for c in table.columns if c not in traces and not c.startswith(("signal: ", "per_eval: "))]
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 40):
        print(table[shown].round(3).to_string(index=False))
        print("\n".join(summary_lines(table)))
        print("\nwhat each ppo.on_overoptimisation keeps (mean gold):")
        print(choice_table(table).round(3).to_string())
        print("\nthe signals, against 'gold fell':")
        print(separation_table(table).round(3).to_string(index=False))
        halves = {half: table[table["half"] == half] for half in HALVES}
        if all(len(rows) for rows in halves.values()):
            print("\nthe rule confirmed by one signal, its threshold set on the tuning half, on the held-out half:")
            for tuned in tune_confirmation(halves["tuning"]):
                held = alarm_counts(
                    halves["held-out"], confirmed_alarms(halves["held-out"], tuned["signal"], tuned["threshold"])
                )
                print(
                    f"  {tuned['signal']} >= {tuned['threshold']:.3f}: tuning {_counts(tuned)}; "
                    f"held-out {_counts(held)}"
                )
        tuning = every[every["half"] == "tuning"]
        if len(tuning):
            factors = tune_kl_drift(tuning)
            print(f"\nthe KL-drift factor per objective, set on the {len(tuning)} runs of the tuning half:")
            print("(set on, falls kept, false alarms: on the runs that set the factor, its own or its family's)")
            columns = ["family", "runs", "falls", "healthy", "set on", "falls kept", "false alarms at default"]
            columns += ["false alarms", "factor"]
            print(factors.set_index("objective")[columns].round(3).to_string())
            for row in factors.to_dict("records"):
                print(f"  {row['objective']}: {row['factor']:g}, set by {row['set by']}; {row['why']}")
            tuned = dict(zip(factors["objective"], factors["factor"], strict=True))
            for name, chosen in (("the default factor for every objective", {}), ("the factor per objective", tuned)):
                print(f"\n{name}, on the {args.half} runs ({len(table)}):")
                print(factor_report(with_factors(table, chosen)).round(3).to_string())
    if args.out:
        table.drop(columns=["factor_curve"]).to_csv(args.out, index=False)
    if args.roc:
        roc_picture(table, Path(args.roc), f"{len(table)} runs ({args.half}), {', '.join(experiments)}")


if __name__ == "__main__":
    main()
