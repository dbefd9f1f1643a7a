"""The over-optimisation alarm's KL-drift factor per objective, tuned on the tuning half of the alarm's grid
(`rlhf.sweeps.alarm_check`, which reports it on either half; docs/overoptimisation.md).

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

import math
from bisect import bisect_left
from dataclasses import dataclass

import pandas as pd

from rlhf.eval.overoptimisation import KL_DRIFT_FACTOR, KL_DRIFT_NATS, OveroptimisationAlarm, alarm_inputs

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
    """The run's `FactorCurve`, from its periodic evaluations (`alarm_check.evaluations`, without training
    statistics): the cuts are the positive ratios
    (KL_i - KL_DRIFT_NATS) / KL_j of an evaluation's KL to an earlier one's after the SFT policy's, the factors at
    which `KL_i >= factor * KL_j + KL_DRIFT_NATS` changes; the alarm is replayed at each and inside each interval."""
    rows, in_distribution_std = alarm_inputs(evals)
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
