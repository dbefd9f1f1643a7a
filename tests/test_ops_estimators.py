from __future__ import annotations

import pytest
import torch

from rlhf.config.estimators import CRITIC_FREE_ESTIMATORS, ESTIMATOR_NAMES, ESTIMATORS
from rlhf.ops.advantages import (
    GROUP_ADVANTAGES,
    broadcast_to_tokens,
    gae,
    group_advantages,
    reinforce_returns,
)
from rlhf.ops.losses import LOSS_AGGREGATIONS, aggregate_loss, kl_loss, policy_loss
from rlhf.ops.stats import masked_mean

GARBAGE = 1e6
NAN = float("nan")

# three contiguous groups of G = 3:
#   g0 = [1, 2, 3]: mean 2, deviations -1, 0, 1, squares sum 2, unbiased var 2 / 2 = 1, std 1
#   g1 = [6, 0, 3]: mean 3, deviations 3, -3, 0, squares sum 18, unbiased var 18 / 2 = 9, std 3
#   g2 = [5, 5, 5]: mean 5, std 0 (no learning signal)
SCORES = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 3.0, 5.0, 5.0, 5.0])


def test_estimator_names() -> None:
    assert ESTIMATOR_NAMES == ("gae", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    assert CRITIC_FREE_ESTIMATORS == ESTIMATOR_NAMES[1:]
    # every critic-free estimator computes advantages that rlhf.ops knows
    assert {ESTIMATORS[name].advantages for name in CRITIC_FREE_ESTIMATORS} == set(GROUP_ADVANTAGES)
    assert LOSS_AGGREGATIONS == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def test_group_statistics() -> None:
    out = group_advantages(SCORES, group_size=3, estimator="grpo")
    torch.testing.assert_close(out.group_mean, torch.tensor([2.0, 3.0, 5.0]))
    torch.testing.assert_close(out.group_std, torch.tensor([1.0, 3.0, 0.0]))
    assert out.zero_std_fraction.item() == pytest.approx(1 / 3)  # g2 only
    # the std is torch.std's unbiased one
    torch.testing.assert_close(out.group_std, SCORES.view(3, 3).std(dim=1))


def test_grpo_hand_computed() -> None:
    out = group_advantages(SCORES, group_size=3, estimator="grpo", eps=0.0)
    # (s - mean) / std: g0 (-1, 0, 1) / 1; g1 (3, -3, 0) / 3; g2 all equal -> exactly 0 (not 0 / 0 = NaN)
    expected = torch.tensor([-1.0, 0.0, 1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(out.advantages, expected)
    # with the default eps = 1e-6 the std is 1 + 1e-6 and 3 + 1e-6
    out = group_advantages(SCORES, group_size=3, estimator="grpo")
    expected = torch.tensor([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 3 / (3 + 1e-6), -3 / (3 + 1e-6), 0.0, 0, 0, 0])
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-7)


def test_grpo_group_of_four() -> None:
    scores = torch.tensor([0.0, 0.0, 0.0, 2.0])
    out = group_advantages(scores, group_size=4, estimator="grpo", eps=0.0)
    # mean 0.5; deviations -0.5, -0.5, -0.5, 1.5; squares 0.25 * 3 + 2.25 = 3; unbiased var 3 / 3 = 1, std 1
    torch.testing.assert_close(out.advantages, torch.tensor([-0.5, -0.5, -0.5, 1.5]))
    torch.testing.assert_close(out.group_std, torch.tensor([1.0]))
    assert out.zero_std_fraction.item() == 0.0


def test_dr_grpo_and_reinforce_pp_baseline_hand_computed() -> None:
    # s - mean, no division: g0 (1, 2, 3) - 2; g1 (6, 0, 3) - 3; g2 (5, 5, 5) - 5
    expected = torch.tensor([-1.0, 0.0, 1.0, 3.0, -3.0, 0.0, 0.0, 0.0, 0.0])
    for estimator in ("dr_grpo", "reinforce_pp_baseline"):
        out = group_advantages(SCORES, group_size=3, estimator=estimator)
        torch.testing.assert_close(out.advantages, expected)
        assert out.zero_std_fraction.item() == pytest.approx(1 / 3)


def test_reinforce_pp_keeps_the_scores() -> None:
    # no baseline: the scores go on into the token rewards unchanged; groups of 1 are fine
    out = group_advantages(SCORES, group_size=3, estimator="reinforce_pp")
    torch.testing.assert_close(out.advantages, SCORES)
    out = group_advantages(SCORES, group_size=1, estimator="reinforce_pp")
    torch.testing.assert_close(out.advantages, SCORES)
    assert out.zero_std_fraction.item() == 1.0  # every group of one has std 0


def test_rloo_hand_computed() -> None:
    out = group_advantages(SCORES, group_size=3, estimator="rloo")
    # s_i - mean of the two others = 3 / 2 * (s_i - mean):
    #   g0: 1 - (2 + 3) / 2 = -1.5;  2 - (1 + 3) / 2 = 0;   3 - (1 + 2) / 2 = 1.5
    #   g1: 6 - (0 + 3) / 2 = 4.5;   0 - (6 + 3) / 2 = -4.5; 3 - (6 + 0) / 2 = 0
    #   g2: 5 - 5 = 0 three times
    expected = torch.tensor([-1.5, 0.0, 1.5, 4.5, -4.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(out.advantages, expected)
    # group of four [0, 0, 0, 2]: 0 - (0 + 0 + 2) / 3 = -2/3 three times; 2 - 0 = 2
    out = group_advantages(torch.tensor([0.0, 0.0, 0.0, 2.0]), group_size=4, estimator="rloo")
    torch.testing.assert_close(out.advantages, torch.tensor([-2 / 3, -2 / 3, -2 / 3, 2.0]))


def test_rloo_matches_explicit_leave_one_out_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    for group_size in (2, 3, 5):
        scores = torch.randn(4 * group_size, generator=gen, dtype=torch.float64)
        out = group_advantages(scores, group_size=group_size, estimator="rloo")
        expected = torch.zeros_like(scores)
        for g in range(4):
            for i in range(group_size):
                others = [scores[g * group_size + j].item() for j in range(group_size) if j != i]
                expected[g * group_size + i] = scores[g * group_size + i].item() - sum(others) / len(others)
        torch.testing.assert_close(out.advantages, expected)


def test_grpo_matches_torch_std_on_random_groups() -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(6 * 4, generator=gen, dtype=torch.float64)
    out = group_advantages(scores, group_size=4, estimator="grpo")
    grouped = scores.view(6, 4)
    expected = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.advantages, expected.view(-1))
    torch.testing.assert_close(out.group_std, grouped.std(dim=1))
    assert out.zero_std_fraction.item() == 0.0


def test_zero_std_groups_give_zero_advantages_and_no_nan() -> None:
    # 0.1 is not exact in binary: the mean of four may be an ulp off 0.1, yet the advantages are exactly 0
    scores = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 0.0, 1.0, 0.0, 1.0], requires_grad=True)
    for estimator in sorted(set(GROUP_ADVANTAGES) - {"reinforce_pp"}):
        for eps in (1e-6, 0.0):
            out = group_advantages(scores, group_size=4, estimator=estimator, eps=eps)
            assert (out.advantages[:8] == 0).all(), estimator
            assert (out.group_std[:2] == 0).all()
            assert out.zero_std_fraction.item() == pytest.approx(2 / 3)  # 2 of 3 groups
            assert torch.isfinite(out.advantages).all() and torch.isfinite(out.group_std).all()
            scores.grad = None
            (out.advantages.sum() + out.group_std.sum()).backward()
            assert torch.isfinite(scores.grad).all(), estimator
    # groups of one: grpo has no spread to divide by -> 0, every group counted
    out = group_advantages(torch.tensor([3.0, -1.0]), group_size=1, estimator="grpo")
    torch.testing.assert_close(out.advantages, torch.zeros(2))
    torch.testing.assert_close(out.group_std, torch.zeros(2))
    assert out.zero_std_fraction.item() == 1.0


def test_group_advantages_errors() -> None:
    with pytest.raises(ValueError, match="not a whole number of groups"):
        group_advantages(torch.zeros(5), group_size=2, estimator="grpo")
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(4), group_size=1, estimator="rloo")
    with pytest.raises(ValueError, match="at least 1"):
        group_advantages(torch.zeros(4), group_size=0, estimator="grpo")
    with pytest.raises(ValueError, match="needs a critic"):
        group_advantages(torch.zeros(4), group_size=2, estimator="gae")
    with pytest.raises(ValueError, match="Unknown critic-free"):
        group_advantages(torch.zeros(4), group_size=2, estimator="ppo")
    with pytest.raises(ValueError, match=r"shape \(b,\)"):
        group_advantages(torch.zeros(2, 2), group_size=2, estimator="grpo")


