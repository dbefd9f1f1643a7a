from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhf.ops import DPO_LOSS_TYPES, dpo_loss, sequence_logps

# two pairs of sequence log-probs (sums over response tokens)
POLICY_CHOSEN = torch.tensor([-3.0, -5.0])
POLICY_REJECTED = torch.tensor([-4.0, -4.0])
REF_CHOSEN = torch.tensor([-3.5, -4.5])
REF_REJECTED = torch.tensor([-3.0, -4.5])
# policy log-ratios (chosen - rejected): 1.0, -1.0; reference log-ratios: -0.5, 0.0
# h = policy log-ratio - reference log-ratio = [1.5, -1.0]
BETA = 0.5  # beta * h = [0.75, -0.5]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return POLICY_CHOSEN.clone().requires_grad_(True), POLICY_REJECTED.clone().requires_grad_(True)


def test_sigmoid_loss_rewards_and_gradients_by_hand() -> None:
    chosen, rejected = _inputs()
    out = dpo_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, BETA)
    # -logsigmoid(0.75) = log(1 + exp(-0.75)) = 0.386871; -logsigmoid(-0.5) = log(1 + exp(0.5)) = 0.974077
    # mean (0.386871 + 0.974077) / 2 = 0.680474
    assert out.loss.item() == pytest.approx(0.680474, abs=1e-6)
    # implicit rewards beta * (policy - ref): chosen 0.5 * 0.5 = 0.25, 0.5 * -0.5 = -0.25;
    # rejected 0.5 * -1.0 = -0.5, 0.5 * 0.5 = 0.25
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.25, -0.25]))
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([-0.5, 0.25]))
    assert out.reward_margin.item() == pytest.approx(0.125)  # (0.75 - 0.5) / 2 = beta * mean(h)
    assert out.reward_accuracy.item() == pytest.approx(0.5)  # 0.25 > -0.5 yes, -0.25 > 0.25 no

    assert out.loss.requires_grad
    for stat in out[1:]:
        assert not stat.requires_grad
    out.loss.backward()
    # d/dh of -logsigmoid(beta * h) / b = -beta * sigmoid(-beta * h) / 2:
    # row 0: -0.5 * sigmoid(-0.75) / 2 = -0.25 * 0.320821 = -0.080205; row 1: -0.25 * sigmoid(0.5) = -0.25 * 0.622459
    # = -0.155615; h grows with the chosen log-prob and falls with the rejected one
    expected = torch.tensor([-0.080205, -0.155615])
    torch.testing.assert_close(chosen.grad, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rejected.grad, -expected, atol=1e-6, rtol=0)


def test_label_smoothing_by_hand() -> None:
    chosen, rejected = _inputs()
    out = dpo_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, BETA, label_smoothing=0.1)
    # row 0: 0.9 * -logsigmoid(0.75) + 0.1 * -logsigmoid(-0.75) = 0.9 * 0.386871 + 0.1 * 1.136871 = 0.461871
    # row 1: 0.9 * -logsigmoid(-0.5) + 0.1 * -logsigmoid(0.5)   = 0.9 * 0.974077 + 0.1 * 0.474077 = 0.924077
    # mean (0.461871 + 0.924077) / 2 = 0.692974
    assert out.loss.item() == pytest.approx(0.692974, abs=1e-6)
    # the rewards do not depend on the smoothing
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.25, -0.25]))
    out.loss.backward()
    # d/dh = beta * (sigmoid(beta * h) - (1 - ls)) / 2: zero where sigmoid(beta * h) = 0.9, the conservative target
    # row 0: 0.25 * (0.679179 - 0.9) = -0.055205; row 1: 0.25 * (0.377541 - 0.9) = -0.130615
    expected = torch.tensor([-0.055205, -0.130615])
    torch.testing.assert_close(chosen.grad, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(rejected.grad, -expected, atol=1e-6, rtol=0)


def test_ipo_loss_by_hand() -> None:
    chosen, rejected = _inputs()
    out = dpo_loss(chosen, rejected, REF_CHOSEN, REF_REJECTED, BETA, loss_type="ipo")
    # target 1 / (2 * beta) = 1.0: (1.5 - 1)^2 = 0.25, (-1 - 1)^2 = 4.0; mean 2.125
    assert out.loss.item() == pytest.approx(2.125)
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([0.25, -0.25]))  # same implicit rewards
    assert out.reward_margin.item() == pytest.approx(0.125)
    out.loss.backward()
    # d/dh (h - 1)^2 / 2 = (h - 1): 0.5, -2.0; h past its target (row 0) is pulled back
    torch.testing.assert_close(chosen.grad, torch.tensor([0.5, -2.0]))
    torch.testing.assert_close(rejected.grad, torch.tensor([-0.5, 2.0]))


