"""The algorithm study: sweep arms (named override sets), the per-arm table with 95% intervals, the frontier plot,
(the study end to end:
tests/test_sweep.py, beside the other sweeps, whose shared stages it reuses)."""

from __future__ import annotations

import math

import pytest

from rlhf.config import load_config
from rlhf.errors import ConfigError
from rlhf.sweeps.space import expand, load_space, parse_space, variant_configs
from rlhf.sweeps.study import format_study, frontier_points, interval95, rate_interval95, study_table
from tests.conftest import REPO


def test_interval95_by_hand():
    # 0.9, 0.8, 1.0: mean 0.9; sample sd sqrt((0.01 + 0.01) / 2) = 0.1; se 0.1 / sqrt(3) = 0.057735;
    # t(0.975, 2 df) = 4.302653 -> half-width 0.248414
    mean, half = interval95([0.9, 0.8, 1.0])
    assert mean == pytest.approx(0.9) and half == pytest.approx(0.248414, abs=1e-6)
    # 2 values 1 and 3: mean 2, sd sqrt(2) = 1.414214, se 1, t(1 df) = 12.706205
    assert interval95([1.0, 3.0]) == pytest.approx((2.0, 12.706205))
    mean, half = interval95([0.5, float("nan"), None])  # one finite value: no interval
    assert mean == 0.5 and math.isnan(half)


def test_rate_interval95_by_hand_stays_inside_zero_and_one():
    # logits of 0.9, 0.8, 0.95: ln 9, ln 4, ln 19 = 2.197225, 1.386294, 2.944439; mean 2.175986; squared
    # deviations 0.000451 + 0.623613 + 0.590520 = 1.214584, sd sqrt(1.214584 / 2) = 0.779290, se 0.449923,
    # t(2) 4.302653 -> 2.175986 +- 1.935863 -> sigmoid(0.240124) = 0.559744 .. sigmoid(4.111848) = 0.983886
    mean, low, high = rate_interval95([0.9, 0.8, 0.95])
    assert (mean, low, high) == pytest.approx((0.883333, 0.559744, 0.983886), abs=1e-5)
    # runs that split (GRPO's 96.4%, 7.7%, 1.8% on the embedded task): the t-interval on the rates was 35.3% +- 131.6%
    mean, low, high = rate_interval95([0.964, 0.077, 0.018])
    assert mean == pytest.approx(0.353) and 0.0 <= low < 0.01 and 0.99 < high <= 1.0
    # every run at 100%: the edge is held at 99.9% on the logit scale, the interval widened to the mean
    assert rate_interval95([1.0, 1.0, 1.0]) == pytest.approx((1.0, 0.999, 1.0))
    mean, low, high = rate_interval95([0.5, None])  # one run: no interval
    assert mean == 0.5 and math.isnan(low) and math.isnan(high)


def test_study_table_one_row_per_arm_in_order_with_failures_counted():
    rows = [
        {"arm": "PPO", "status": "completed", "eval/win_rate_gold": 0.9, "eval/kl": 4.0, "memory/ppo_peak_mb": 900.0,
         "eval/hacking_flag_length": 0.0, "eval/hacking_flag_empty": 0.0, "time/policy_train": 100.0,
         "overoptimisation/alarm_step": 40.0, "eval/overoptimisation_flag": 0.0},
        {"arm": "PPO", "status": "completed", "eval/win_rate_gold": 0.8, "eval/kl": 6.0, "memory/ppo_peak_mb": 950.0,
         "eval/hacking_flag_length": 1.0, "eval/hacking_flag_empty": 0.0, "time/policy_train": 120.0,
         "overoptimisation/alarm_step": -1.0, "eval/overoptimisation_flag": 0.0},
        {"arm": "DPO", "status": "completed", "eval/win_rate_gold": 0.7, "eval/kl": 1.0, "memory/dpo_peak_mb": 500.0},
        {"arm": "DPO", "status": "failed"},
    ]  # fmt: skip
    table = study_table(rows, ["PPO", "DPO", "GRPO"])
    assert list(table["arm"]) == ["PPO", "DPO", "GRPO"]
    ppo, dpo, grpo = (table.iloc[i] for i in range(3))
    assert ppo["runs"] == "2/2" and dpo["runs"] == "1/2" and grpo["runs"] == "0/0"
    # 0.9 and 0.8: logits 2.197225 and 1.386294, mean 1.791759, sd 0.573413, se 0.405465, t(1) 12.706 -> +- 5.151843
    # -> sigmoid(-3.360084) = 0.033569 .. sigmoid(6.943602) = 0.999036
    assert ppo["win_rate_gold"] == pytest.approx(0.85)
    assert (ppo["win_rate_gold_lo"], ppo["win_rate_gold_hi"]) == pytest.approx((0.033569, 0.999036), abs=1e-5)
    assert ppo["win_rate_gold_runs"] == [0.9, 0.8]
    assert ppo["kl"] == pytest.approx(5.0) and ppo["train_s"] == pytest.approx(110.0)
    assert ppo["peak_mb"] == 950.0 and dpo["peak_mb"] == 500.0  # the largest peak, from each stage's own metric
    assert ppo["hacking_flagged"] == "1/2" and dpo["hacking_flagged"] == "0/1"
    assert ppo["overoptimisation_alarm"] == "1/2" and dpo["overoptimisation_alarm"] == "0/1"  # at update 40
    assert math.isnan(dpo["win_rate_gold_lo"]) and math.isnan(grpo["gold"])
    text = format_study(table)
    assert "| PPO | 2/2 | 85.0% [3.4%, 99.9%] | 5.00 ± " in text and "| GRPO | 0/0 | n/a | n/a |" in text
    assert "| DPO | 1/2 | 70.0% | " in text and "| 90.0, 80.0 |" in text
    assert text.splitlines()[0] == (
        "| arm | runs | win rate | KL | gold | LC win rate | each run % | train s | peak MB | hacking | alarm |"
    )  # the KL it cost beside the win rate; short headers, and what they hold below the table
    assert text.splitlines()[-1].startswith("arm: the arm; runs: its runs finished of started; win rate: the gold")


