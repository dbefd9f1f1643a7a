"""What each ppo.on_overoptimisation keeps (rlhf.sweeps.alarm_kept, `alarm_check --kept`): hand-made runs written into
a real MLflow store (SQLite in a temporary folder), read back, replayed, and their kept gold checked against what is
computed here by hand."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml

from rlhf.sweeps import alarm_check, alarm_kept, alarm_shipped
from rlhf.sweeps.space import parse_space
from rlhf.tracking.client import Tracker
from tests.conftest import REPO

# evaluations at updates 0, 10, ..., 50: (score, gold, KL, the reference's surprisal in nats per token); distinct-2
# stays at 0.3, so only the surprisal condition can fire (the KL never drifts 1.5 times past an earlier one)
FALLS = [  # the score stalls from update 20; from 40 the surprisal is 1.5 nats above SFT's: the alarm fires at 50
    (-0.2, 0.1, 0.0, 1.0),
    (1.5, 0.6, 2.0, 1.1),
    (1.9, 0.9, 3.0, 1.2),  # the best score before the alarm: keep_best keeps this (gold 0.9, the run's best)
    (1.88, 0.8, 3.2, 1.3),  # the last quiet evaluation before the alarm: stop keeps this (gold 0.8)
    (1.92, 0.3, 3.4, 2.5),
    (1.93, -0.5, 3.5, 3.0),  # warn keeps the last update's (gold -0.5)
]
HEALTHY = [  # no alarm: warn and stop keep the last update's (0.9, the best); keep_best the best score's (40: 0.85)
    (-0.2, 0.0, 0.0, 1.0),
    (1.0, 0.5, 1.0, 1.0),
    (1.5, 0.7, 2.0, 1.0),
    (1.7, 0.8, 2.5, 1.0),
    (1.9, 0.85, 3.0, 1.0),
    (1.85, 0.9, 3.2, 1.0),
]
NO_GAIN = [  # never better than SFT (0.2) and no alarm (the score climbs throughout): every mode keeps -0.5
    (-0.2, 0.2, 0.0, 1.0),
    (0.5, 0.1, 1.0, 1.0),
    (1.0, 0.0, 2.0, 1.0),
    (1.5, -0.1, 3.0, 1.0),
    (2.0, -0.3, 4.0, 1.0),
    (2.5, -0.5, 5.0, 1.0),
]


def _log_run(tracker: Tracker, name: str, estimator: str, points, mode: str | None = "warn") -> None:
    run_id = tracker.start_run(name, tags={"stage": "train_policy_ppo"})
    params = {"ppo.advantage_estimator": estimator, "ppo.kl_coef": 0.05, "seed": 61}
    if mode is not None:
        params["ppo.on_overoptimisation"] = mode
    tracker.log_params(run_id, params)
    for i, (score, gold, kl, surprisal) in enumerate(points):
        metrics = {
            "periodic_eval/score": score,
            "periodic_eval/gold": gold,
            "periodic_eval/kl": kl,
            "periodic_eval/distinct_2": 0.3,
            "periodic_eval/identical_share": 0.0,
            "periodic_eval/near_identical_share": 0.0,
            "periodic_eval/repetition": 0.1,
            "periodic_eval/score_std": 1.0,
            "periodic_eval/ref_surprisal": surprisal,
        }
        tracker.log_metrics(run_id, metrics, 10 * i)
    tracker.end_run(run_id)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    uri = f"sqlite:///{tmp_path_factory.mktemp('kept') / 'mlflow.db'}"
    default = Tracker(uri, "rlhf-ppo")
    _log_run(default, "grid-falls/ppo", "grpo", FALLS)
    _log_run(default, "grid-healthy/ppo", "gae", HEALTHY, mode=None)  # logged before the setting: trained to its end
    _log_run(default, "grid-stopped/ppo", "rloo", FALLS[:5], mode="stop")  # stopped at 40: not in the kept table
    _log_run(Tracker(uri, "rlhf-overoptimisation"), "grid-no-gain/ppo", "rloo", NO_GAIN)
    return uri


def _tables(uri: str) -> pd.DataFrame:
    return pd.concat(
        [alarm_check.alarm_table(Tracker(uri, name), name, "grid") for name in ("rlhf-ppo", "rlhf-overoptimisation")],
        ignore_index=True,
    )


def test_each_mode_keeps_what_the_guard_would_have(store):
    table = _tables(store)
    assert sorted(table["mode"]) == ["", "stop", "warn", "warn"]
    kept = alarm_kept.kept_table(table).set_index("run")
    assert sorted(kept.index) == ["grid-falls/ppo", "grid-healthy/ppo", "grid-no-gain/ppo"]  # the stopped run left out
    falls, healthy, no_gain = kept.loc["grid-falls/ppo"], kept.loc["grid-healthy/ppo"], kept.loc["grid-no-gain/ppo"]
    assert table.set_index("run").loc["grid-falls/ppo", "alarm_step"] == 50  # the rule held at 40 and 50
    assert (falls["sft"], falls["best"]) == (0.1, 0.9)
    assert (falls["warn"], falls["stop"], falls["keep_best"]) == (-0.5, 0.8, 0.9)
    assert falls["warn share"] == pytest.approx((-0.5 - 0.1) / 0.8)  # -0.75
    assert falls["stop share"] == pytest.approx(0.7 / 0.8) and falls["keep_best share"] == pytest.approx(1.0)
    assert (falls["warn collapsed"], falls["stop collapsed"], falls["keep_best collapsed"]) == (True, False, False)
    # no alarm: warn and stop keep the last update's policy, keep_best the best score's (update 40's)
    assert (healthy["warn"], healthy["stop"], healthy["keep_best"]) == (0.9, 0.9, 0.85)
    assert healthy["keep_best share"] == pytest.approx(0.85 / 0.9) and healthy["stop share"] == 1.0
    assert not healthy[["warn collapsed", "stop collapsed", "keep_best collapsed"]].any()
    # no gain over SFT: the share is undefined (NaN), the loss still counts as a collapse
    assert (no_gain["sft"], no_gain["best"], no_gain["warn"], no_gain["keep_best"]) == (0.2, 0.2, -0.5, -0.5)
    assert all(math.isnan(no_gain[f"{mode} share"]) for mode in alarm_kept.MODES)
    assert no_gain[["warn collapsed", "stop collapsed", "keep_best collapsed"]].all()


def test_stop_runs_whose_alarm_never_fired_trained_to_their_end(tmp_path):
    """A `stop` run whose alarm never fired trained to its end as a `warn` run would have, and a `keep_best` run
    trains on past its alarm: both are in the kept table. A `stop` run whose alarm fired ended there: it is not."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "rlhf-ppo")
    _log_run(tracker, "end-quiet-stop/ppo", "gae", HEALTHY, mode="stop")
    _log_run(tracker, "end-alarmed-stop/ppo", "grpo", FALLS[:5], mode="stop")  # the alarm at 40 stopped it
    _log_run(tracker, "end-keep-best/ppo", "rloo", FALLS, mode="keep_best")
    table = alarm_check.alarm_table(tracker, "rlhf-ppo", "end-").set_index("run")
    assert table.loc["end-alarmed-stop/ppo", "alarm_step"] == 40 and table.loc["end-quiet-stop/ppo", "alarm_step"] == -1
    assert alarm_kept.trained_to_end(table).to_dict() == {
        "end-quiet-stop/ppo": True,
        "end-alarmed-stop/ppo": False,
        "end-keep-best/ppo": True,
    }
    kept = alarm_kept.kept_table(table.reset_index()).set_index("run")
    assert (kept.loc["end-quiet-stop/ppo", "warn"], kept.loc["end-quiet-stop/ppo", "stop"]) == (0.9, 0.9)
    assert (kept.loc["end-keep-best/ppo", "warn"], kept.loc["end-keep-best/ppo", "stop"]) == (-0.5, 0.8)


