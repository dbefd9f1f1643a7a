"""The over-optimisation alarm checked against gold: every PPO-stage run with periodic evaluations and a gold
reward in MLflow experiments, its gold curve, where the alarm fires, what each `ppo.on_overoptimisation` keeps, and
how well each gold-free signal tells the runs whose gold falls from the rest (docs/overoptimisation.md).

    python -m rlhf.sweeps.alarm_check --experiment rlhf-ppo [--experiment rlhf-overoptimisation] [--filter NAME]
        [--half held-out] [--out table.csv] [--roc roc.png] [--kept [kept.png]]

Each run's alarm is replayed from its logged periodic_eval/* history with today's rule (`rlhf.eval.overoptimisation`),
so runs logged before a change of the rule are judged by the new one. Every run belongs to one half of the study,
"tuning" or "held-out", fixed by what the run is (`held_out`) before any run is looked at: thresholds are chosen on
the tuning half and reported on the held-out one.

Runs logged before the periodic evaluation measured the reference's surprisal (periodic_eval/ref_surprisal) get it
from their training statistics (`with_training_surprisal`). The surprisal threshold, set on the tuning half:
`rlhf.sweeps.alarm_threshold`. How well each signal separates the runs that fall (AUCs, ROC curves):
`rlhf.sweeps.alarm_signals`.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import yaml

from rlhf.config.estimators import ESTIMATORS, objective_label
from rlhf.errors import ConfigError
from rlhf.eval.overoptimisation import (
    DISTINCT_DROP,
    GOLD_FALL,
    SURPRISAL_RISE,
    OveroptimisationAlarm,
    alarm_inputs,
    replay,
)
from rlhf.metrics import PERIODIC_EVAL, PERIODIC_GOLD, PERIODIC_REF_SURPRISAL, PERIODIC_SCORE
from rlhf.sweeps import alarm_kept, alarm_shipped
from rlhf.sweeps.alarm_kept import keep_best_index
from rlhf.sweeps.alarm_signals import roc_picture, separation_table
from rlhf.sweeps.alarm_threshold import (
    alarm_counts,
    confirmed_alarms,
    threshold_report,
    tune_confirmation,
    tune_surprisal_rise,
    with_threshold,
)
from rlhf.sweeps.space import load_space
from rlhf.tracking.client import Tracker

GROUP_DISTINCT = "group/distinct_responses"  # a training statistic (critic-free estimators with groups)
TRAINING_REF_LOGPROBS = "objective/ref_logprobs"  # a training statistic: mean per-token log p_ref of the rollouts
TRAINING_KEYS = [GROUP_DISTINCT, TRAINING_REF_LOGPROBS]
PERIODIC_KEYS = ["score", "score_std", "gold", "kl", "distinct_2", "identical_share", "near_identical_share"]
PERIODIC_KEYS += ["repetition", "ensemble_mean", "ensemble_min", "ensemble_std", "disagreement_ratio", "ref_surprisal"]
SURPRISAL_WINDOW = 5  # updates of training rollouts that stand in for an evaluation's surprisal (older runs)
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


def with_training_surprisal(history: pd.DataFrame) -> pd.DataFrame:
    """`history` (a run's merged history) with periodic_eval/ref_surprisal filled in where the run did not log it,
    from the training rollouts: -objective/ref_logprobs averaged over the SURPRISAL_WINDOW updates whose rollouts
    the policy of the evaluation after `step` updates made or was next to (the statistic logged at update u is of
    rollouts made after u - 1 updates, so the evaluation at step 0 gets update 1's: the SFT policy's own samples)."""
    out = history.copy()
    if TRAINING_REF_LOGPROBS not in out or out[TRAINING_REF_LOGPROBS].isna().all():
        return out
    if PERIODIC_REF_SURPRISAL not in out:
        out[PERIODIC_REF_SURPRISAL] = float("nan")
    training = out.set_index("step")[TRAINING_REF_LOGPROBS].dropna()
    for i in out.index[out[PERIODIC_SCORE].notna() & out[PERIODIC_REF_SURPRISAL].isna()]:
        step = int(out.at[i, "step"])
        window = training[(training.index <= step + 1) & (training.index > step + 1 - SURPRISAL_WINDOW)]
        if len(window):
            out.at[i, PERIODIC_REF_SURPRISAL] = -float(window.mean())
    return out


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
    the surprisal condition's ratio (the rise over SURPRISAL_RISE), the KL-drift ratio
    (`OveroptimisationAlarm.kl_drift_ratio`) and the distinct-bigram condition's (the SFT policy's distinct-2 times
    DISTINCT_DROP over the evaluation's); 1 or more where a condition's threshold is passed (the rule fires there,
    but for the surprisal condition before the score has stalled)."""
    alarm, best, holds = OveroptimisationAlarm(), 0.0, []
    for row in evals.to_dict("records"):
        stats = {k.removeprefix(PERIODIC_EVAL): v for k, v in row.items() if isinstance(k, str) and v == v}
        if alarm.baseline is not None:
            rise = alarm.surprisal_rise_of(stats)
            best = max(best, alarm.kl_drift_ratio(stats), rise / SURPRISAL_RISE if rise == rise else 0.0)
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
    "ref_surprisal_rise": lambda e: e[PERIODIC_REF_SURPRISAL] - e[PERIODIC_REF_SURPRISAL].iloc[0],
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
    "ref_surprisal, its rise from SFT's (max)": lambda e: float(
        (e[PERIODIC_REF_SURPRISAL].iloc[1:] - e[PERIODIC_REF_SURPRISAL].iloc[0]).max()
    ),
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


def kept_best_gold(evals: pd.DataFrame, quiet: list[bool], alarm_step: int) -> float:
    """The gold of the policy `ppo.on_overoptimisation: keep_best` keeps (`alarm_kept.keep_best_index`: the
    `quiet` evaluation before the alarm, all of them where it never fires, with the best conservative score)."""
    picked = keep_best_index(evals, quiet, alarm_step)
    return float(evals[PERIODIC_GOLD].iloc[-1 if picked is None else picked])


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
        keys = [f"{PERIODIC_EVAL}{k}" for k in PERIODIC_KEYS] + TRAINING_KEYS
        history = tracker.metric_histories(run.run_id, keys)
        if history.empty or PERIODIC_GOLD not in history or history[PERIODIC_GOLD].isna().all():
            continue
        evals = evaluations(with_training_surprisal(history))
        periodic = evals.drop(columns=TRAINING_KEYS)
        replayed = replay(periodic)
        per_evaluation = {f"per_eval: {name}": series(evals).tolist() for name, series in PER_EVALUATION.items()}
        rows.append(
            {
                "run": run.name,
                **identity,
                "mode": run.params.get("ppo.on_overoptimisation", ""),  # '': logged before the setting
                **replayed,
                "gold_if_kept_best": kept_best_gold(evals, replayed["quiet"], int(replayed["alarm_step"])),
                **signal_scores(evals),
                "eval_steps": evals["step"].tolist(),
                "gold_curve": evals[PERIODIC_GOLD].tolist(),
                "rule_holds": rule_trace(evals)[1],
                "alarm_inputs": alarm_inputs(periodic),
                **per_evaluation,
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--experiment", action="append", help="an experiment to read (repeat for several)")
    parser.add_argument("--filter", action="append", help="only runs whose name contains this (again: or that)")
    parser.add_argument("--half", choices=[*HALVES, "all"], default="all", help="only the runs of this half")
    parser.add_argument("--out", help="also write the table to this CSV file")
    parser.add_argument("--roc", help="also draw the ROC curves of the signals into this PNG file")
    parser.add_argument(
        "--kept",
        nargs="?",
        const="",
        help="also print what each ppo.on_overoptimisation keeps of the runs trained to their end (alarm_kept."
        "trained_to_end), as markdown tables, and draw their share of the best gain into this PNG file if named",
    )
    alarm_kept.add_lever_arguments(parser)
    alarm_shipped.add_shipped_arguments(parser)
    args = parser.parse_args(argv)
    experiments = args.experiment or ["rlhf-ppo"]
    filters = args.filter or [""]
    if args.shipped is not None or args.warn_reruns:  # the runs of --filter made with stop
        made = [alarm_table(Tracker(args.tracking_uri, n), n, f) for n in experiments for f in filters]
        made = pd.concat(made, ignore_index=True)
        if args.warn_reruns:
            try:
                print(yaml.safe_dump(alarm_shipped.warn_reruns(made, load_space(args.warn_reruns)), sort_keys=False))
            except ConfigError as err:  # one sentence, exit code 2
                parser.exit(2, f"error: {err}\n")
            return
        warn = [alarm_table(Tracker(args.tracking_uri, n), n, args.shipped) for n in experiments]
        print(alarm_shipped.shipped_report(made, pd.concat(warn, ignore_index=True)))
        return
    tables = [alarm_table(Tracker(args.tracking_uri, name), name, part) for name in experiments for part in filters]
    table = every = pd.concat([t for t in tables if not t.empty] or [pd.DataFrame()], ignore_index=True)
    if not table.empty and args.half != "all":
        table = table[table["half"] == args.half].reset_index(drop=True)
    if table.empty:
        print("no PPO run with periodic evaluations and a gold reward")
        return
    traces = ("reasons", "identity", "eval_steps", "gold_curve", "rule_holds", "alarm_inputs", "quiet")
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
            tuned = tune_surprisal_rise(tuning)
            print(
                f"\nthe surprisal threshold set on the {len(tuning)} runs of the tuning half: {tuned['threshold']:g} "
                f"nats per token (the interval ({tuned['low']:.3f}, {tuned['high']:.3f}] alarms {tuned['caught']} of "
                f"{tuned['falls']} falls in time with {tuned['false_alarms']} false alarms of {tuned['healthy']}); "
                f"the alarm's: {tuned['default']:g}"
            )
            print(f"\nthe alarm ({tuned['default']:g}), on the {args.half} runs ({len(table)}):")
            print(threshold_report(with_threshold(table, tuned["default"])).round(3).to_string())
    if args.kept is not None:
        title = f"{len(table)} runs ({args.half}), {', '.join(experiments)}"
        print("\n".join(alarm_kept.report(table, args.kept, title, alarm_kept.given_levers(args))))
    if args.out:
        table.drop(columns=["alarm_inputs"]).to_csv(args.out, index=False)
    if args.roc:
        roc_picture(table, Path(args.roc), f"{len(table)} runs ({args.half}), {', '.join(experiments)}")


if __name__ == "__main__":
    main()