def test_policy_equal_to_reference() -> None:
    # the first step of training: h = 0 for every pair
    out = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, POLICY_CHOSEN, POLICY_REJECTED, BETA)
    assert out.loss.item() == pytest.approx(math.log(2))  # -logsigmoid(0) = log 2 = 0.693147
    assert out.reward_margin.item() == 0.0
    assert out.reward_accuracy.item() == 0.0  # ties are not counted as right
    smoothed = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, POLICY_CHOSEN, POLICY_REJECTED, BETA, label_smoothing=0.2)
    assert smoothed.loss.item() == pytest.approx(math.log(2))  # (0.8 + 0.2) * log 2
    ipo = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, POLICY_CHOSEN, POLICY_REJECTED, BETA, loss_type="ipo")
    assert ipo.loss.item() == pytest.approx(1.0)  # (0 - 1)^2


def test_reference_gets_no_gradient() -> None:
    ref_chosen, ref_rejected = REF_CHOSEN.clone().requires_grad_(True), REF_REJECTED.clone().requires_grad_(True)
    chosen, rejected = _inputs()
    for loss_type in DPO_LOSS_TYPES:
        dpo_loss(chosen, rejected, ref_chosen, ref_rejected, BETA, loss_type=loss_type).loss.backward()
    assert ref_chosen.grad is None and ref_rejected.grad is None
    assert chosen.grad is not None and rejected.grad is not None


def _bradley_terry_dpo(pc, pr, rc, rr, beta, loss_type, label_smoothing):
    """A second implementation, in float64, from the definitions rather than from `dpo_loss`'s formula: DPO as
    the cross-entropy of a Bradley-Terry preference over the two implicit rewards, against a label that is right
    with probability 1 - ls (Rafailov et al. 2023 Eq. 7; conservative DPO); IPO as Azar et al.'s Eq. 17 with TRL's
    convention (the log-ratio difference regressed onto 1 / (2 * beta)). Returns the per-pair losses."""
    pc, pr, rc, rr = (x.double() for x in (pc, pr, rc, rr))
    rewards = torch.stack([beta * (pc - rc), beta * (pr - rr)], dim=-1)  # (b, 2): chosen, rejected
    if loss_type == "ipo":
        h = (rewards[:, 0] - rewards[:, 1]) / beta
        return (h - 1 / (2 * beta)) ** 2
    # P(chosen preferred) = exp(r_c) / (exp(r_c) + exp(r_r)): a softmax over the two rewards; the label says
    # 'chosen' with probability 1 - ls and 'rejected' with ls
    labels = torch.tensor([1.0 - label_smoothing, label_smoothing], dtype=rewards.dtype).expand_as(rewards)
    return F.cross_entropy(rewards, labels, reduction="none")


def _trl_dpo(pc, pr, rc, rr, beta, loss_type, label_smoothing):
    """TRL's DPOTrainer.dpo_loss for 'sigmoid' and 'ipo', written out from its documented definition."""
    logits = (pc - pr) - (rc - rr)
    if loss_type == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


