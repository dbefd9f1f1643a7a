from __future__ import annotations

import pytest
import torch

from rlhf.ops.losses import pairwise_reward_loss, policy_loss, value_loss

GARBAGE = 1e6

# two rows, two real tokens each, one padded position holding garbage
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])
OLD_LOGPROBS = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])
# d = logprobs - old_logprobs = [0.1, -0.2 | 0.05, -0.3]
LOGPROBS = torch.tensor([[-0.9, -1.2, GARBAGE], [-0.95, -1.3, -GARBAGE]])
ADVANTAGES = torch.tensor([[2.0, 2.0, GARBAGE], [-1.0, -1.0, GARBAGE]])


def test_policy_loss_some_ratios_clip() -> None:
    logprobs = LOGPROBS.clone().requires_grad_(True)
    out = policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, cliprange=0.1)
    # tok0: ratio = exp(0.1) = 1.105171, A = 2:   pg1 = -2.210342, clipped to 1.1 -> pg2 = -2.2;    max -2.2 (clip)
    # tok1: ratio = exp(-0.2) = 0.818731, A = 2:  pg1 = -1.637462, clipped to 0.9 -> pg2 = -1.8;    max -1.637462
    # tok2: ratio = exp(0.05) = 1.051271, A = -1: pg1 = 1.051271, inside the range -> pg2 = pg1;    max 1.051271
    # tok3: ratio = exp(-0.3) = 0.740818, A = -1: pg1 = 0.740818, clipped to 0.9 -> pg2 = 0.9;      max 0.9 (clip)
    # loss = (-2.2 - 1.637462 + 1.051271 + 0.9) / 4 = -0.471548
    assert out.loss.item() == pytest.approx(-0.471548, abs=1e-6)
    assert out.clipfrac.item() == pytest.approx(0.5)  # 2 of 4
    assert out.approx_kl.item() == pytest.approx(0.0178125)  # 0.5 * (0.01 + 0.04 + 0.0025 + 0.09) / 4
    assert out.policy_kl.item() == pytest.approx(0.0875)  # -(0.1 - 0.2 + 0.05 - 0.3) / 4
    assert out.ratio_mean.item() == pytest.approx(0.928998, abs=1e-6)  # (1.105171 + 0.818731 + 1.051271 + 0.740818) / 4
    # deviations 0.176173, -0.110267, 0.122273, -0.188180; squares sum 0.093558 -> / 4
    assert out.ratio_var.item() == pytest.approx(0.0233895, abs=1e-6)

    assert out.loss.requires_grad
    for stat in out[1:]:
        assert not stat.requires_grad
    out.loss.backward()
    # clipped tokens get no gradient; tok1: d(-A * ratio)/dlogp / 4 = -2 * 0.818731 / 4 = -0.409365;
    # tok2: 1.051271 / 4 = 0.262818; padding 0
    expected_grad = torch.tensor([[0.0, -0.409365, 0.0], [0.262818, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected_grad, atol=1e-6, rtol=0)


def test_policy_loss_ratio_one() -> None:
    out = policy_loss(OLD_LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, cliprange=0.2)
    # ratio = 1 everywhere: pg1 = pg2 = -A, nothing clipped; loss = -(2 + 2 - 1 - 1) / 4 = -0.5
    assert out.loss.item() == pytest.approx(-0.5)
    assert out.clipfrac.item() == 0.0
    assert out.approx_kl.item() == 0.0
    assert out.policy_kl.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)
    assert out.ratio_var.item() == pytest.approx(0.0)


def test_policy_loss_padding_invariance_and_finite_grad() -> None:
    other_lp, other_adv = LOGPROBS.clone(), ADVANTAGES.clone()
    other_lp[:, 2], other_adv[:, 2] = torch.tensor([3.0, -2.0]), torch.tensor([float("nan"), 0.5])
    a = policy_loss(LOGPROBS, OLD_LOGPROBS, ADVANTAGES, MASK, cliprange=0.1)
    b = policy_loss(other_lp, OLD_LOGPROBS, other_adv, MASK, cliprange=0.1)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)
    logprobs = LOGPROBS.clone().requires_grad_(True)
    policy_loss(logprobs, OLD_LOGPROBS, ADVANTAGES, MASK, cliprange=0.1).loss.backward()
    assert torch.isfinite(logprobs.grad).all()


# one row: three real tokens and one padded
V_MASK = torch.tensor([[1, 1, 1, 0]])
VALUES = torch.tensor([[1.0, 2.0, 0.5, GARBAGE]])
OLD_VALUES = torch.tensor([[0.9, 2.5, 1.0, -GARBAGE]])
RETURNS = torch.tensor([[1.5, 1.0, 1.0, GARBAGE]])


