"""DAPO, GSPO, RLOO with a sequence ratio, and GRPO's reward scaling: against hand-computed numbers, and against
second implementations written here from the papers and from TRL's and veRL's code (rlhf.ops must agree with both)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.ops import (
    aggregate_loss,
    group_advantages,
    importance_log_ratios,
    overlong_penalty,
    policy_loss,
    sequence_logps,
    shape_scores,
)


def _leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


# two responses, the second one token long (its second position is padding, with garbage in it)
OLD = torch.tensor([[0.0, 0.0], [0.0, 99.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)


def test_clip_higher_by_hand() -> None:
    # token ratios 1.25 (advantage +1) and 0.7 (advantage -1)
    logprobs = _leaf([[math.log(1.25), math.log(0.7)]])
    old, mask, adv = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64), None
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    # eps_low 0.2, eps_high 0.28: 1.25 is inside [0.8, 1.28] -> -1.25; 0.7 clips up to 0.8 -> max(0.7, 0.8) = 0.8
    out = policy_loss(logprobs, old, adv, mask, 0.2, cliprange_high=0.28)
    assert out.loss.item() == pytest.approx((-1.25 + 0.8) / 2)
    assert out.clipfrac.item() == pytest.approx(0.5)
    # symmetric 0.2: 1.25 clips to 1.2 -> max(-1.25, -1.2) = -1.2
    sym = policy_loss(logprobs, old, adv, mask, 0.2)
    assert sym.loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert sym.clipfrac.item() == pytest.approx(1.0)
    # the gradient: only the unclipped token 0 moves, d(-A r)/d logp = -A r = -1.25, over 2 tokens
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.25 / 2, 0.0]], dtype=torch.float64))


def test_gspo_sequence_ratio_by_hand() -> None:
    # response 0: token log-ratios 0.2, -0.1 -> mean 0.05, s0 = e^0.05 = 1.051271; advantage +1
    # response 1: one token, log-ratio 0.03 -> s1 = e^0.03 = 1.030455; advantage -1
    logprobs = _leaf([[0.2, -0.1], [0.03, -5.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    ratios = importance_log_ratios(logprobs.detach() - OLD, MASK, "sequence").exp()
    expected_ratios = torch.tensor([[1.051271, 1.051271], [1.030455, 0.0]], dtype=ratios.dtype)
    torch.testing.assert_close(ratios * MASK, expected_ratios, atol=1e-6, rtol=0)
    # eps 0.04 both ways: s0 clips to 1.04 (-A s0 = -1.0513 < -1.04: the clipped term is larger), s1 stays
    out = policy_loss(logprobs, OLD, adv, MASK, 0.04, importance_sampling_level="sequence")
    assert out.loss.item() == pytest.approx((-1.04 + 1.030455) / 2, abs=1e-6)  # the mean over the two responses
    assert out.seq_clipfrac.item() == pytest.approx(0.5)  # response 0 of 2
    assert out.clipfrac.item() == pytest.approx(2 / 3)  # its 2 tokens of 3
    # gradient: response 0 clipped -> 0; response 1: 1/2 * (-A) * s1 * (1 / |y1|) = 0.5 * 1.030455
    out.loss.backward()
    expected = torch.tensor([[0.0, 0.0], [0.5 * math.exp(0.03), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected)


def test_rloo_sequence_sum_ratio_by_hand() -> None:
    # response 0: summed log-ratio 0.1 -> r0 = e^0.1 = 1.105171, advantage +1, inside 1 +- 0.2
    # response 1: 0.03 -> r1 = 1.030455, advantage -1
    logprobs = _leaf([[0.2, -0.1], [0.03, 7.0]])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    out = policy_loss(logprobs, OLD, adv, MASK, 0.2, importance_sampling_level="sequence_sum")
    assert out.loss.item() == pytest.approx((-math.exp(0.1) + math.exp(0.03)) / 2)
    assert out.seq_clipfrac.item() == 0.0
    out.loss.backward()
    # d/d logp_t of -A exp(sum d) / 2: every token of a response gets -A r / 2
    expected = torch.tensor([[-math.exp(0.1) / 2] * 2, [math.exp(0.03) / 2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected)


def test_a_huge_summed_ratio_stays_finite() -> None:
    logprobs = _leaf([[60.0, 60.0], [0.0, 0.0]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    out = policy_loss(
        logprobs.float(), OLD.float(), adv.float(), MASK.float(), 0.2, importance_sampling_level="sequence_sum"
    )
    assert math.isfinite(out.loss.item())


# -- second implementations, written from the papers and the peers' code ---------------------------------------


def gspo_as_verl(logp, old, adv, mask, eps_low, eps_high):
    """veRL's compute_policy_loss_gspo (core_algos.py): a per-token sequence ratio through a stop-gradient, the
    clipped loss aggregated seq-mean-token-mean."""
    neg_kl = logp - old
    lengths = mask.sum(-1).clamp(min=1)
    neg_kl_seq = (neg_kl * mask).sum(-1) / lengths
    log_ratio = logp - logp.detach() + neg_kl_seq.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    losses = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    per_seq = (losses * mask).sum(-1) / lengths
    return per_seq.mean()


def rloo_as_trl(logp, old, adv_seq, mask, eps):
    """TRL 0.19's RLOOTrainer: summed log-probs, one ratio per response, clipped, the mean over responses."""
    new_sum = (logp * mask).sum(1)
    old_sum = (old * mask).sum(1)
    ratio = torch.exp(new_sum - old_sum)
    pg1 = -adv_seq * ratio
    pg2 = -adv_seq * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
    return torch.max(pg1, pg2).mean()