def test_the_summary_per_estimator_task_and_overall(store):
    summary = alarm_kept.kept_summary(alarm_kept.kept_table(_tables(store)))
    assert list(summary.index) == ["GRPO", "PPO", "RLOO", "rlhf-overoptimisation", "rlhf-ppo", "all runs"]
    every = summary.loc["all runs"]
    assert (every["runs"], every["no gain"]) == (3, 1)
    assert every["warn: mean share"] == pytest.approx((-0.75 + 1.0) / 2)  # the run with no gain left out
    assert every["stop: mean share"] == pytest.approx((0.875 + 1.0) / 2)
    assert every["keep_best: mean share"] == pytest.approx((1.0 + 0.85 / 0.9) / 2)
    assert every["warn: worst"] == "-0.75 (grid-falls/ppo)" and every["keep_best: worst"] == "0.94 (grid-healthy/ppo)"
    assert (every["warn: collapsed"], every["stop: collapsed"], every["keep_best: collapsed"]) == (2, 1, 1)
    rloo = summary.loc["RLOO"]  # its one run has no gain: no mean, no worst
    assert math.isnan(rloo["stop: mean share"]) and rloo["stop: worst"] == "-" and rloo["stop: collapsed"] == 1
    assert summary.loc["rlhf-ppo", "runs"] == 2 and summary.loc["rlhf-ppo", "warn: collapsed"] == 1


