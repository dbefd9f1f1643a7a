"""The over-optimisation alarm checked against gold: every PPO-stage run with periodic evaluations and a gold
reward in an MLflow experiment, its gold curve and where the alarm fires (docs/overoptimisation.md).

    python -m rlhf.sweeps.alarm_check --tracking-uri sqlite:///mlruns/mlflow.db --experiment rlhf-ppo [--out t.csv]

Each run's alarm is replayed from its logged periodic_eval/* history with today's rule (`rlhf.eval.overoptimisation`),
so runs logged before a change of the rule are judged by the new one. Prints one row a run and the recall, false
alarms and lead times.
"""

from __future__ import annotations

import argparse

import pandas as pd

from rlhf.eval.overoptimisation import GOLD_FALL, replay
from rlhf.metrics import PERIODIC_GOLD
from rlhf.tracking.client import Tracker


def alarm_table(tracker: Tracker, name_filter: str = "") -> pd.DataFrame:
    """One row per finished PPO-stage run with periodic_eval/gold (run names containing `name_filter`)."""
    rows = []
    for run in tracker.search_runs("tags.stage = 'train_policy_ppo'"):
        if name_filter not in run.name:
            continue
        keys = ["score", "gold", "kl", "distinct_2", "identical_share", "repetition"]
        keys += ["ensemble_mean", "ensemble_min", "ensemble_std", "disagreement_ratio"]
        history = tracker.metric_histories(run.run_id, [f"periodic_eval/{k}" for k in keys])
        if history.empty or PERIODIC_GOLD not in history or history[PERIODIC_GOLD].isna().all():
            continue
        rows.append({"run": run.name, **replay(history)})
    return pd.DataFrame(rows)


def summary_lines(table: pd.DataFrame) -> list[str]:
    """Recall (runs whose gold falls, alarmed before their last evaluation), false alarms and lead times."""
    falls, healthy = table[table["falls"]], table[~table["falls"]]
    caught = falls[(falls["alarm_step"] >= 0) & (falls["alarm_step"] < falls["last_step"])]
    leads = (caught["fall_step"] - caught["alarm_step"]).tolist()
    return [
        f"runs whose gold falls {GOLD_FALL} or more below its peak: {len(falls)}, alarmed: {len(caught)}",
        f"healthy runs: {len(healthy)}, alarmed: {int((healthy['alarm_step'] >= 0).sum())}",
        f"lead time (updates from the alarm to the gold's fall): {leads}",
        f"mean gold, final policy {table['gold_final'].mean():.3f}; the policy 'stop' keeps "
        f"{table['gold_if_stopped'].mean():.3f}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--experiment", default="rlhf-ppo")
    parser.add_argument("--filter", default="", help="only runs whose name contains this")
    parser.add_argument("--out", help="also write the table to this CSV file")
    args = parser.parse_args(argv)
    table = alarm_table(Tracker(args.tracking_uri, args.experiment), args.filter)
    if table.empty:
        print("no PPO run with periodic evaluations and a gold reward")
        return
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 60):
        print(table.drop(columns=["reasons"]).round(3).to_string(index=False))
    print("\n".join(summary_lines(table)))
    if args.out:
        table.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()