def dapo_as_trl(logp, old, adv, mask, eps_low, eps_high):
    """TRL's GRPOTrainer with loss_type='dapo' (one process, one step): per-token min of the two surrogates with
    epsilon_low and epsilon_high, summed over the batch's tokens and divided by their count."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 5
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.15 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    lengths = torch.tensor([5, 3, 1, 4, 5, 2])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    adv_seq = torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, adv_seq, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_agrees_with_a_verl_style_implementation(seed: int) -> None:
    logp, old, adv_seq, mask = _batch(seed)
    adv = adv_seq[:, None].expand_as(mask)
    ours = policy_loss(logp, old, adv, mask, 0.01, cliprange_high=0.02, importance_sampling_level="sequence")
    (grad,) = torch.autograd.grad(ours.loss, logp)
    peer_logp = logp.detach().clone().requires_grad_(True)
    theirs = gspo_as_verl(peer_logp, old, adv, mask, 0.01, 0.02)
    (peer_grad,) = torch.autograd.grad(theirs, peer_logp)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(grad * mask, peer_grad * mask)
    # with ratios this spread some responses clip and some do not: the comparison covers both branches
    assert 0.0 < ours.seq_clipfrac.item() < 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rloo_sequence_agrees_with_trls_rloo_trainer(seed: int) -> None:
    logp, old, adv_seq, mask = _batch(seed)
    adv = adv_seq[:, None].expand_as(mask)
    ours = policy_loss(logp, old, adv, mask, 0.2, importance_sampling_level="sequence_sum")
    (grad,) = torch.autograd.grad(ours.loss, logp)
    peer_logp = logp.detach().clone().requires_grad_(True)
    theirs = rloo_as_trl(peer_logp, old, adv_seq, mask, 0.2)
    (peer_grad,) = torch.autograd.grad(theirs, peer_logp)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(grad * mask, peer_grad * mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dapo_token_loss_agrees_with_trls_dapo_loss(seed: int) -> None:
    logp, old, adv_seq, mask = _batch(seed)
    adv = adv_seq[:, None].expand_as(mask)
    ours = policy_loss(logp, old, adv, mask, 0.1, cliprange_high=0.14, loss_aggregation="token_mean")
    (grad,) = torch.autograd.grad(ours.loss, logp)
    peer_logp = logp.detach().clone().requires_grad_(True)
    theirs = dapo_as_trl(peer_logp, old, adv, mask, 0.1, 0.14)
    (peer_grad,) = torch.autograd.grad(theirs, peer_logp)
    torch.testing.assert_close(ours.loss, theirs)
    torch.testing.assert_close(grad * mask, peer_grad * mask)


def test_rloo_with_one_epoch_is_the_papers_reinforce_gradient() -> None:
    # on-policy (logp == old) the sequence ratio is 1 and the gradient is A * grad(sum log pi) / b: REINFORCE with
    # the leave-one-out baseline, as Ahmadian et al. 2024 write it
    logp, _, adv_seq, mask = _batch(3)
    adv = adv_seq[:, None].expand_as(mask)
    out = policy_loss(logp, logp.detach(), adv, mask, 0.2, importance_sampling_level="sequence_sum")
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, -adv * mask / len(adv_seq))


def test_a_sequence_ratio_with_token_advantages_takes_each_tokens_advantage() -> None:
    # REINFORCE++ (baseline) gives each token its own advantage: each token's term is -A_t * s, then the response's
    # mean over its tokens, then the mean over responses
    logp, old, _, mask = _batch(4)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out = policy_loss(logp, old, adv, mask, 10.0, importance_sampling_level="sequence")  # nothing clips
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))
    expected = aggregate_loss(-adv * s[:, None], mask, "seq_mean_token_mean")
    torch.testing.assert_close(out.loss, expected)


# -- GRPO's reward scaling, the overlong penalty --------------------------------------------------------------

SCORES = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 3.0, 5.0, 5.0, 5.0])


def test_scale_rewards_group_batch_none_by_hand() -> None:
    centred = torch.tensor([-1.0, 0.0, 1.0, 3.0, -3.0, 0.0, 0.0, 0.0, 0.0])  # each group's mean 2, 3, 5 removed
    # the batch: mean 30 / 9; squared deviations sum to 34.0; unbiased var 34 / 8 = 4.25, std 2.0616
    batch = group_advantages(SCORES, 3, "grpo", eps=0.0, scale="batch")
    torch.testing.assert_close(batch.advantages, centred / math.sqrt(4.25))
    none = group_advantages(SCORES, 3, "grpo", eps=0.0, scale="none")
    torch.testing.assert_close(none.advantages, centred)
    torch.testing.assert_close(none.advantages, group_advantages(SCORES, 3, "dr_grpo").advantages)
    group = group_advantages(SCORES, 3, "grpo", eps=0.0, scale="group")
    torch.testing.assert_close(group.advantages, group_advantages(SCORES, 3, "grpo", eps=0.0).advantages)
    # several processes pass the global batch's std
    given = group_advantages(SCORES, 3, "grpo", eps=0.0, scale="batch", batch_std=torch.tensor(2.0))
    torch.testing.assert_close(given.advantages, centred / 2.0)
    with pytest.raises(ValueError, match="scale 'batch' applies to grpo and dr_grpo"):
        group_advantages(SCORES, 3, "rloo", scale="batch")


def test_overlong_penalty_by_hand() -> None:
    # L_max 24, L_cache 4: free up to 20 tokens, then (20 - |y|) / 4
    lengths = torch.tensor([1.0, 20.0, 21.0, 23.0, 24.0])
    torch.testing.assert_close(overlong_penalty(lengths, 24, 4), torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0]))
    torch.testing.assert_close(
        overlong_penalty(lengths, 24, 4, factor=0.5), torch.tensor([0.0, 0.0, -0.125, -0.375, -0.5])
    )
    shaped = shape_scores(
        torch.tensor([1.0, 1.0]), torch.tensor([10, 23]), torch.tensor([True, True]),
        overlong_max_length=24, overlong_buffer=4,
    )  # fmt: skip
    torch.testing.assert_close(shaped.scores, torch.tensor([1.0, 0.25]))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 24, 30)


# -- sequence_logps: garbage at padded positions ------------------------------------------------------------------


@pytest.mark.parametrize("garbage", [float("inf"), float("-inf"), float("nan"), 1e6])
def test_sequence_logps_ignores_garbage_logits_at_padding(garbage: float) -> None:
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(2, 3, 5, generator=g)
    labels = torch.tensor([[1, 4, 0], [2, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    dirty = clean.clone()
    dirty[0, 2] = garbage
    dirty[1, 1:] = garbage
    dirty.requires_grad_(True)
    for average in (False, True):
        value = sequence_logps(dirty, labels, mask, average=average)
        torch.testing.assert_close(value, sequence_logps(clean, labels, mask, average=average))
        (grad,) = torch.autograd.grad(value.sum(), dirty)
        assert torch.isfinite(grad).all()
        assert (grad[0, 2] == 0).all() and (grad[1, 1:] == 0).all()