def test_gain_share_and_collapse_edges():
    assert alarm_kept.gain_share(0.5, 0.0, 1.0) == 0.5
    assert alarm_kept.gain_share(-1.0, 0.0, 0.5) == -2.0  # worse than SFT: below 0
    assert math.isnan(alarm_kept.gain_share(0.3, 0.3, 0.3))  # no gain: undefined
    # exactly 0.2 below the best is collapsed (as the gold's fall is counted), 0.19 is not
    table = pd.DataFrame(
        {
            "run": ["a", "b"],
            "objective": "PPO",
            "task": "t",
            "gold_start": [0.0, 0.0],
            "gold_peak": [0.9, 0.9],
            "gold_final": [0.7, 0.71],
            "gold_if_stopped": [0.7, 0.71],
            "gold_if_kept_best": [0.9, 0.9],
        }
    )
    kept = alarm_kept.kept_table(table)
    assert kept["warn collapsed"].tolist() == [True, False]


def test_keep_best_replays_the_guard():
    evals = pd.DataFrame(
        {
            "step": [0, 10, 20, 30, 40],
            "periodic_eval/score": [0.0, 2.0, 1.0, 3.0, 5.0],
            "periodic_eval/ensemble_min": [0.0, 0.5, 0.9, float("nan"), 0.1],
            "periodic_eval/gold": [0.0, 0.1, 0.2, 0.3, 0.4],
        }
    )
    # the ensemble's minimum where logged (0.9 at 20 beats 0.5 at 10), the score where not (3.0 at 30)
    quiet = [True] * 5
    assert alarm_kept.keep_best_index(evals, quiet, -1) == 3
    assert alarm_kept.keep_best_index(evals, quiet, 30) == 2  # only the evaluations before the alarm
    assert alarm_kept.keep_best_index(evals, [True, True, False, True, True], 30) == 1  # only the quiet ones
    assert alarm_check.kept_best_gold(evals, quiet, 30) == 0.2
    single = evals.drop(columns="periodic_eval/ensemble_min")
    single["periodic_eval/score"] = [0.0, 2.0, 2.0, 1.0, 1.0]
    assert alarm_kept.keep_best_index(single, quiet, -1) == 1  # equal scores: the first stays


