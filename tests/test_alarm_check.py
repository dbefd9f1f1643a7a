"""The over-optimisation alarm checked against gold (rlhf.sweeps.alarm_check): runs written into a real MLflow store
(SQLite in a temporary folder) with hand-made evaluation histories, read back, replayed and tabulated."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf.eval.overoptimisation import (
    CONFIRM,
    JUMP_PER_KL,
    KL_DRIFT_FACTOR,
    SURPRISAL_JUMP,
    SURPRISAL_RISE,
    OveroptimisationAlarm,
    alarm_inputs,
    replay,
)
from rlhf.sweeps import alarm_check, alarm_signals, alarm_threshold
from rlhf.tracking.client import Tracker

# updates 0, 10, ..., 50: (score, gold, KL, distinct-2, near-identical share, score std, group distinct share, the
# reference's surprisal at the response tokens in nats per token)
COLLAPSE = [
    (-0.2, 0.0, 0.0, 0.30, 0.00, 1.0, None, 1.0),
    (1.5, 0.8, 3.0, 0.28, 0.05, 0.6, 0.95, 1.2),
    (1.9, 0.95, 5.0, 0.25, 0.10, 0.4, 0.9, 1.3),
    (1.91, 0.9, 9.0, 0.20, 0.60, 0.2, 0.6, 2.5),  # the tokens 1.5 nats more surprising than SFT's: it fires (30)
    (1.92, 0.5, 14.0, 0.15, 0.90, 0.1, 0.4, 4.0),  # gold 0.45 below its peak: the fall (40)
    (1.93, -0.5, 20.0, 0.08, 1.00, 0.05, 0.26, 6.0),
]
HEALTHY = [  # the KL grows as the policy sharpens onto what the SFT model writes: the surprisal barely moves
    (-0.2, 0.0, 0.0, 0.30, 0.00, 1.0, None, 1.0),
    (1.0, 0.6, 2.0, 0.29, 0.00, 0.9, 0.98, 1.1),
    (1.5, 0.8, 3.0, 0.28, 0.02, 0.8, 0.97, 1.2),
    (1.7, 0.85, 3.5, 0.27, 0.02, 0.8, 0.97, 1.3),
    (1.8, 0.9, 6.0, 0.27, 0.03, 0.7, 0.96, 1.35),
    (1.85, 0.9, 9.0, 0.26, 0.03, 0.7, 0.96, 1.4),
]


def _log_run(tracker: Tracker, name: str, estimator: str, seed: int, points) -> None:
    run_id = tracker.start_run(name, tags={"stage": "train_policy_ppo"})
    tracker.log_params(run_id, {"ppo.advantage_estimator": estimator, "ppo.kl_coef": 0.05, "seed": seed})
    for i, (score, gold, kl, distinct, near, spread, group, surprisal) in enumerate(points):
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
            "periodic_eval/ref_surprisal": surprisal,
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
    # the rule holds at 30 (the surprisal 1.5 nats up, the score stalled) and again at 40: confirmed there
    assert collapse["falls"] and collapse["fall_step"] == 40 and collapse["alarm_step"] == 40
    assert collapse["gold_final"] == -0.5 and collapse["gold_if_stopped"] == 0.95  # update 20's policy, not 30's
    assert collapse["quiet"] == [True, True, True, False, False, False]
    assert collapse["gold_if_kept_best"] == 0.95  # the best score before the alarm: update 20's too
    assert not healthy["falls"] and healthy["alarm_step"] == -1
    assert healthy["gold_if_stopped"] == healthy["gold_final"] == 0.9
    assert healthy["gold_if_kept_best"] == 0.9  # the best score: update 50's
    # the signals read the evaluations only (update 0 is the SFT policy's)
    assert collapse["signal: near_identical_share (max)"] == 1.0
    assert collapse["signal: distinct_2 (fall from SFT)"] == pytest.approx(1 - 0.08 / 0.30)
    assert collapse["signal: score_std (fall from SFT)"] == pytest.approx(0.95)
    assert collapse["signal: group distinct samples (1 - min)"] == pytest.approx(0.74)
    assert collapse["signal: ref_surprisal, its rise from SFT's (max)"] == pytest.approx(5.0)
    assert collapse["signal: rule"] >= 1 > healthy["signal: rule"]
    # the healthy run's closest approach: its KL at update 50 (9.0) against 1.5 times update 40's (6.0) plus 1, the
    # score having stalled since (+0.05, under 5% of the 2.0 gained by then)
    assert healthy["signal: rule"] == pytest.approx(9.0 / (1.5 * 6.0 + 1))
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
    assert alarm_signals.auc(scores, falls) == pytest.approx(2.5 / 4)
    assert pd.isna(alarm_signals.auc(scores, pd.Series([False] * 5)))


def test_the_command_prints_the_study_and_draws_the_roc(store, tmp_path, capsys):
    uri, _ = store
    roc, out = tmp_path / "roc.png", tmp_path / "table.csv"
    alarm_check.main(["--tracking-uri", uri, "--filter", "grid", "--roc", str(roc), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "runs whose gold falls 0.2 or more below its peak: 1, alarmed: 1" in printed
    assert (
        "healthy runs: 1, alarmed: 0" in printed
        and "lead time (updates from the alarm to the gold's fall): [0]" in printed
    )
    assert "keep_best" in printed and "near_identical_share (max)" in printed
    assert roc.stat().st_size > 10_000 and len(pd.read_csv(out)) == 2


def test_a_signal_that_confirms_the_rule_is_tuned_on_one_half(store):
    _, tracker = store
    table = alarm_check.alarm_table(tracker, "rlhf-ppo", "grid").sort_values("objective").reset_index(drop=True)
    assert table["rule_holds"][0] == [False, False, False, True, True, True]  # GRPO: from update 30 on
    assert table["eval_steps"][0] == [0, 10, 20, 30, 40, 50]
    assert alarm_threshold.confirmed_alarms(table, "near_identical_share", 0.5).tolist() == [30, -1]
    # update 50 is the last: an alarm there comes too late for the fall, so 1.0 is too strict and 0.9 (update 40) is
    # the largest threshold that keeps the fall caught
    assert alarm_threshold.confirmed_alarms(table, "near_identical_share", 1.0).tolist() == [50, -1]
    tuned = {row["signal"]: row for row in alarm_threshold.tune_confirmation(table)}
    assert tuned["near_identical_share"]["threshold"] == 0.9 and tuned["near_identical_share"]["false_alarms"] == 0
    assert tuned["score_std_fall"]["threshold"] == pytest.approx(0.9)  # update 40's spread: 0.1 of the SFT's 1.0
    counts = alarm_threshold.alarm_counts(table, pd.Series([40, 10]))
    assert counts == {"falls": 1, "caught": 1, "healthy": 1, "false_alarms": 1}


def _threshold_table() -> pd.DataFrame:
    """Hand-made tuning runs for the surprisal threshold: each run's evaluations at updates 0, 10, ..., 100 with
    the reference's surprisal rising from 1.0 to its peak at update 30 and staying there (the distinct bigrams
    steady), and whether its gold falls (at update 40)."""
    rows = [(True, 2.5), (True, 1.6), (False, 1.5), (False, 0.8), (False, 0.3)]
    table = pd.DataFrame(rows, columns=["falls", "peak"])

    def inputs(peak: float) -> tuple[list[dict[str, float]], float]:
        surprisal = [1.0, 1.0, 1.0] + [1.0 + peak] * 8
        score = [0.0, 1.0, 2.0] + [2.0] * 8  # stalled from update 20; the KL (5) does not drift
        return [
            {"step": 10 * k, "distinct_2": 0.3, "ref_surprisal": x, "score": y, "kl": min(k, 2) * 2.5}
            for k, (x, y) in enumerate(zip(surprisal, score, strict=True))
        ], 0.0

    table["alarm_inputs"] = [inputs(peak) for peak in table["peak"]]
    table["objective"] = "GRPO"
    table["last_step"] = 100
    table["fall_step"] = [40 if fall else -1 for fall in table["falls"]]
    table["eval_steps"] = [list(range(0, 110, 10))] * len(table)
    table["gold_curve"] = [[0.1 * k for k in range(11)]] * len(table)
    return table


def test_the_surprisal_threshold_keeps_every_fall_and_removes_the_false_alarms_it_can():
    table = _threshold_table()
    tuned = alarm_threshold.tune_surprisal_rise(table)
    # both falls stay alarmed up to 1.6; above 1.5 the healthy run at 1.5 is quiet: the middle of (1.5, 1.6]
    assert (tuned["low"], tuned["high"]) == pytest.approx((1.5, 1.6))
    assert tuned["threshold"] == pytest.approx(1.55) and tuned["default"] == SURPRISAL_RISE
    assert (tuned["falls"], tuned["caught"], tuned["healthy"], tuned["false_alarms"]) == (2, 2, 3, 0)
    at_default = alarm_threshold.with_threshold(table, SURPRISAL_RISE)
    assert at_default["alarm_step"].tolist() == [40, 40, 40, -1, -1]  # the rule from 30, confirmed at 40
    report = alarm_threshold.threshold_report(at_default)
    assert (report.loc["all", "alarmed"], report.loc["all", "false alarms"], report.loc["all", "late"]) == (2, 1, 0)
    assert report.loc["GRPO", "leads"] == [0, 0]
    assert report.loc["all", "gold with stop"] == pytest.approx((0.2 * 3 + 1.0 * 2) / 5)  # update 20's, or the last
    assert alarm_threshold.with_threshold(table, 1.61)["alarm_step"].tolist() == [40, -1, -1, -1, -1]


def _plateau_history(surprisal: list[float], kl: tuple[float, ...] = (0.0, 2.0, 5.0, 5.5, 6.0)) -> pd.DataFrame:
    """An evaluation history whose score plateaus from update 20 (2.0), with the KL `kl` (by default it stops
    growing with the score) and the reference's surprisal `surprisal` at each evaluation, and whose gold peaks at 20
    (0.9) and falls 0.3 by 40."""
    return pd.DataFrame(
        {
            "step": [0, 10, 20, 30, 40],
            "periodic_eval/score": [0.0, 1.0, 2.0, 2.01, 2.02],
            "periodic_eval/kl": list(kl),
            "periodic_eval/gold": [0.0, 0.5, 0.9, 0.8, 0.6],
            "periodic_eval/distinct_2": [0.5] * 5,
            "periodic_eval/identical_share": [0.0] * 5,
            "periodic_eval/repetition": [0.0] * 5,
            "periodic_eval/ref_surprisal": surprisal,
        }
    )


KL_RUNS_ON = (0.0, 2.0, 5.0, 9.0, 20.0)  # the score stalled from update 20 while the KL runs on


def test_replay_judges_a_logged_history_against_gold():
    row = replay(_plateau_history([1.1, 1.2, 1.3, 2.5, 4.0]), confirm=1)
    assert (row["gold_peak"], row["peak_step"], row["gold_final"]) == (0.9, 20, 0.6)
    assert row["falls"] and row["fall_step"] == 40  # 0.6 <= 0.9 - 0.2
    # at 30 the SFT model finds the tokens 1.4 nats more surprising each than its own samples (1.1)
    assert row["alarm_step"] == 30 and row["gold_at_alarm"] == 0.8 and row["gold_if_stopped"] == 0.9
    assert "1.40 nats more surprising each than its own samples, 2.50 against 1.10 nats at step 0" in row["reasons"]
    shipped = replay(_plateau_history([1.1, 1.2, 1.3, 2.5, 4.0]))  # the rule confirmed at 40, the same policy kept
    assert shipped["alarm_step"] == 40 and shipped["gold_if_stopped"] == 0.9
    assert "4.00 against 1.10" in shipped["reasons"]


def test_each_condition_catches_its_own_kind_of_drift():
    # each condition where it first holds (one evaluation, no confirmation)
    # the tokens stay as likely under the SFT model (a rise of 1.25 < 1.3) and the KL stops with the score: quiet
    assert replay(_plateau_history([1.1, 1.0, 0.9, 1.2, 2.35]), confirm=1)["alarm_step"] == -1
    # a rise of 1.35: it fires
    assert replay(_plateau_history([1.1, 1.0, 0.9, 1.2, 2.45]), confirm=1)["alarm_step"] == 40
    # the same tokens' surprisal while the KL runs on with the score stalled: the KL-drift condition fires at 30,
    # where KL 9 >= 1.5 * 5 + 1 = 8.5 and the score moved +0.01 < 5% of the 2.0 gained by update 20
    row = replay(_plateau_history([1.1, 1.0, 0.9, 1.2, 1.3], KL_RUNS_ON), confirm=1)
    assert row["alarm_step"] == 30 and "grew from 5.0 (update 20) to 9.0" in row["reasons"]
    # the surprisal waits for the score to stall: `make run`'s PPO passes through short answers the SFT model finds
    # 2 nats more surprising at update 10 while its score climbs, and recovers (gold -0.9 there, 0.91 at the end)
    transient = _plateau_history([1.04, 3.06, 3.15, 1.17, 1.05])
    transient["periodic_eval/score"] = [0.0, 1.71, 1.87, 1.9, 1.91]
    assert replay(transient, confirm=1)["alarm_step"] == -1
    transient["periodic_eval/ref_surprisal"] = [1.04, 3.06, 3.15, 3.2, 3.3]  # still there once the score stalls
    assert replay(transient, confirm=1)["alarm_step"] == 30
    # a run logged without the surprisal: that condition cannot hold, the others still can
    history = _plateau_history([float("nan")] * 5)
    assert replay(history, confirm=1)["alarm_step"] == -1
    history["periodic_eval/distinct_2"] = [0.5, 0.5, 0.5, 0.5, 0.1]
    distinct = replay(history, confirm=1)
    assert distinct["alarm_step"] == 40 and "distinct bigrams 0.10" in distinct["reasons"]


def test_the_alarm_and_replay_apply_the_threshold_they_are_given():
    history = _plateau_history([1.1, 1.2, 1.3, 2.5, 4.0])
    assert OveroptimisationAlarm().surprisal_rise == SURPRISAL_RISE == 1.3
    assert OveroptimisationAlarm().kl_drift_factor == KL_DRIFT_FACTOR == 1.5
    shipped = OveroptimisationAlarm()
    shipped_levers = (shipped.confirm, shipped.surprisal_jump, shipped.jump_per_kl)
    assert shipped_levers == (CONFIRM, SURPRISAL_JUMP, JUMP_PER_KL) == (2, 0.02, 0.06)
    at_two = replay(history, surprisal_rise=2.0, confirm=1)
    assert at_two["alarm_step"] == 40 and "4.00 against 1.10" in at_two["reasons"]
    assert replay(history, surprisal_rise=3.0)["alarm_step"] == -1  # 4.0 - 1.1 < 3
    alarm = OveroptimisationAlarm(surprisal_rise=2.0, confirm=1)
    rows, _ = alarm_inputs(history)
    assert [alarm.check(int(row["step"]), row) is not None for row in rows] == [False, False, False, False, True]


def test_older_runs_get_the_surprisal_from_their_training_rollouts():
    # evaluations at 0, 10, 20 logged without periodic_eval/ref_surprisal; training's objective/ref_logprobs at
    # updates 1 to 21 (-1 - update / 10): the evaluation after s updates reads updates s - 3 to s + 1
    steps = sorted({0, 10, 20} | set(range(1, 22)))
    history = pd.DataFrame({"step": steps})
    history["periodic_eval/score"] = [1.0 if s in (0, 10, 20) else float("nan") for s in steps]
    history["objective/ref_logprobs"] = [-1 - s / 10 if s >= 1 else float("nan") for s in steps]
    filled = alarm_check.evaluations(alarm_check.with_training_surprisal(history))
    assert filled["periodic_eval/ref_surprisal"].tolist() == pytest.approx([1.1, 1.0 + 0.9, 1.0 + 1.9])
    logged = history.assign(**{"periodic_eval/ref_surprisal": [7.0] * len(steps)})
    assert alarm_check.with_training_surprisal(logged)["periodic_eval/ref_surprisal"].eq(7.0).all()  # left as is
