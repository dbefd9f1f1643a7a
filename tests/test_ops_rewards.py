from __future__ import annotations

import pytest
import torch

from rlhf.ops.rewards import per_token_rewards, shape_scores

GARBAGE = 1e6

SCORES = torch.tensor([3.0, -0.5, 1.0, -4.0])
LENGTHS = torch.tensor([10, 2, 5, 8])
CONTAINS_STOP = torch.tensor([True, False, True, False])


def test_shape_scores_no_options_is_identity() -> None:
    out = shape_scores(SCORES, LENGTHS, CONTAINS_STOP)
    torch.testing.assert_close(out.scores, SCORES)
    torch.testing.assert_close(out.missing_eos, torch.tensor([False, True, False, True]))
    torch.testing.assert_close(out.too_short, torch.tensor([False, False, False, False]))


def test_shape_scores_clip_then_subtract() -> None:
    original = SCORES.clone()
    out = shape_scores(
        SCORES, LENGTHS, CONTAINS_STOP, clip=2.0, missing_eos_penalty=1.0, min_length=4, min_length_penalty=0.5
    )
    # clip to [-2, 2]:            [2.0, -0.5, 1.0, -2.0]
    # no stop (rows 1, 3) -= 1.0: [2.0, -1.5, 1.0, -3.0]
    # length < 4 (row 1) -= 0.5:  [2.0, -2.0, 1.0, -3.0]
    torch.testing.assert_close(out.scores, torch.tensor([2.0, -2.0, 1.0, -3.0]))
    torch.testing.assert_close(out.too_short, torch.tensor([False, True, False, False]))
    torch.testing.assert_close(SCORES, original)  # the input is not modified


def test_shape_scores_clip_only() -> None:
    out = shape_scores(SCORES, LENGTHS, CONTAINS_STOP, clip=1.0)
    torch.testing.assert_close(out.scores, torch.tensor([1.0, -0.5, 1.0, -1.0]))  # 3 -> 1; -4 -> -1


def test_shape_scores_replace() -> None:
    out = shape_scores(
        SCORES,
        LENGTHS,
        CONTAINS_STOP,
        clip=2.0,
        missing_eos_penalty=-1.0,
        missing_eos_mode="replace",
        min_length=4,
        min_length_penalty=-2.0,
        min_length_mode="replace",
    )
    # clip:                          [2.0, -0.5, 1.0, -2.0]
    # no stop (rows 1, 3) -> -1.0:   [2.0, -1.0, 1.0, -1.0]
    # length < 4 (row 1) -> -2.0:    [2.0, -2.0, 1.0, -1.0]
    torch.testing.assert_close(out.scores, torch.tensor([2.0, -2.0, 1.0, -1.0]))


def test_shape_scores_unknown_mode() -> None:
    with pytest.raises(ValueError, match="missing_eos_mode"):
        shape_scores(SCORES, LENGTHS, CONTAINS_STOP, missing_eos_penalty=1.0, missing_eos_mode="add")
    with pytest.raises(ValueError, match="min_length_mode"):
        shape_scores(SCORES, LENGTHS, CONTAINS_STOP, min_length_mode="multiply")


LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, GARBAGE]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.4, -GARBAGE]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# d = [[0.5, -1.0, 0.0], [-0.2, 0.2, (padding)]]


def test_per_token_rewards_score_at_last_real_token() -> None:
    out = per_token_rewards(torch.tensor([1.0, 2.0]), LOGPROBS, REF_LOGPROBS, MASK, kl_coef=0.1)
    torch.testing.assert_close(out.kl, torch.tensor([[0.5, -1.0, 0.0], [-0.2, 0.2, 0.0]]))  # k1 = d, 0 at padding
    # -0.1 * kl
    torch.testing.assert_close(out.non_score_rewards, torch.tensor([[-0.05, 0.1, 0.0], [0.02, -0.02, 0.0]]))
    expected = torch.tensor(
        [
            [-0.05, 0.1, 1.0],  # last real token is index 2: 0.0 + 1.0
            [0.02, 1.98, 0.0],  # last real token is index 1: -0.02 + 2.0; padding stays 0
        ]
    )
    torch.testing.assert_close(out.rewards, expected)


def test_per_token_rewards_k3_and_padding_zero() -> None:
    out = per_token_rewards(torch.tensor([0.0, 0.0]), LOGPROBS, REF_LOGPROBS, MASK, kl_coef=1.0, estimator="k3")
    expected_kl = torch.tensor(
        [
            [0.106531, 0.718282, 0.0],  # exp(-0.5) - 0.5; exp(1) - 2; 0
            [0.021403, 0.018731, 0.0],  # exp(0.2) - 1 - 0.2 = 0.021403; exp(-0.2) - 1 + 0.2 = 0.018731; padding
        ]
    )
    torch.testing.assert_close(out.kl, expected_kl, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.rewards, -expected_kl, atol=1e-6, rtol=0)
    assert (out.rewards[~MASK.bool()] == 0).all() and (out.non_score_rewards[~MASK.bool()] == 0).all()


def test_per_token_rewards_padding_invariance_and_empty_row() -> None:
    other_lp, other_ref = LOGPROBS.clone(), REF_LOGPROBS.clone()
    other_lp[1, 2], other_ref[1, 2] = -7.0, 3.0
    a = per_token_rewards(torch.tensor([1.0, 2.0]), LOGPROBS, REF_LOGPROBS, MASK, kl_coef=0.1, estimator="k2")
    b = per_token_rewards(torch.tensor([1.0, 2.0]), other_lp, other_ref, MASK, kl_coef=0.1, estimator="k2")
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)
    # a row with no real token gets nothing, not even the score
    empty = torch.tensor([[1, 1, 1], [0, 0, 0]])
    out = per_token_rewards(torch.tensor([1.0, 2.0]), LOGPROBS, REF_LOGPROBS, empty, kl_coef=0.1)
    torch.testing.assert_close(out.rewards[1], torch.zeros(3))


def test_compute_advantages_applies_each_penalty_in_its_own_mode() -> None:
    # ppo.min_length_mode and ppo.missing_eos_mode: in "replace" mode a short row (and a row without a stop token)
    # scores its penalty
    from rlhf.config import PPOConfig
    from rlhf.ppo.update import Rollout, compute_advantages
    from rlhf.rollout.generation import Responses
    from rlhf.rollout.scoring import ScoredResponses

    cfg = PPOConfig(
        missing_eos_penalty=-1.0,
        missing_eos_mode="replace",
        min_response_length=4,
        min_length_penalty=-1.0,
        min_length_mode="replace",
        whiten_advantages=False,
    )
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    resp = Responses(
        tokens=torch.zeros(3, 5, dtype=torch.long), mask=mask, contains_stop=torch.tensor([1, 1, 0]).bool()
    )
    zeros = torch.zeros(3, 5)
    query_responses, qr_mask, scores = torch.zeros(3, 7, dtype=torch.long), torch.ones(3, 7), torch.tensor([2.0] * 3)
    scored = ScoredResponses(query_responses, qr_mask, 2, resp, zeros, zeros, zeros, scores)
    r = Rollout([0, 1, 2], scored)
    compute_advantages(r, cfg, kl_coef=0.0)
    torch.testing.assert_close(r.shaped_scores, torch.tensor([2.0, -1.0, -1.0]))