def test_the_command_prints_the_kept_tables_and_draws_them(store, tmp_path, capsys):
    picture = tmp_path / "kept.png"
    argv = ["--tracking-uri", store, "--experiment", "rlhf-ppo", "--experiment", "rlhf-overoptimisation"]
    alarm_check.main([*argv, "--filter", "grid", "--kept", str(picture)])
    printed = capsys.readouterr().out
    assert "what each ppo.on_overoptimisation keeps, 3 runs trained to their end" in printed
    assert "| all runs " in printed and "| grid-falls/ppo " in printed and "stop: mean share" in printed
    assert picture.stat().st_size > 10_000
    alarm_check.main([*argv, "--filter", "grid", "--kept"])  # the tables without a picture
    assert "per estimator, per task and over all runs" in capsys.readouterr().out


def test_the_levers_replayed_on_the_recorded_evaluations(store):
    table = _tables(store).sort_values("run").reset_index(drop=True)
    falls = table["run"] == "grid-falls/ppo"
    assert table.loc[falls, "rule_holds"].iloc[0] == [False, False, False, False, True, True]
    shipped = alarm_kept.with_lever(table)  # the shipped settings: the replay alarm_table made, unchanged
    for column in ("alarm_step", "gold_if_stopped", "gold_if_kept_best"):
        assert shipped[column].tolist() == table[column].tolist()
    # the rule alone, unconfirmed: it fires at 40; stop keeps 30's policy (0.8), keep_best 20's (the best score)
    once = alarm_kept.with_lever(table, confirm=1).set_index("run").loc["grid-falls/ppo"]
    assert (once["alarm_step"], once["gold_if_stopped"], once["gold_if_kept_best"]) == (40, 0.8, 0.9)
    # every other evaluation read (0, 20, 40 and the last, 50): the rule at 40 and 50, stop keeps 20's (0.9)
    sparse = alarm_kept.with_lever(table, every=2).set_index("run").loc["grid-falls/ppo"]
    assert (sparse["alarm_step"], sparse["gold_if_stopped"], sparse["gold_if_kept_best"]) == (50, 0.9, 0.9)
    healthy = alarm_kept.with_lever(table, confirm=1).set_index("run").loc["grid-healthy/ppo"]
    assert (healthy["alarm_step"], healthy["gold_if_stopped"], healthy["gold_if_kept_best"]) == (-1, 0.9, 0.85)
    lines = alarm_kept.report(table, None, "t", {"confirm": 1})
    assert "(replayed with confirm 1)" in lines[0] and "| grid-falls/ppo " in lines[1]


def test_a_fast_fall_shows_as_a_surprisal_jump_before_the_rule_holds():
    """Evaluations every 5 updates: at 10 the reference's surprisal jumped 0.5 nats (0.1 an update, over
    SURPRISAL_JUMP; 0.5 a nat of the KL gained, over JUMP_PER_KL; 0.55 over step 0's, under the rule's 1.3) while the
    score still climbed and the gold had fallen; the rule holds from 15 and fires at 20. With the jump as evidence stop
    keeps 5's policy (0.8); without it, 10's."""
    score, kl, surprisal = [0.0, 1.0, 1.5, 1.5, 1.5], [0.0, 1.0, 2.0, 2.2, 2.3], [1.0, 1.05, 1.55, 2.55, 2.65]
    stats = [
        {"step": 5 * i, "score": s, "kl": k, "ref_surprisal": r, "distinct_2": 0.3}
        for i, (s, k, r) in enumerate(zip(score, kl, surprisal, strict=True))
    ]
    row = {"eval_steps": [0, 5, 10, 15, 20], "gold_curve": [0.0, 0.8, -0.5, -0.9, -0.9]}
    table = pd.DataFrame([{**row, "alarm_inputs": (stats, 0.0)}])
    jump = alarm_kept.with_lever(table).iloc[0]
    assert (jump["alarm_step"], jump["gold_if_stopped"], jump["gold_if_kept_best"]) == (20, 0.8, 0.8)
    no_jump = alarm_kept.with_lever(table, surprisal_jump=float("inf")).iloc[0]
    assert (no_jump["alarm_step"], no_jump["gold_if_stopped"], no_jump["gold_if_kept_best"]) == (20, -0.5, -0.5)
    # the jump measured against the KL gained with it (0.5 nats of surprisal for 1 nat of KL at 10)
    assert alarm_kept.with_lever(table, jump_per_kl=0.5).iloc[0]["gold_if_stopped"] == 0.8
    assert alarm_kept.with_lever(table, jump_per_kl=0.6).iloc[0]["gold_if_stopped"] == -0.5


