"""The alarm's held-out check of the shipped `stop` (docs/overoptimisation.md, "With the defaults, how good is the
policy you get?"): what `stop` kept of each run made with it, beside what `warn` reaches at the same seed
(`shipped_table`, `alarm_check --shipped`), and the sweep that makes the alarmed runs again with `warn`
(`warn_reruns`, `alarm_check --warn-reruns`). Shares and collapses as ``rlhf.sweeps.alarm_kept`` counts them."""

from __future__ import annotations

import argparse

import pandas as pd

from rlhf.config.estimators import objective_label
from rlhf.errors import ConfigError
from rlhf.eval.overoptimisation import GOLD_FALL
from rlhf.sweeps.alarm_kept import KEPT_COLUMNS, gain_share, markdown, trained_to_end
from rlhf.sweeps.space import SweepSpace


def shipped_table(table: pd.DataFrame, warn: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per run of `alarm_check.alarm_table` made with the shipped `stop` (the alarm's held-out check): SFT's
    gold, the best periodic gold the run passed through (to where it stopped), the update the alarm fired after (-1:
    never), the gold of the policy `stop` kept (`gold_if_stopped`, the replay of `EvalGuard`'s pick, which
    tests/test_periodic_eval.py holds to the guard's), its share of that best gain (`gain_share`) and whether it ends
    collapsed (GOLD_FALL or more below that best); beside it what `warn` reaches at the same seed: the run's own
    final gold where the alarm never fired (it trained to its end), else the final gold and the best of the run of
    the same task, objective, KL coefficient and seed in `warn` (NaN without one)."""
    runs = table[table["mode"] == "stop"]
    made = (
        {} if warn is None or warn.empty else warn.set_index("identity")[["gold_final", "gold_peak"]].to_dict("index")
    )
    out = pd.DataFrame({c: runs[c] for c in KEPT_COLUMNS if c in runs and c not in ("sft", "best", "half")})
    out["sft"], out["best"], out["alarm"] = runs["gold_start"], runs["gold_peak"], runs["alarm_step"]
    out["stop"] = runs["gold_if_stopped"]
    out["stop share"] = [gain_share(k, s, b) for k, s, b in zip(out["stop"], out["sft"], out["best"], strict=True)]
    out["stop collapsed"] = out["best"] - out["stop"] >= GOLD_FALL - 1e-9
    nan = {"gold_final": float("nan"), "gold_peak": float("nan")}
    other = [None if end else made.get(i, nan) for i, end in zip(runs["identity"], trained_to_end(runs), strict=True)]
    out["warn"] = [r["gold_final"] if r else f for r, f in zip(other, runs["gold_final"], strict=True)]
    out["warn best"] = [r["gold_peak"] if r else b for r, b in zip(other, runs["gold_peak"], strict=True)]
    return out.reset_index(drop=True)


def shipped_summary(shipped: pd.DataFrame) -> pd.DataFrame:
    """`shipped_table` per estimator, per task and over all runs: the runs, the alarms, the mean share of the best
    gain `stop` kept, the worst run's, the runs that end collapsed, and the mean gold of SFT, `stop` and `warn`."""
    rows = {}
    groups = [(str(name), runs) for by in ("objective", "task") for name, runs in shipped.groupby(by)]
    for name, runs in [*groups, ("all runs", shipped)]:
        shares = runs["stop share"]
        rows[name] = {
            "runs": len(runs),
            "alarms": int((runs["alarm"] >= 0).sum()),
            "stop: mean share": shares.mean(),
            "stop: worst": f"{shares.min():.2f} ({runs.loc[shares.idxmin(), 'run']})" if shares.notna().any() else "-",
            "stop: collapsed": int(runs["stop collapsed"].sum()),
            "SFT gold": runs["sft"].mean(),
            "stop gold": runs["stop"].mean(),
            "warn gold": runs["warn"].mean(),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def shipped_report(made: pd.DataFrame, warn: pd.DataFrame) -> str:
    """`alarm_check --shipped`: `shipped_table` of the runs `made` with the shipped stop, beside the `warn` runs of
    their seeds, and its `shipped_summary`, as markdown."""
    if made.empty or not (made["mode"] == "stop").any():
        return "no run made with ppo.on_overoptimisation: stop"
    shipped = shipped_table(made, warn[warn["mode"] == "warn"] if "mode" in warn else None)
    shown = [c for c in shipped.columns if c != "stop collapsed"]
    return "\n".join(
        [
            f"what the shipped stop kept, {len(shipped)} runs (share: (kept - SFT) / (best passed through - SFT)):\n",
            markdown(shipped[shown].set_index("run")),
            "\nper estimator, per task and over all runs:\n",
            markdown(shipped_summary(shipped)),
        ]
    )


def warn_reruns(made: pd.DataFrame, space: SweepSpace) -> dict:
    """The sweep space (`flows.sweep`'s, as YAML would hold it) that makes again with `warn`, to its end, each run of
    `made` (`alarm_check.alarm_table`'s rows of the sweep `space` ran with `stop`) whose alarm fired: its arm, found
    by the objective its overrides give, at its KL coefficient and policy seed. Named after `space` with `_warn`
    added, so that a name filter of `space`'s runs (`<name>-`) leaves the reruns out."""
    if made["task"].nunique() > 1:
        raise ConfigError(
            f"sweep {space.name}: --warn-reruns reads one task's runs, not {sorted(made['task'].unique())}"
        )
    if {p.key for p in space.parameters} != {"ppo.kl_coef", "policy_seed"}:
        raise ConfigError(f"sweep {space.name}: --warn-reruns reads a grid over ppo.kl_coef and policy_seed only")
    arms = {}
    for arm in space.arms:
        level = arm.overrides.get("ppo.importance_sampling_level", "token")
        arms[objective_label(arm.overrides.get("ppo.advantage_estimator", "gae"), level)] = arm.overrides
    reruns = []
    for _, run in made[(made["mode"] == "stop") & ~trained_to_end(made)].iterrows():
        if run["objective"] not in arms:
            raise ConfigError(f"run {run['run']}: no arm of sweep {space.name} trains {run['objective']}")
        overrides = {**arms[run["objective"]], "ppo.kl_coef": float(run["kl_coef"]), "policy_seed": int(run["seed"])}
        name = f"{run['objective']} kl {run['kl_coef']} seed {run['seed']}"
        reruns.append({"name": name, "overrides": {**overrides, "ppo.on_overoptimisation": "warn"}})
    return {"name": f"{space.name}_warn", "method": "grid", "arms": reruns}


def add_shipped_arguments(parser: argparse.ArgumentParser) -> None:
    """`alarm_check`'s options for a check of the shipped `stop` (`shipped_report`, `warn_reruns`)."""
    parser.add_argument(
        "--shipped",
        metavar="WARN_FILTER",
        help="print what the shipped stop kept of the runs made with it (--filter's), beside the warn runs of the "
        "same seeds among those whose name contains WARN_FILTER (rlhf.sweeps.alarm_shipped.shipped_table)",
    )
    parser.add_argument(
        "--warn-reruns",
        metavar="SPACE",
        help="print the sweep space (YAML) that makes again with warn the runs of --filter the sweep SPACE made with "
        "stop whose alarm fired, one task at a time (rlhf.sweeps.alarm_shipped.warn_reruns)",
    )