def test_broadcast_to_tokens_with_ragged_mask() -> None:
    advantages = torch.tensor([2.0, -1.0, float("inf")], requires_grad=True)  # the last row has no real token
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    out = broadcast_to_tokens(advantages, mask)
    expected = torch.tensor([[2.0, 2.0, 2.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)
    weights = torch.tensor([[1.0, 2.0, 3.0], [4.0, GARBAGE, NAN], [NAN, GARBAGE, 5.0]])
    torch.where(mask.bool(), out * weights, torch.zeros_like(out)).sum().backward()
    # d/dA_i = sum of the weights at row i's real tokens: 1 + 2 + 3 = 6; 4; none -> 0
    torch.testing.assert_close(advantages.grad, torch.tensor([6.0, 4.0, 0.0]))


def test_reinforce_returns_hand_computed() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, GARBAGE], [NAN, GARBAGE, -GARBAGE]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    out = reinforce_returns(rewards, mask, gamma=0.9)
    expected = torch.tensor(
        [
            # G2 = 2; G1 = 0 + 0.9 * 2 = 1.8; G0 = 1 + 0.9 * 1.8 = 2.62
            [2.62, 1.8, 2.0],
            # t=1 is the last real token: G1 = 1; G0 = 0.5 + 0.9 * 1 = 1.4; padding 0
            [1.4, 1.0, 0.0],
            [0.0, 0.0, 0.0],  # no real token
        ]
    )
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    # d(sum_k G_k)/dr_t = sum_{k <= t} 0.9^(t - k): t0 1; t1 1 + 0.9 = 1.9; t2 1 + 0.9 + 0.81 = 2.71; padding 0
    expected_grad = torch.tensor([[1.0, 1.9, 2.71], [1.0, 1.9, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards.grad, expected_grad)
    # gamma = 1 (the default): reward to go, [1, 0, 2] -> [3, 2, 2] and [0.5, 1] -> [1.5, 1]
    expected = torch.tensor([[3.0, 2.0, 2.0], [1.5, 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(reinforce_returns(rewards.detach(), mask), expected)


def test_reinforce_returns_is_gae_without_critic() -> None:
    # with V = 0 and lam = 1, GAE's advantages are the discounted return to go
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = (torch.arange(7)[None, :] < torch.tensor([7, 1, 4, 6, 3])[:, None]).float()
    clean = reinforce_returns(rewards, mask, gamma=0.95)
    reference = gae(rewards, torch.zeros_like(rewards), mask, gamma=0.95, lam=1.0).advantages
    torch.testing.assert_close(clean, reference)
    dirty_rewards = rewards.clone()
    dirty_rewards[~mask.bool()] = NAN
    torch.testing.assert_close(reinforce_returns(dirty_rewards, mask, gamma=0.95), clean)


# two rows of different lengths (3 and 2 real tokens), garbage at the padded position
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 6.0, NAN]])
AGG_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("mode", "norm_length", "expected_loss", "expected_grad"),
    [
        # (1 + 2 + 3 + 4 + 6) / 5 = 16 / 5; every real token weighs 1 / 5
        ("token_mean", None, 3.2, [[0.2, 0.2, 0.2], [0.2, 0.2, 0.0]]),
        # row means 6 / 3 = 2 and 10 / 2 = 5 -> (2 + 5) / 2 = 3.5; weights 1 / (3 * 2) and 1 / (2 * 2)
        ("seq_mean_token_mean", None, 3.5, [[1 / 6, 1 / 6, 1 / 6], [0.25, 0.25, 0.0]]),
        # row sums / 4: 6 / 4 = 1.5 and 10 / 4 = 2.5 -> (1.5 + 2.5) / 2 = 2.0; every real token weighs 1 / (4 * 2)
        ("seq_mean_token_sum_norm", 4, 2.0, [[0.125, 0.125, 0.125], [0.125, 0.125, 0.0]]),
    ],
)
def test_aggregate_loss_hand_computed(
    mode: str, norm_length: int | None, expected_loss: float, expected_grad: list[list[float]]
) -> None:
    per_token = PER_TOKEN.clone().requires_grad_(True)
    loss = aggregate_loss(per_token, AGG_MASK, mode, norm_length)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected_loss)
    loss.backward()
    torch.testing.assert_close(per_token.grad, torch.tensor(expected_grad))

    # a third row without real tokens (holding garbage) changes nothing: it contributes 0 and is not counted
    per_token = torch.cat([PER_TOKEN, torch.tensor([[GARBAGE, float("inf"), NAN]])]).requires_grad_(True)
    mask = torch.cat([AGG_MASK, torch.zeros(1, 3, dtype=AGG_MASK.dtype)])
    loss = aggregate_loss(per_token, mask, mode, norm_length)
    assert loss.item() == pytest.approx(expected_loss)
    loss.backward()
    torch.testing.assert_close(per_token.grad, torch.tensor([*expected_grad, [0.0, 0.0, 0.0]]))


def test_aggregate_loss_token_mean_is_masked_mean_and_empty_batch_is_zero() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=gen)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 2, 5, 1])[:, None]).float()
    assert torch.equal(aggregate_loss(x, mask, "token_mean"), masked_mean(x, mask))
    for mode in LOSS_AGGREGATIONS:
        per_token = torch.full((2, 3), NAN, requires_grad=True)
        loss = aggregate_loss(per_token, torch.zeros(2, 3), mode, norm_length=3)
        assert loss.item() == 0.0
        loss.backward()
        assert (per_token.grad == 0).all()