def test_a_surprisal_climb_paid_for_in_kl_is_not_evidence():
    """A healthy policy that lengthens its responses: the reference's surprisal climbs 0.4 nats every 5 updates
    (0.08 an update, over SURPRISAL_JUMP) while the KL grows 8 nats (0.05 nats of surprisal a nat, under JUMP_PER_KL)
    and the gold rises; the rule holds at the last evaluation (a KL drift), which fires alone, and stop keeps 15's
    policy, the last before it, where a jump counted without the KL would keep the SFT policy (step 0's)."""
    score, kl, surprisal = [0.0, 1.0, 1.5, 1.52, 1.53], [0.0, 8.0, 16.0, 24.0, 40.0], [1.0, 1.4, 1.8, 2.2, 2.25]
    stats = [
        {"step": 5 * i, "score": s, "kl": k, "ref_surprisal": r, "distinct_2": 0.3}
        for i, (s, k, r) in enumerate(zip(score, kl, surprisal, strict=True))
    ]
    row = {"eval_steps": [0, 5, 10, 15, 20], "gold_curve": [0.0, 0.3, 0.6, 0.7, 0.4]}
    table = pd.DataFrame([{**row, "alarm_inputs": (stats, 0.0)}])
    shipped = alarm_kept.with_lever(table).iloc[0]
    assert (shipped["alarm_step"], shipped["gold_if_stopped"]) == (20, 0.7)
    assert alarm_kept.with_lever(table, jump_per_kl=0.0).iloc[0]["gold_if_stopped"] == 0.0


def test_the_recorded_tables_of_the_docs_are_read_as_runs(tmp_path):
    page = tmp_path / "grid.md"
    page.write_text(
        "| half | task | objective | kl_coef | seed | gold at 0 | peak (update) | final | falls 0.2 (update) | alarm "
        "(update) | 'stop' keeps | 'keep_best' keeps |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | "
        "--- | --- |\n"
        "| held-out | default | GRPO | 0 | 51 | 0.100 | 0.900 (20) | -0.500 | yes (30) | 30 | 0.500 | 0.900 |\n\n"
        f"{alarm_kept.FRESH_HEADING}\n\n"
        "| task | objective | kl_coef | seed | gold at 0 | peak | final | falls | alarm | earlier | stop | best |\n"
        "| default | RLOO | 0.05 | 54 | 0.000 | 0.800 (60) | 0.800 | no | no | - | 0.800 | 0.800 |\n"
    )
    runs = alarm_kept.recorded_runs(page)
    assert runs["half"].tolist() == ["held-out", "fresh"]
    kept = alarm_kept.kept_table(runs).set_index("run")
    grpo = kept.loc["default GRPO kl 0 seed 51"]
    # warn keeps the fallen final policy, stop half the gain, keep_best all of it
    assert (grpo["warn share"], grpo["stop share"], grpo["keep_best share"]) == pytest.approx((-0.75, 0.5, 1.0))
    assert [grpo["warn collapsed"], grpo["stop collapsed"], grpo["keep_best collapsed"]] == [True, True, False]
    assert kept.loc["default RLOO kl 0.05 seed 54", "stop share"] == 1.0
    shipped = alarm_kept.recorded_runs(REPO / "docs" / "alarm-grid.md")
    assert len(shipped) == 84 + 56  # the shipped page: the grid and the fresh runs