@pytest.mark.parametrize(
    ("loss_type", "beta", "label_smoothing"),
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.25), ("sigmoid", 2.0, 0.1), ("ipo", 0.1, 0.0), ("ipo", 1.0, 0.0)],
)
def test_matches_independent_implementations(loss_type, beta, label_smoothing) -> None:
    gen = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-20 * torch.rand(16, generator=gen, dtype=torch.float64) for _ in range(4))
    chosen, rejected = pc.clone().requires_grad_(True), pr.clone().requires_grad_(True)
    out = dpo_loss(chosen, rejected, rc, rr, beta, loss_type, label_smoothing)
    out.loss.backward()
    for reference in (_bradley_terry_dpo, _trl_dpo):
        ref_chosen, ref_rejected = pc.clone().requires_grad_(True), pr.clone().requires_grad_(True)
        expected = reference(ref_chosen, ref_rejected, rc, rr, beta, loss_type, label_smoothing).mean()
        expected.backward()
        torch.testing.assert_close(out.loss, expected)
        torch.testing.assert_close(chosen.grad, ref_chosen.grad)
        torch.testing.assert_close(rejected.grad, ref_rejected.grad)
    # TRL's statistics: rewards beta * (policy - ref); accuracy counts chosen > rejected
    torch.testing.assert_close(out.chosen_rewards, beta * (pc - rc))
    torch.testing.assert_close(out.rejected_rewards, beta * (pr - rr))
    torch.testing.assert_close(out.reward_margin, (beta * (pc - rc) - beta * (pr - rr)).mean())
    assert out.reward_accuracy.item() == pytest.approx(((pc - rc) > (pr - rr)).double().mean().item())


def test_large_log_ratios_stay_finite() -> None:
    # sums over long responses: |beta * h| in the hundreds must not overflow (logsigmoid, not log(sigmoid))
    chosen = torch.tensor([-10.0, -900.0], requires_grad=True)
    out = dpo_loss(chosen, torch.tensor([-900.0, -10.0]), torch.zeros(2), torch.zeros(2), beta=1.0)
    # row 0: h = 890 -> loss ~ exp(-890) = 0; row 1: h = -890 -> loss ~ 890; mean 445
    assert out.loss.item() == pytest.approx(445.0)
    out.loss.backward()
    torch.testing.assert_close(chosen.grad, torch.tensor([0.0, -0.5]))  # -beta * sigmoid(-beta * h) / 2


def test_invalid_settings_are_errors() -> None:
    args = (POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED)
    with pytest.raises(ValueError, match="Unknown DPO loss type 'hinge'"):
        dpo_loss(*args, BETA, loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing applies to the 'sigmoid' loss only"):
        dpo_loss(*args, BETA, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo_loss(*args, 0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        dpo_loss(*args, BETA, label_smoothing=0.5)


# one sequence of three positions over a vocabulary of three; the last position is padding holding garbage
LN2 = math.log(2.0)
LOGITS = torch.tensor([[[0.0, LN2, 0.0], [0.0, 0.0, 0.0], [50.0, -50.0, 7.0]]])
LABELS = torch.tensor([[1, 0, 2]])
MASK = torch.tensor([[1, 1, 0]])


def test_sequence_logps_by_hand() -> None:
    logits = LOGITS.clone().requires_grad_(True)
    # position 0: probs (1, 2, 1) / 4, label 1 -> log 0.5 = -0.693147; position 1: uniform, label 0 -> -log 3 =
    # -1.098612; position 2 is padding. Sum -1.791759, mean -0.895880
    total = sequence_logps(logits, LABELS, MASK)
    assert total.shape == (1,)
    assert total.item() == pytest.approx(-1.791759, abs=1e-6)
    mean = sequence_logps(LOGITS, LABELS, MASK, average=True)
    assert mean.item() == pytest.approx(-0.895880, abs=1e-6)
    total.sum().backward()
    # d log p_y / d z = onehot(y) - p: position 0 (-0.25, 0.5, -0.25), position 1 (2/3, -1/3, -1/3); padding 0
    expected = torch.tensor([[[-0.25, 0.5, -0.25], [2 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0]]])
    torch.testing.assert_close(logits.grad, expected)


def test_sequence_logps_padding_invariance_and_empty_rows() -> None:
    other = LOGITS.clone()
    other[0, 2] = torch.tensor([-3.0, 9.0, 1.0])
    torch.testing.assert_close(sequence_logps(LOGITS, LABELS, MASK), sequence_logps(other, LABELS, MASK))
    empty = torch.zeros_like(MASK)
    assert sequence_logps(LOGITS, LABELS, empty).item() == 0.0
    assert sequence_logps(LOGITS, LABELS, empty, average=True).item() == 0.0
