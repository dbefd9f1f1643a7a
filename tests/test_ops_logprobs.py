from __future__ import annotations

import math

import pytest
import torch

from rlhf.ops.logprobs import entropy_from_logits, logprobs_from_logits

# (b=1, t=2, v=3)
LOGITS = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
LABELS = torch.tensor([[2, 0]])


def test_logprobs_hand_computed_with_temperature() -> None:
    out = logprobs_from_logits(LOGITS, LABELS, temperature=2.0)
    # t0: logits / 2 = [0.5, 1.0, 1.5]; logsumexp = log(1.648721 + 2.718282 + 4.481689) = log(8.848692) = 2.180270
    #     label 2 -> 1.5 - 2.180270 = -0.680270
    # t1: uniform over 3 -> log(1/3) = -1.098612
    torch.testing.assert_close(out, torch.tensor([[-0.680270, -1.098612]]), atol=1e-6, rtol=0)


def test_entropy_hand_computed_with_temperature() -> None:
    out = entropy_from_logits(LOGITS, temperature=2.0)
    # t0: p = [1.648721, 2.718282, 4.481689] / 8.848692 = [0.186324, 0.307196, 0.506480]
    #     H = logsumexp - sum(p * z) = 2.180270 - (0.5 * 0.186324 + 1.0 * 0.307196 + 1.5 * 0.506480) = 1.020191
    # t1: uniform over 3 -> log 3 = 1.098612
    torch.testing.assert_close(out, torch.tensor([[1.020191, 1.098612]]), atol=1e-6, rtol=0)


def test_logprobs_and_entropy_match_manual_log_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    for temperature in (0.7, 1.0, 1.3):
        log_p = torch.log_softmax(logits / temperature, dim=-1)
        manual = log_p.gather(-1, labels[..., None])[..., 0]
        torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature), manual)
        manual_entropy = -(log_p.exp() * log_p).sum(-1)
        torch.testing.assert_close(entropy_from_logits(logits, temperature), manual_entropy)


def test_half_precision_logits_are_computed_in_float32() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 7, generator=gen) * 5).to(torch.bfloat16)
    labels = torch.randint(0, 7, (2, 4), generator=gen)
    out = logprobs_from_logits(logits, labels, temperature=0.7)
    assert out.dtype == torch.float32
    manual = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out, manual)
    ent = entropy_from_logits(logits, temperature=0.7)
    assert ent.dtype == torch.float32
    log_p = torch.log_softmax(logits.float() / 0.7, dim=-1)
    torch.testing.assert_close(ent, -(log_p.exp() * log_p).sum(-1))


def test_logprobs_gradient_and_bad_temperature() -> None:
    logits = LOGITS.clone().requires_grad_(True)
    logprobs_from_logits(logits, LABELS).sum().backward()
    # d log p_y / d z = onehot(y) - softmax(z); at t1 softmax is uniform: [1 - 1/3, -1/3, -1/3]
    torch.testing.assert_close(logits.grad[0, 1], torch.tensor([2 / 3, -1 / 3, -1 / 3]))
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    with pytest.raises(ValueError, match="Temperature"):
        logprobs_from_logits(LOGITS, LABELS, temperature=0.0)