def test_the_shipped_stop_beside_warn_at_the_same_seed(tmp_path, capsys):
    """The held-out check's table (`alarm_check --shipped`): runs made with the shipped stop, each beside what warn
    reaches at its seed: its own final gold where the alarm never fired, else that of the warn run made again."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "rlhf-ppo")
    _log_run(tracker, "check-falls/ppo", "grpo", FALLS[:5], mode="stop")  # the alarm at 40 stopped it there
    _log_run(tracker, "check-healthy/ppo", "gae", HEALTHY, mode="stop")  # no alarm: trained to its end
    _log_run(tracker, "again-falls/ppo", "grpo", FALLS)  # the first one's seed again, with warn
    made, again = (alarm_check.alarm_table(tracker, "rlhf-ppo", name) for name in ("check-", "again-"))
    shipped = alarm_shipped.shipped_table(made, again).set_index("run")
    falls, healthy = shipped.loc["check-falls/ppo"], shipped.loc["check-healthy/ppo"]
    # stop kept update 30's policy (0.8) of a best of 0.9 passed through; warn ends at -0.5 after the same best
    assert (falls["alarm"], falls["sft"], falls["best"], falls["stop"]) == (40, 0.1, 0.9, 0.8)
    assert (falls["warn"], falls["warn best"]) == (-0.5, 0.9)
    assert falls["stop share"] == pytest.approx(0.875) and not falls["stop collapsed"]
    assert (healthy["alarm"], healthy["stop"], healthy["warn"], healthy["stop share"]) == (-1, 0.9, 0.9, 1.0)
    alarm_check.main(["--tracking-uri", uri, "--experiment", "rlhf-ppo", "--filter", "check-", "--shipped", "again-"])
    printed = capsys.readouterr().out
    assert "what the shipped stop kept, 2 runs" in printed and "| all runs " in printed
    summary = alarm_shipped.shipped_summary(alarm_shipped.shipped_table(made)).loc["all runs"]
    assert (summary["runs"], summary["alarms"], summary["stop: collapsed"]) == (2, 1, 0)
    assert math.isnan(alarm_shipped.shipped_table(made).set_index("run").loc["check-falls/ppo", "warn"])  # no warn run


def test_the_alarmed_stop_runs_are_made_again_with_warn(tmp_path, capsys):
    """`alarm_check --warn-reruns SPACE`: the sweep that makes again with warn, to their ends, the runs the sweep
    SPACE made with stop whose alarm fired, each from its arm (found by its objective) at its KL and seed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "rlhf-ppo")
    _log_run(tracker, "check-00/ppo", "grpo", FALLS[:5], mode="stop")  # alarmed at 40
    _log_run(tracker, "check-01/ppo", "gae", HEALTHY, mode="stop")  # never alarmed
    space = tmp_path / "check.yaml"
    space.write_text(
        "name: check\narms:\n"
        "  - {name: PPO, overrides: {ppo.advantage_estimator: gae}}\n"
        "  - {name: GRPO, overrides: {ppo.advantage_estimator: grpo, ppo.samples_per_prompt: 4}}\n"
        "  - {name: GSPO, overrides: {ppo.advantage_estimator: grpo, ppo.importance_sampling_level: sequence}}\n"
        "parameters: {ppo.kl_coef: [0.05, 0.0], policy_seed: [61]}\n"
    )
    alarm_check.main(["--tracking-uri", uri, "--filter", "check-", "--warn-reruns", str(space)])
    reruns = parse_space(yaml.safe_load(capsys.readouterr().out))  # a sweep space flows.sweep takes
    assert reruns.name == "check_warn" and [arm.name for arm in reruns.arms] == ["GRPO kl 0.05 seed 61"]
    overrides = {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 4, "ppo.kl_coef": 0.05}
    assert reruns.arms[0].overrides == {**overrides, "policy_seed": 61, "ppo.on_overoptimisation": "warn"}
    space.write_text(space.read_text().replace("policy_seed: [61]", "policy_seed: [61], ppo.lr: [0.1]"))
    with pytest.raises(SystemExit) as stopped:
        alarm_check.main(["--tracking-uri", uri, "--filter", "check-", "--warn-reruns", str(space)])
    assert stopped.value.code == 2
    assert "reads a grid over ppo.kl_coef and policy_seed only" in capsys.readouterr().err
