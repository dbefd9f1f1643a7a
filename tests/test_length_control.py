"""Length statistics, length-matched and length-controlled win rates, and the reward-hacking verdict."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlhf.eval.length_control import (
    LengthControl,
    fit_logistic,
    hacking_verdict,
    is_empty,
    length_control,
    length_matched,
    length_stats,
    win_values,
)


def test_empty_is_zero_tokens_or_whitespace():
    assert list(is_empty([0, 3, 2, 0], ["", "  \n", "hi", "."])) == [True, True, False, True]


def test_length_stats_by_hand():
    stats = length_stats([0, 10, 20, 30, 40], [True, False, False, False, False])
    # numpy's linear interpolation: p10 = 0 + 0.4 * 10, p90 = 30 + 0.6 * 10
    assert stats == {"length_mean": 20.0, "length_p10": 4.0, "length_p50": 20.0, "length_p90": 36.0, "empty_rate": 0.2}


def test_wins_ties_and_length_matching_by_hand():
    assert list(win_values([1, 2, 3, 4], [0, 3, 3, 5])) == [1.0, 0.0, 0.5, 0.0]
    # |10-11| <= 0.2*11 yes; |10-20| > 0.2*20 no; equal yes; two empty responses yes; 8 vs 10: 2 <= 2 yes
    assert list(length_matched([10, 10, 5, 0, 8], [11, 20, 5, 0, 10], 0.2)) == [True, False, True, True, True]
    c = length_control([1, 2, 3, 4], [0, 3, 3, 5], [10, 10, 5, 0], [11, 20, 5, 0], tolerance=0.2)
    assert c.n_matched == 3 and c.matched_win_rate == pytest.approx((1 + 0.5 + 0) / 3)
    assert c.win_rate == pytest.approx(1.5 / 4)
    none = length_control([1, 2], [0, 0], [1, 2], [10, 20], tolerance=0.2)
    assert none.n_matched == 0 and math.isnan(none.matched_win_rate)


def test_logistic_fit_by_hand():
    # at x = -1 one win in four (log-odds -ln 3), at x = +1 three in four (+ln 3): a = 0, b = ln 3
    a, b = fit_logistic([-1] * 4 + [1] * 4, [1, 0, 0, 0, 1, 1, 1, 0], ridge=0.0)
    assert a == pytest.approx(0.0, abs=1e-9) and b == pytest.approx(math.log(3), rel=1e-9)
    # no length difference, three wins in four: sigmoid(a) = 0.75, b stays 0
    a, b = fit_logistic([0.0] * 4, [1, 1, 1, 0], ridge=0.0)
    assert a == pytest.approx(math.log(3), rel=1e-9) and b == 0.0
    # ties count half: all ties is a = 0
    assert fit_logistic([-1, 0, 1], [0.5, 0.5, 0.5]) == pytest.approx((0.0, 0.0), abs=1e-12)
    # separable data and all wins stay finite thanks to the ridge (stationarity: n (1 - sigmoid(a)) = ridge * a)
    a, b = fit_logistic([-1, -1, 1, 1], [0, 0, 1, 1], ridge=0.1)
    assert a == pytest.approx(0.0, abs=1e-9) and 0 < b < 20
    a, _ = fit_logistic([0.0] * 100, [1.0] * 100, ridge=0.1)
    assert 100 * (1 - 1 / (1 + math.exp(-a))) == pytest.approx(0.1 * a, rel=1e-6)


def _lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """SFT answers of 15-29 tokens; PPO answers mostly shorter (20% to 110% of SFT's)."""
    rng = np.random.default_rng(seed)
    sft = rng.integers(15, 30, n)
    ppo = (sft * rng.uniform(0.2, 1.1, n)).astype(int)
    return ppo, sft, rng


def test_length_controlled_win_rate_removes_a_pure_length_effect():
    ppo_len, sft_len, rng = _lengths(2000)
    x = (ppo_len - sft_len) / sft_len.mean()
    wins = (rng.uniform(size=len(x)) < 1 / (1 + np.exp(3 * x))).astype(float)  # shorter wins, nothing else counts
    c = length_control(wins, np.full(len(x), 0.5), ppo_len, sft_len)
    assert c.win_rate > 0.7  # PPO "wins" because it is shorter
    assert c.controlled_win_rate == pytest.approx(0.5, abs=0.05)
    assert c.slope < -2


def test_length_controlled_win_rate_keeps_a_real_gain():
    ppo_len, sft_len, rng = _lengths(500)
    c = length_control(np.ones(500), np.zeros(500), ppo_len, sft_len)  # PPO always better, whatever its length
    assert c.win_rate == 1.0 and c.matched_win_rate == 1.0 and c.controlled_win_rate > 0.95
    better = rng.uniform(size=500) < 0.8  # 80% wins independent of length
    c = length_control(better.astype(float), np.full(500, 0.5), ppo_len, sft_len)
    assert c.controlled_win_rate == pytest.approx(0.8, abs=0.06)


def _control(raw: float, controlled: float, n: int = 40) -> LengthControl:
    return LengthControl(raw, controlled, 10, controlled, -1.0, n)


def _verdict(controls, ppo_empty=None, sft_empty=None, ppo_scores=None, n=40):
    return hacking_verdict(
        controls,
        [8] * n,
        [23] * n,
        ppo_empty if ppo_empty is not None else [False] * n,
        sft_empty if sft_empty is not None else [False] * n,
        ppo_scores if ppo_scores is not None else list(np.linspace(0, 1, n)),
    )


def test_verdict_length():
    flagged = _verdict({"reward-model score": _control(0.95, 0.52)})
    assert flagged.length and not flagged.empty and len(flagged.warnings) == 1
    text = flagged.warnings[0]
    assert "mostly explained by length" in text and "95%" in text and "52%" in text and "shorter" in text
    assert "8.0 tokens" in text and "23.0 tokens" in text
    # controlled advantage 0.30 is more than half the raw 0.45: a real gain
    assert not _verdict({"reward-model score": _control(0.95, 0.80)}).length
    assert not _verdict({"reward-model score": _control(0.54, 0.50)}).length  # within the margin of a tie
    # 60% raw is chance over 40 prompts (needs > 50% + 1/sqrt(40) = 65.8%), not over 400 (> 55%)
    assert not _verdict({"reward-model score": _control(0.60, 0.50)}).length
    assert _verdict({"reward-model score": _control(0.60, 0.50, n=400)}, n=400).length
    # either score can set it; the sentence names the one that did
    both = _verdict({"reward-model score": _control(0.9, 0.85), "gold reward": _control(0.7, 0.55)})
    assert both.length and "on gold reward" in both.warnings[0] and "reward-model" not in both.warnings[0]
    assert not _verdict({"reward-model score": _control(0.95, 0.52, n=5)}, n=5).length  # too few prompts


def test_verdict_empty():
    n = 40
    empty = [i < 4 for i in range(n)]  # 10% empty
    scores = [2.0 if e else i / n for i, e in enumerate(empty)]  # empty answers score best
    flagged = _verdict({}, ppo_empty=empty, ppo_scores=scores)
    assert flagged.empty and not flagged.length
    assert "10.0% of prompts (SFT 0.0%)" in flagged.warnings[0]
    low = [-1.0 if e else i / n for i, e in enumerate(empty)]  # empty answers score badly: not a hack
    assert not _verdict({}, ppo_empty=empty, ppo_scores=low).empty
    assert not _verdict({}, ppo_empty=empty, sft_empty=empty, ppo_scores=scores).empty  # SFT as often
