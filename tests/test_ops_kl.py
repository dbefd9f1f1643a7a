from __future__ import annotations

import pytest
import torch

from rlhf.ops.kl import AdaptiveKLController, FixedKLController, kl_per_token, make_kl_controller

LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0, -0.5]])
# d = logprobs - ref_logprobs = [0.5, -1.0, 0.0]


def test_kl_k1() -> None:
    torch.testing.assert_close(kl_per_token(LOGPROBS, REF_LOGPROBS), torch.tensor([[0.5, -1.0, 0.0]]))  # d


def test_kl_k2() -> None:
    expected = torch.tensor([[0.125, 0.5, 0.0]])  # 0.5^2 / 2 = 0.125; (-1)^2 / 2 = 0.5; 0
    torch.testing.assert_close(kl_per_token(LOGPROBS, REF_LOGPROBS, "k2"), expected)


def test_kl_k3() -> None:
    expected = torch.tensor(
        [[0.106531, 0.718282, 0.0]]  # exp(-0.5) - 1 + 0.5 = 0.606531 - 0.5; exp(1) - 1 - 1 = 0.718282; 1 - 1 + 0
    )
    torch.testing.assert_close(kl_per_token(LOGPROBS, REF_LOGPROBS, "k3"), expected, atol=1e-6, rtol=0)


def test_kl_unknown_estimator() -> None:
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_per_token(LOGPROBS, REF_LOGPROBS, "k4")


def test_fixed_controller_never_changes() -> None:
    ctl = FixedKLController(value=0.05)
    ctl.update(current_kl=100.0, n_steps=64)
    assert ctl.value == 0.05
    other = FixedKLController(value=1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_increases_clipped() -> None:
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=8.0, n_steps=64)
    # e = clip(8/6 - 1 = 0.3333, -0.2, 0.2) = 0.2; value = 0.1 * (1 + 0.2 * 64 / 10000) = 0.1 * 1.00128
    assert ctl.value == pytest.approx(0.100128)


def test_adaptive_controller_decreases_unclipped() -> None:
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=5.0, n_steps=64)
    # e = 5/6 - 1 = -0.166667 (inside the clip); value = 0.1 * (1 - 0.166667 * 64 / 10000) = 0.1 * 0.998933
    assert ctl.value == pytest.approx(0.0998933, rel=1e-6)


def test_adaptive_controller_lower_clip_and_state() -> None:
    ctl = AdaptiveKLController(value=0.2, target=6.0, horizon=100)
    ctl.update(current_kl=0.0, n_steps=10)
    # e = clip(0/6 - 1 = -1, -0.2, 0.2) = -0.2; value = 0.2 * (1 - 0.2 * 10 / 100) = 0.2 * 0.98 = 0.196
    assert ctl.value == pytest.approx(0.196)
    restored = AdaptiveKLController(value=1.0, target=1.0, horizon=1)
    restored.load_state_dict(ctl.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (pytest.approx(0.196), 6.0, 100)


def test_make_kl_controller() -> None:
    fixed = make_kl_controller("fixed", 0.05)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = make_kl_controller("adaptive", 0.2, target=6.0, horizon=10000)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 6.0, 10000)
    with pytest.raises(ValueError, match="target"):
        make_kl_controller("adaptive", 0.2, target=6.0)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.2, horizon=100)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        make_kl_controller("linear", 0.2)