def test_frontier_points_periodic_and_final_per_arm():
    import pandas as pd

    history = pd.DataFrame({"step": [0, 2], "periodic_eval/gold": [0.0, 0.5], "periodic_eval/kl": [0.0, 4.0]})
    rows = [
        {"arm": "PPO", "label": "PPO,seed=0", "status": "completed", "eval/policy_gold": 0.6, "eval/kl": 9.0},
        {"arm": "DPO", "label": "DPO,seed=0", "status": "completed", "eval/policy_gold": 0.4, "eval/kl": float("nan")},
    ]
    arm_of = {"PPO,seed=0": "PPO", "DPO,seed=0": "DPO"}
    points = frontier_points(rows, {"PPO,seed=0": history}, arm_of)
    assert list(points["kind"]) == ["periodic", "periodic", "final"]  # DPO's NaN KL is left out, not drawn at 0
    assert list(points["sqrt_kl"]) == [0.0, 2.0, 3.0]


def test_arms_expand_every_arm_at_every_point():
    s = parse_space(
        {
            "name": "t",
            "arms": [
                {"name": "PPO", "overrides": {"ppo.advantage_estimator": "gae"}},
                {"name": "DPO", "overrides": {"algorithm": "dpo"}},
            ],
            "parameters": {"policy_seed": [0, 1]},
        }
    )
    variants = expand(s)
    assert [v.label for v in variants] == ["PPO,policy_seed=0", "PPO,policy_seed=1", "DPO,policy_seed=0",
                                           "DPO,policy_seed=1"]  # fmt: skip
    assert variants[3].overrides == {"algorithm": "dpo", "policy_seed": 1} and variants[3].arm == "DPO"
    only_arms = expand(parse_space({"name": "t", "arms": [{"name": "A", "overrides": {"ppo.kl_coef": 0.1}}]}))
    assert [(v.label, v.overrides) for v in only_arms] == [("A", {"ppo.kl_coef": 0.1})]


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"method": "random", "arms": [{"name": "A"}], "parameters": {"seed": [0]}}, "arms need method: grid"),
        ({"arms": [{"name": "A"}, {"name": "A"}]}, "arms: the name 'A' is given twice"),
        ({"arms": [{"name": "A", "overrides": {"ppo.kl_cof": 1}}]}, "arms.A: parameters.ppo.kl_cof is not a config"),
        ({"arms": [{"name": "A", "overrides": {"seed": 1}}], "parameters": {"seed": [0]}}, "arms.A sets seed, which"),
        ({"arms": [{"name": "A", "set": {}}]}, "unknown key 'arms.0.set'"),
    ],
)
def test_arm_errors_are_one_sentence(raw, message):
    with pytest.raises(ConfigError) as err:
        parse_space({"name": "t", **raw})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_shipped_study_spaces_are_valid_and_share_the_upstream_stages():
    from flows.pipeline import upstream_signature

    base = load_config(REPO / "conf" / "default.yaml")
    for name in ("algorithms.yaml", "algorithms_overoptimisation.yaml"):
        configs = [c for _, c in variant_configs(base, load_space(REPO / "conf" / "sweeps" / name))]
        assert len({upstream_signature(c) for c in configs}) == 1, name  # data, SFT and RM built once
        assert {c.policy_stage_seed for c in configs} == {0, 1, 2}
        online = [c for c in configs if c.algorithm == "ppo"]
        assert len({c.ppo.total_episodes * 1 for c in online}) == 1, "the online arms sample the same episodes"
