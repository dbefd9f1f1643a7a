"""The over-optimisation alarm checked against gold (rlhf.sweeps.alarm_check): runs written into a real MLflow store
(SQLite in a temporary folder) with hand-made evaluation histories, read back, replayed and tabulated."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf.eval.overoptimisation import KL_DRIFT_FACTOR, OveroptimisationAlarm, alarm_inputs, replay
from rlhf.sweeps import alarm_check, alarm_factors
from rlhf.tracking.client import Tracker

# updates 0, 10, ..., 50: (score, gold, KL, distinct-2, near-identical share, score std, group distinct share)
COLLAPSE = [
    (-0.2, 0.0, 0.0, 0.30, 0.00, 1.0, None),
    (1.5, 0.8, 3.0, 0.28, 0.05, 0.6, 0.95),
    (1.9, 0.95, 5.0, 0.25, 0.10, 0.4, 0.9),
    (1.91, 0.9, 9.0, 0.20, 0.60, 0.2, 0.6),  # the score stalls while the KL runs on: the rule fires here (30)
    (1.92, 0.5, 14.0, 0.15, 0.90, 0.1, 0.4),  # gold 0.45 below its peak: the fall (40)
    (1.93, -0.5, 20.0, 0.08, 1.00, 0.05, 0.26),
]
HEALTHY = [
    (-0.2, 0.0, 0.0, 0.30, 0.00, 1.0, None),
    (1.0, 0.6, 2.0, 0.29, 0.00, 0.9, 0.98),
    (1.5, 0.8, 3.0, 0.28, 0.02, 0.8, 0.97),
    (1.7, 0.85, 3.5, 0.27, 0.02, 0.8, 0.97),
    (1.8, 0.9, 3.8, 0.27, 0.03, 0.7, 0.96),
    (1.85, 0.9, 4.0, 0.26, 0.03, 0.7, 0.96),
]


def _log_run(tracker: Tracker, name: str, estimator: str, seed: int, points) -> None:
    run_id = tracker.start_run(name, tags={"stage": "train_policy_ppo"})
    tracker.log_params(run_id, {"ppo.advantage_estimator": estimator, "ppo.kl_coef": 0.05, "seed": seed})
    for i, (score, gold, kl, distinct, near, spread, group) in enumerate(points):
        step = 10 * i
        metrics = {
            "periodic_eval/score": score,
            "periodic_eval/gold": gold,
            "periodic_eval/kl": kl,
            "periodic_eval/distinct_2": distinct,
            "periodic_eval/identical_share": 0.0,
            "periodic_eval/near_identical_share": near,
            "periodic_eval/repetition": 0.1,
            "periodic_eval/score_std": spread,
        }
        tracker.log_metrics(run_id, metrics, step)
        if group is not None:  # training statistics at every update, the evaluation's among them
            for update in range(step - 9, step + 1):
                tracker.log_metrics(run_id, {"group/distinct_responses": group, "objective/scores": score}, update)
    tracker.end_run(run_id)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, Tracker]:
    uri = f"sqlite:///{tmp_path_factory.mktemp('alarm') / 'mlflow.db'}"
    tracker = Tracker(uri, "rlhf-ppo")
    _log_run(tracker, "grid-00/ppo", "grpo", 51, HEALTHY)  # made again below: the newer run counts
    _log_run(tracker, "grid-00/ppo", "grpo", 51, COLLAPSE)
    _log_run(tracker, "grid-01/ppo", "gae", 51, HEALTHY)
    _log_run(tracker, "other/ppo", "gae", 52, HEALTHY)
    unfinished = tracker.start_run("grid-02/ppo", tags={"stage": "train_policy_ppo"})
    tracker.log_metrics(unfinished, {"periodic_eval/score": 0.0, "periodic_eval/gold": 0.0}, 0)
    return uri, tracker


def test_the_table_replays_the_alarm_and_what_each_setting_keeps(store):
    _, tracker = store
    table = alarm_check.alarm_table(tracker, "rlhf-ppo", "grid").set_index("objective")
    assert sorted(table.index) == ["GRPO", "PPO"]  # the unfinished run and the filtered one are left out
    collapse, healthy = table.loc["GRPO"], table.loc["PPO"]
    assert collapse["falls"] and collapse["fall_step"] == 40 and collapse["alarm_step"] == 30
    assert collapse["gold_final"] == -0.5 and collapse["gold_if_stopped"] == 0.95  # update 20's policy
    assert collapse["gold_if_kept_best"] == 0.95  # the best score before the alarm: update 20's too
    assert not healthy["falls"] and healthy["alarm_step"] == -1
    assert healthy["gold_if_stopped"] == healthy["gold_final"] == 0.9
    assert healthy["gold_if_kept_best"] == 0.9  # the best score: update 50's
    # the signals read the evaluations only (update 0 is the SFT policy's)
    assert collapse["signal: near_identical_share (max)"] == 1.0
    assert collapse["signal: distinct_2 (fall from SFT)"] == pytest.approx(1 - 0.08 / 0.30)
    assert collapse["signal: score_std (fall from SFT)"] == pytest.approx(0.95)
    assert collapse["signal: group distinct samples (1 - min)"] == pytest.approx(0.74)
    assert collapse["signal: rule"] >= 1 > healthy["signal: rule"]
    # at update 50 the score has stalled since update 40 only (+0.05, under 5% of the 2.0 gained by then)
    assert healthy["signal: rule"] == pytest.approx(4.0 / (1.5 * 3.8 + 1))
    assert pd.isna(healthy["signal: disagreement_ratio (max)"])  # one reward model: nothing to read
    assert collapse["task"] == "rlhf-ppo" and collapse["seed"] == "51" and collapse["half"] in alarm_check.HALVES


def test_the_split_is_fixed_by_what_a_run_is():
    # pinned: a change to the identity's wording or the hash would move runs between the halves after the fact
    assert alarm_check.held_out("rlhf-ppo|GRPO|kl_coef=0.05|seed=51") is True
    assert alarm_check.held_out("rlhf-ppo|GRPO|kl_coef=0.05|seed=52") is False
    identities = [f"rlhf-ppo|PPO|kl_coef=0.05|seed={s}" for s in range(200)]
    assert 80 < sum(map(alarm_check.held_out, identities)) < 120  # about half


def test_auc_and_the_summaries():
    scores, falls = pd.Series([0.9, 0.8, 0.3, 0.3, float("nan")]), pd.Series([True, False, True, False, True])
    # positives 0.9 and 0.3 (the NaN left out) against negatives 0.8 and 0.3: 1 + 1 + 0 + 0.5 of 4
    assert alarm_check.auc(scores, falls) == pytest.approx(2.5 / 4)
    assert pd.isna(alarm_check.auc(scores, pd.Series([False] * 5)))


def test_the_command_prints_the_study_and_draws_the_roc(store, tmp_path, capsys):
    uri, _ = store
    roc, out = tmp_path / "roc.png", tmp_path / "table.csv"
    alarm_check.main(["--tracking-uri", uri, "--filter", "grid", "--roc", str(roc), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "runs whose gold falls 0.2 or more below its peak: 1, alarmed: 1" in printed
    assert (
        "healthy runs: 1, alarmed: 0" in printed
        and "lead time (updates from the alarm to the gold's fall): [10]" in printed
    )
    assert "keep_best" in printed and "near_identical_share (max)" in printed
    assert roc.stat().st_size > 10_000 and len(pd.read_csv(out)) == 2


def test_a_signal_that_confirms_the_rule_is_tuned_on_one_half(store):
    _, tracker = store
    table = alarm_check.alarm_table(tracker, "rlhf-ppo", "grid").sort_values("objective").reset_index(drop=True)
    assert table["rule_holds"][0] == [False, False, False, True, True, True]  # GRPO: from update 30 on
    assert table["eval_steps"][0] == [0, 10, 20, 30, 40, 50]
    assert alarm_check.confirmed_alarms(table, "near_identical_share", 0.5).tolist() == [30, -1]
    # update 50 is the last: an alarm there comes too late for the fall, so 1.0 is too strict and 0.9 (update 40) is
    # the largest threshold that keeps the fall caught
    assert alarm_check.confirmed_alarms(table, "near_identical_share", 1.0).tolist() == [50, -1]
    tuned = {row["signal"]: row for row in alarm_check.tune_confirmation(table)}
    assert tuned["near_identical_share"]["threshold"] == 0.9 and tuned["near_identical_share"]["false_alarms"] == 0
    assert tuned["score_std_fall"]["threshold"] == pytest.approx(0.9)  # update 40's spread: 0.1 of the SFT's 1.0
    counts = alarm_check.alarm_counts(table, pd.Series([40, 10]))
    assert counts == {"falls": 1, "caught": 1, "healthy": 1, "false_alarms": 1}


def _curve(*pieces) -> alarm_factors.FactorCurve:
    """A hand-made FactorCurve: (factor, update) pieces, ascending: the alarm fires after `update` for every factor up
    to `factor` (and above the previous piece's); never above the last."""
    cuts = tuple(f for f, _ in pieces)
    steps = tuple(s for _, s in pieces)
    return alarm_factors.FactorCurve(cuts, steps, (*steps, -1))


def _tuning_table() -> pd.DataFrame:
    always = alarm_factors.FactorCurve((), (), (50,))  # the distinct-bigram condition: at any factor
    rows = [
        # GRPO: two falls, three healthy runs
        ("GRPO", "KL in the loss", True, _curve((3.0, 30), (4.0, 100))),  # at 4.0 it comes at the last update
        ("GRPO", "KL in the loss", True, always),
        ("GRPO", "KL in the loss", False, _curve((2.0, 40))),
        ("GRPO", "KL in the loss", False, _curve((1.6, 20))),
        ("GRPO", "KL in the loss", False, _curve((3.5, 60))),  # removing it would lose the first fall
        # Dr. GRPO: one fall only, so its family sets its factor
        ("Dr. GRPO", "KL in the loss", True, always),
        ("Dr. GRPO", "KL in the loss", False, _curve((1.7, 30))),
        ("Dr. GRPO", "KL in the loss", False, _curve((1.5, 30))),
        # RLOO: no fall, and no fall of its family bounds the factor (PPO's falls fire at any factor): the default
        ("RLOO", "KL in the reward", False, _curve((1.8, 30))),
        ("PPO", "KL in the reward", True, always),
        ("PPO", "KL in the reward", True, always),
        ("PPO", "KL in the reward", False, _curve((1.9, 40))),
        ("PPO", "KL in the reward", False, alarm_factors.FactorCurve((), (), (-1,))),
    ]
    table = pd.DataFrame(rows, columns=["objective", "family", "falls", "factor_curve"])
    table["last_step"] = 100
    table["fall_step"] = [40 if fall else -1 for fall in table["falls"]]
    table["eval_steps"] = [list(range(0, 110, 10))] * len(table)
    table["gold_curve"] = [[0.1 * k for k in range(11)]] * len(table)
    return table


def test_the_factor_curve_is_the_replayed_alarm_at_every_factor():
    keys = ["score", "gold", "kl", "distinct_2", "near_identical_share", "score_std"]
    evals = pd.DataFrame([dict(zip(keys, point[:6], strict=True)) for point in COLLAPSE]).add_prefix("periodic_eval/")
    evals.insert(0, "step", range(0, 60, 10))
    curve = alarm_factors.factor_curve(evals)
    # KL 0, 3, 5, 9, 14, 20 with the score stalled from update 20 (1.9): at 30 the KL must reach f * 5 + 1, at 40
    # and 50 likewise; at 50 the distinct bigrams (0.08 of the SFT's 0.30) fire whatever the factor
    assert {8 / 5, 13 / 5, 19 / 5} <= set(curve.cuts)
    for factor in (1.0, 1.5, 1.6, 1.61, 2.0, 2.6, 2.61, 3.8, 3.81, 10.0):
        assert curve.alarm_step(factor) == replay(evals, factor)["alarm_step"], factor
    assert [curve.alarm_step(f) for f in (1.6, 1.61, 2.6, 2.61, 3.81)] == [30, 40, 40, 50, 50]


def test_the_factor_keeps_every_fall_and_removes_the_false_alarms_it_can():
    table = _tuning_table()
    grpo = alarm_factors.tune_factor(table[table["objective"] == "GRPO"])
    # every fall stays alarmed up to 3.0; the false alarms at 1.6 and 2.0 go above 2.0: the middle of (2.0, 3.0]
    assert (grpo["low"], grpo["high"], grpo["factor"]) == (2.0, 3.0, 2.45)
    assert (grpo["falls kept"], grpo["false alarms at default"], grpo["false alarms"]) == (2, 3, 1)
    tuned = alarm_factors.tune_kl_drift(table).set_index("objective")
    assert tuned.loc["GRPO", "factor"] == 2.45 and tuned.loc["GRPO", "set by"] == "its own runs"
    # one fall: the family's eight runs set it; the fall at 3.0 bounds it again and the false alarm at 3.5 stays
    assert tuned.loc["Dr. GRPO", "factor"] == 2.45 and tuned.loc["Dr. GRPO", "set by"].startswith("its family")
    assert tuned.loc["Dr. GRPO", "false alarms"] == 1 and tuned.loc["Dr. GRPO", "false alarms at default"] == 5
    # PPO's falls fire at any factor: nothing bounds it, in its own runs or its family's, so the default stays
    assert tuned.loc["PPO", "factor"] == tuned.loc["RLOO", "factor"] == KL_DRIFT_FACTOR
    assert tuned.loc["RLOO", "set by"].startswith("the default")
    # the tuned factors on the runs: every fall alarmed before its last update, one false alarm left (the GRPO run
    # at 3.5) of the loss family and two (1.8, 1.9) of the reward family's default
    report = alarm_factors.factor_report(alarm_factors.with_factors(table, dict(tuned["factor"])))
    assert (report.loc["all", "falls"], report.loc["all", "alarmed"], report.loc["all", "false alarms"]) == (5, 5, 3)
    assert report.loc["GRPO", "leads"] == [10, -10] and report.loc["GRPO", "late"] == 1  # the fall at 40, alarms 30, 50
    # a factor above the first fall's last keeping one (3.0) loses it: alarmed at the last update only
    assert alarm_factors.with_factors(table, {"GRPO": 3.01}).loc[0, "alarm_step"] == 100
    default = alarm_factors.factor_report(alarm_factors.with_factors(table, {}))
    assert default.loc["all", "false alarms"] == 7 and default.loc["GRPO", "gold with stop"] == pytest.approx(
        (0.2 + 0.4 + 0.3 + 0.1 + 0.5) / 5
    )


def _plateau_history() -> pd.DataFrame:
    """An evaluation history whose score plateaus from update 20 (2.0) while the KL keeps growing (5, 9, 20), and
    whose gold peaks at 20 (0.9) and falls 0.3 by 40."""
    return pd.DataFrame(
        {
            "step": [0, 10, 20, 30, 40],
            "periodic_eval/score": [0.0, 1.0, 2.0, 2.01, 2.02],
            "periodic_eval/kl": [0.0, 2.0, 5.0, 9.0, 20.0],
            "periodic_eval/gold": [0.0, 0.5, 0.9, 0.8, 0.6],
            "periodic_eval/distinct_2": [0.5] * 5,
            "periodic_eval/identical_share": [0.0] * 5,
            "periodic_eval/repetition": [0.0] * 5,
        }
    )


def test_replay_judges_a_logged_history_against_gold():
    row = replay(_plateau_history())
    assert (row["gold_peak"], row["peak_step"], row["gold_final"]) == (0.9, 20, 0.6)
    assert row["falls"] and row["fall_step"] == 40  # 0.6 <= 0.9 - 0.2
    # at 30: KL 9 >= 1.5 * 5 + 1 = 8.5 and the score moved +0.01 < 5% of the 2.0 gained by update 20
    assert row["alarm_step"] == 30 and row["gold_at_alarm"] == 0.8 and row["gold_if_stopped"] == 0.9
    assert "grew from 5.0 (update 20) to 9.0" in row["reasons"]


def test_the_alarm_and_replay_apply_the_factor_they_are_given():
    # at 30, KL 9 >= 1.5 * 5 + 1 but not 2 * 5 + 1
    history = _plateau_history()
    assert OveroptimisationAlarm().kl_drift_factor == KL_DRIFT_FACTOR == 1.5
    assert replay(history)["alarm_step"] == 30
    assert replay(history, 2.0)["alarm_step"] == 40 and "to 20.0" in replay(history, 2.0)["reasons"]
    assert replay(history, 3.9)["alarm_step"] == -1  # 20 < 3.9 * 5 + 1
    alarm = OveroptimisationAlarm(kl_drift_factor=2.0)
    rows, _ = alarm_inputs(history)
    assert [alarm.check(int(row["step"]), row) is not None for row in rows] == [False, False, False, False, True]
    # the analysis's factor per objective: an objective not in the table gets the default
    table = _tuning_table()
    factors = alarm_factors.with_factors(table, {"GRPO": 2.45})["kl_drift_factor"]
    assert set(factors[table["objective"] == "GRPO"]) == {2.45}
    assert set(factors[table["objective"] != "GRPO"]) == {KL_DRIFT_FACTOR}