def test_value_loss_clipped() -> None:
    out = value_loss(VALUES, OLD_VALUES, RETURNS, V_MASK, cliprange_value=0.2)
    # tok0: V - old = 0.1 inside -> Vc = 1.0;    (1 - 1.5)^2 = 0.25, (1.0 - 1.5)^2 = 0.25 -> 0.25 (not clipped)
    # tok1: V - old = -0.5 -> -0.2, Vc = 2.3;     (2 - 1)^2 = 1.0,    (2.3 - 1)^2 = 1.69   -> 1.69 (clipped)
    # tok2: V - old = -0.5 -> -0.2, Vc = 0.8;     (0.5 - 1)^2 = 0.25, (0.8 - 1)^2 = 0.04   -> 0.25 (not clipped)
    # loss = 0.5 * (0.25 + 1.69 + 0.25) / 3 = 0.5 * 0.73 = 0.365
    assert out.loss.item() == pytest.approx(0.365)
    assert out.clipfrac.item() == pytest.approx(1 / 3)
    assert out.value_error.item() == pytest.approx(0.5)  # (0.25 + 1.0 + 0.25) / 3


def test_value_loss_unclipped() -> None:
    values = VALUES.clone().requires_grad_(True)
    out = value_loss(values, OLD_VALUES, RETURNS, V_MASK, cliprange_value=None)
    assert out.loss.item() == pytest.approx(0.25)  # 0.5 * (0.25 + 1.0 + 0.25) / 3
    assert out.clipfrac.item() == 0.0
    assert out.value_error.item() == pytest.approx(0.5)
    out.loss.backward()
    # d/dV 0.5 * mean((V - R)^2) = (V - R) / 3: -0.5 / 3, 1 / 3, -0.5 / 3; padding 0
    torch.testing.assert_close(values.grad, torch.tensor([[-1 / 6, 1 / 3, -1 / 6, 0.0]]))


def test_value_loss_padding_invariance() -> None:
    other_v, other_old, other_ret = VALUES.clone(), OLD_VALUES.clone(), RETURNS.clone()
    other_v[0, 3], other_old[0, 3], other_ret[0, 3] = -4.0, float("inf"), 7.0
    for clip in (0.2, None):
        a = value_loss(VALUES, OLD_VALUES, RETURNS, V_MASK, cliprange_value=clip)
        b = value_loss(other_v, other_old, other_ret, V_MASK, cliprange_value=clip)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y)


def test_pairwise_loss_margin_and_centring() -> None:
    chosen = torch.tensor([2.0, 0.5], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0])
    out = pairwise_reward_loss(chosen, rejected, margin=torch.tensor([0.5, 0.0]), center_coef=0.01)
    # logits: 2 - 1 - 0.5 = 0.5; 0.5 - 1 - 0 = -0.5
    # -logsigmoid(0.5) = log(1 + exp(-0.5)) = 0.474077; -logsigmoid(-0.5) = log(1 + exp(0.5)) = 0.974077
    # mean 0.724077; centring 0.01 * ((2 + 1)^2 + (0.5 + 1)^2) / 2 = 0.01 * (9 + 2.25) / 2 = 0.05625
    assert out.loss.item() == pytest.approx(0.780327, abs=1e-6)
    assert out.accuracy.item() == pytest.approx(0.5)  # 2 > 1 yes, 0.5 > 1 no
    assert out.margin.item() == pytest.approx(0.25)  # (1.0 - 0.5) / 2
    assert out.loss.requires_grad and not out.accuracy.requires_grad and not out.margin.requires_grad


def test_pairwise_loss_plain() -> None:
    out = pairwise_reward_loss(torch.tensor([2.0, 0.5]), torch.tensor([1.0, 1.0]))
    # logits 1.0, -0.5: (log(1 + exp(-1)) + log(1 + exp(0.5))) / 2 = (0.313262 + 0.974077) / 2 = 0.643669
    assert out.loss.item() == pytest.approx(0.643669, abs=1e-6)


def test_value_loss_clip_fraction_is_zero_when_nothing_is_clipped() -> None:
    # |V - V_old| = 0.13 < 0.2: V_old + (V - V_old) rounds away from V in float32, clamping V itself does not
    values = torch.tensor([[0.09]], requires_grad=True)
    old, returns, mask = torch.tensor([[-0.04]]), torch.tensor([[1.0]]), torch.ones(1, 1)
    out = value_loss(values, old, returns, mask, 0.2)
    assert out.clipfrac.item() == 0.0
    expected = 0.5 * (torch.tensor(0.09) - 1.0) ** 2
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.09 - 1.0]]))
    # clipped from above and below: the clipped error is the larger one, the gradient is 0
    values = torch.tensor([[0.5, -0.5]], requires_grad=True)
    out = value_loss(values, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2)
    assert out.clipfrac.item() == 1.0
    torch.testing.assert_close(out.loss, torch.tensor(0.5 * (0.8**2 + 0.8**2) / 2))
    out.loss.backward()
    torch.testing.assert_close(values.grad, torch.zeros(1, 2))