def test_aggregate_loss_errors() -> None:
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(PER_TOKEN, AGG_MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(PER_TOKEN, AGG_MASK, "seq_mean_token_sum_norm", norm_length=0)
    with pytest.raises(ValueError, match="Unknown loss aggregation"):
        aggregate_loss(PER_TOKEN, AGG_MASK, "sum")


# policy_loss on rows of 3 and 1 real tokens; d = logprobs - old_logprobs = [0.1, -0.2, 0.05 | -0.3]
PL_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
PL_OLD = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
PL_LOGPROBS = torch.tensor([[-0.9, -1.2, -0.95], [-1.3, GARBAGE, -GARBAGE]])
PL_ADVANTAGES = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, GARBAGE]])


def _old_policy_loss(logprobs: torch.Tensor, cliprange: float) -> torch.Tensor:
    """policy_loss's loss as written before the aggregation modes."""
    real = PL_MASK.bool()
    d = torch.where(real, logprobs - PL_OLD, torch.zeros_like(logprobs))
    advantages = torch.where(real, PL_ADVANTAGES, torch.zeros_like(PL_ADVANTAGES))
    ratio = torch.exp(d)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return masked_mean(torch.maximum(pg1, pg2), PL_MASK)


def test_policy_loss_default_is_unchanged() -> None:
    results = []
    for kwargs in ({}, {"loss_aggregation": "token_mean"}):
        logprobs = PL_LOGPROBS.clone().requires_grad_(True)
        out = policy_loss(logprobs, PL_OLD, PL_ADVANTAGES, PL_MASK, 0.1, **kwargs)
        out.loss.backward()
        results.append((out, logprobs.grad))
    logprobs = PL_LOGPROBS.clone().requires_grad_(True)
    old_loss = _old_policy_loss(logprobs, 0.1)
    old_loss.backward()
    (default, default_grad), (explicit, explicit_grad) = results
    for x, y in zip(default, explicit, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(default.loss, old_loss)  # bit-identical
    assert torch.equal(default_grad, explicit_grad) and torch.equal(default_grad, logprobs.grad)


def test_policy_loss_sequence_aggregations() -> None:
    # ratio = 1 (logprobs = old): nothing clips and the per-token loss is -A = [-1, -2, -3 | -4]
    token = policy_loss(PL_OLD, PL_OLD, PL_ADVANTAGES, PL_MASK, 0.2)
    assert token.loss.item() == pytest.approx(-2.5)  # -(1 + 2 + 3 + 4) / 4
    seq = policy_loss(PL_OLD, PL_OLD, PL_ADVANTAGES, PL_MASK, 0.2, loss_aggregation="seq_mean_token_mean")
    assert seq.loss.item() == pytest.approx(-3.0)  # (-6 / 3 + -4 / 1) / 2
    norm = policy_loss(
        PL_OLD, PL_OLD, PL_ADVANTAGES, PL_MASK, 0.2, loss_aggregation="seq_mean_token_sum_norm", norm_length=3
    )
    assert norm.loss.item() == pytest.approx(-5 / 3)  # (-6 / 3 + -4 / 3) / 2

    # with ratios != 1 the detached statistics stay token means whatever the aggregation
    base = policy_loss(PL_LOGPROBS, PL_OLD, PL_ADVANTAGES, PL_MASK, 0.1)
    for mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
        logprobs = PL_LOGPROBS.clone().requires_grad_(True)
        out = policy_loss(logprobs, PL_OLD, PL_ADVANTAGES, PL_MASK, 0.1, loss_aggregation=mode, norm_length=3)
        for x, y in zip(out[1:], base[1:], strict=True):
            assert torch.equal(x, y)
        out.loss.backward()
        assert torch.isfinite(logprobs.grad).all() and (logprobs.grad[~PL_MASK.bool()] == 0).all()
    with pytest.raises(ValueError, match="norm_length"):
        policy_loss(PL_LOGPROBS, PL_OLD, PL_ADVANTAGES, PL_MASK, 0.1, loss_aggregation="seq_mean_token_sum_norm")


# d = logprobs - ref_logprobs = [0.1, -0.2 | 0.5]; padding holds garbage on both sides
KL_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
KL_LOGPROBS = torch.tensor([[-1.0, -1.5, -GARBAGE], [-0.5, GARBAGE, NAN]])
KL_REF = torch.tensor([[-1.1, -1.3, 0.0], [-1.0, 0.0, 5.0]])


def test_kl_loss_k3_hand_computed() -> None:
    logprobs = KL_LOGPROBS.clone().requires_grad_(True)
    ref = KL_REF.clone().requires_grad_(True)
    loss = kl_loss(logprobs, ref, KL_MASK)  # k3, token_mean
    # k3 = exp(-d) - 1 + d: d = 0.1: 0.904837 - 0.9 = 0.004837; d = -0.2: 1.221403 - 1.2 = 0.021403;
    #                       d = 0.5: 0.606531 - 0.5 = 0.106531;  mean (0.004837 + 0.021403 + 0.106531) / 3 = 0.044257
    assert loss.item() == pytest.approx(0.044257, abs=1e-6)
    loss.backward()
    # dk3/dd = 1 - exp(-d): 0.095163, -0.221403, 0.393469; / 3 tokens; padding 0 (no 0 * exp(1e6) = NaN)
    expected_grad = torch.tensor([[0.031721, -0.073801, 0.0], [0.131156, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected_grad, atol=1e-6, rtol=0)
    assert ref.grad is None  # the reference is detached

    logprobs = KL_LOGPROBS.clone().requires_grad_(True)
    loss = kl_loss(logprobs, KL_REF, KL_MASK, loss_aggregation="seq_mean_token_mean")
    # row means (0.004837 + 0.021403) / 2 = 0.013120 and 0.106531 -> (0.013120 + 0.106531) / 2 = 0.059825
    assert loss.item() == pytest.approx(0.059825, abs=1e-6)
    loss.backward()
    # weights 1 / (2 * 2) on row 0 and 1 / (1 * 2) on row 1: 0.095163 / 4, -0.221403 / 4, 0.393469 / 2
    expected_grad = torch.tensor([[0.023791, -0.055351, 0.0], [0.196735, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected_grad, atol=1e-6, rtol=0)

    # Dr. GRPO: row sums / 4, then the mean: ((0.004837 + 0.021403) / 4 + 0.106531 / 4) / 2 = 0.016596
    loss = kl_loss(KL_LOGPROBS, KL_REF, KL_MASK, loss_aggregation="seq_mean_token_sum_norm", norm_length=4)
    assert loss.item() == pytest.approx(0.016596, abs=1e-6)


def test_kl_loss_other_estimators_and_errors() -> None:
    # k1 = d: (0.1 - 0.2 + 0.5) / 3 = 0.133333; k2 = d^2 / 2: (0.005 + 0.02 + 0.125) / 3 = 0.05
    assert kl_loss(KL_LOGPROBS, KL_REF, KL_MASK, estimator="k1").item() == pytest.approx(0.4 / 3, abs=1e-6)
    assert kl_loss(KL_LOGPROBS, KL_REF, KL_MASK, estimator="k2").item() == pytest.approx(0.05, abs=1e-6)
    with pytest.raises(ValueError, match="Unknown KL estimator"):
        kl_loss(KL_LOGPROBS, KL_REF, KL_MASK, estimator="k4")
    with pytest.raises(ValueError, match="norm_length"):
        kl_loss(KL_LOGPROBS, KL_REF, KL_MASK, loss_aggregation="seq_mean_token_sum_norm")
