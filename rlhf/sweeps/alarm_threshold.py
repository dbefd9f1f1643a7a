"""The over-optimisation alarm's thresholds set on the tuning half of the alarm's grid (`rlhf.sweeps.alarm_check`,
which reports them on either half; docs/overoptimisation.md): the surprisal condition's (`SURPRISAL_RISE`), and a
gold-free signal's that would confirm the rule (`tune_confirmation`).

**The surprisal threshold** (`tune_surprisal_rise`). The rule (docs/overoptimisation.md says when each step was
fixed): the thresholds searched are the surprisal rises the tuning runs' evaluations reach (the alarm's outcome on
those runs changes only there). First recall: the most runs whose gold falls alarmed before their last update. Then
the fewest false alarms among the healthy runs. Then the most gold kept by `ppo.on_overoptimisation: stop` (the
default: what the policy a user gets is worth). The threshold is the middle of the interval of thresholds with that
outcome (arithmetic: nats add), rounded to 0.05 nats where that stays inside it. Every other condition of the rule
(the KL drift, distinct bigrams, the ensemble's) stays as it is.
"""

from __future__ import annotations

import pandas as pd

from rlhf.eval.overoptimisation import SURPRISAL_RISE, kept_index, replay_alarm


def with_threshold(table: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """`table` (`alarm_check.alarm_table`'s, with `alarm_inputs`) with each run's alarm at `threshold`:
    `surprisal_rise`, `alarm_step` (-1: none), `gold_at_alarm`, `gold_if_stopped` (the gold of the policy `stop`
    keeps, `kept_index`), `lead` (updates from the alarm to the first evaluation GOLD_FALL below the peak so far) and
    `late` (the alarm came after that evaluation), the last two for runs whose gold falls."""
    out = table.copy()
    out["surprisal_rise"] = threshold
    alarms = [replay_alarm(*inputs, surprisal_rise=threshold) for inputs in out["alarm_inputs"]]
    out["alarm_step"] = [alarm.fired.step if alarm.fired else -1 for alarm in alarms]
    out["gold_at_alarm"] = [
        float(curve[steps.index(alarm.fired.step)]) if alarm.fired else float("nan")
        for alarm, steps, curve in zip(alarms, out["eval_steps"], out["gold_curve"], strict=True)
    ]
    out["gold_if_stopped"] = [
        float(curve[kept_index(alarm)]) for alarm, curve in zip(alarms, out["gold_curve"], strict=True)
    ]
    caught = out["falls"].astype(bool) & (out["alarm_step"] >= 0) & (out["alarm_step"] < out["last_step"])
    out["lead"] = (out["fall_step"] - out["alarm_step"]).where(caught)
    out["late"] = caught & (out["alarm_step"] > out["fall_step"])
    return out


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


def _outcome(table: pd.DataFrame) -> tuple[int, int, float]:
    """(falls alarmed before their last update, false alarms, the mean gold of the policies 'stop' keeps) of
    `with_threshold`'s output."""
    counts = alarm_counts(table, table["alarm_step"])
    return counts["caught"], counts["false_alarms"], round(float(table["gold_if_stopped"].mean()), 6)


def tune_surprisal_rise(tuning: pd.DataFrame) -> dict:
    """The threshold the tuning runs set by the module's rule: `threshold`, the interval (`low`, `high`] that gives
    its outcome, and that outcome (`falls`, `caught`, `healthy`, `false_alarms`, `gold_with_stop`)."""
    rises = sorted(
        {
            row["ref_surprisal"] - stats[0]["ref_surprisal"]
            for stats, _ in tuning["alarm_inputs"]
            for row in stats[1:]
            if "ref_surprisal" in row and "ref_surprisal" in stats[0]
        }
    )
    outcomes = [_outcome(with_threshold(tuning, t)) for t in rises]
    best = max(outcomes, key=lambda o: (o[0], -o[1], o[2]))
    first = outcomes.index(best)
    last = first
    while last + 1 < len(outcomes) and outcomes[last + 1] == best:
        last += 1  # the outcome holds for thresholds in (rises[first - 1], rises[last]]
    low = rises[first - 1] if first > 0 else 0.0
    high = rises[last]
    middle = (low + high) / 2
    rounded = round(middle / 0.05) * 0.05
    falls = int(tuning["falls"].astype(bool).sum())
    return {
        "threshold": rounded if low < rounded <= high else middle,
        "low": low,
        "high": high,
        "falls": falls,
        "caught": best[0],
        "healthy": len(tuning) - falls,
        "false_alarms": best[1],
        "gold_with_stop": best[2],
        "default": SURPRISAL_RISE,
    }


def confirmed_alarms(table: pd.DataFrame, signal: str, threshold: float) -> pd.Series:
    """The update each run's alarm fires at under the rule confirmed by `signal` (its values at each evaluation in
    the table's `per_eval: <signal>` column): the first evaluation where the rule's conditions hold and the signal is
    at `threshold` or more (-1: never)."""

    def first(row: pd.Series) -> int:
        for step, holds, value in zip(row["eval_steps"], row["rule_holds"], row[f"per_eval: {signal}"], strict=True):
            if holds and value == value and value >= threshold:
                return int(step)
        return -1

    return table.apply(first, axis=1)


def tune_confirmation(tuning: pd.DataFrame) -> list[dict[str, float | str]]:
    """For each signal of the table (its `per_eval: <signal>` columns), the largest threshold that keeps every fall
    the rule alone alarms in time on the tuning half alarmed in time, and the false alarms left there (the signal's
    values on the tuning runs are the candidates): a confirmation can only take alarms away."""
    found = []
    caught_by_rule = alarm_counts(tuning, tuning["alarm_step"])["caught"]
    for signal in [c.removeprefix("per_eval: ") for c in tuning.columns if c.startswith("per_eval: ")]:
        values = sorted({v for row in tuning[f"per_eval: {signal}"] for v in row if v == v}, reverse=True)
        for threshold in values:
            counts = alarm_counts(tuning, confirmed_alarms(tuning, signal, threshold))
            if counts["caught"] == caught_by_rule:
                found.append({"signal": signal, "threshold": threshold, **counts})
                break
    return sorted(found, key=lambda row: row["false_alarms"])


def threshold_report(table: pd.DataFrame) -> pd.DataFrame:
    """Per objective and over all runs of `table` (`with_threshold`'s output): runs whose gold falls and those
    alarmed before their last update, healthy runs and those alarmed, late alarms, the lead times, the mean gold of
    the policy 'stop' keeps."""

    def figures(runs: pd.DataFrame) -> dict:
        falls = runs["falls"].astype(bool)
        caught = falls & (runs["alarm_step"] >= 0) & (runs["alarm_step"] < runs["last_step"])
        return {
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
