from __future__ import annotations

import torch

from rlhf.ops.advantages import gae

GARBAGE = 1e6


def test_gae_hand_computed() -> None:
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, GARBAGE]])
    values = torch.tensor([[0.5, 1.0, 1.5], [1.0, 2.0, -GARBAGE]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = gae(rewards, values, mask, gamma=0.9, lam=0.5)  # gamma * lam = 0.45
    expected_advantages = torch.tensor(
        [
            # t=2: delta = 2 - 1.5 = 0.5 (no next value);                A2 = 0.5
            # t=1: delta = 0 + 0.9 * 1.5 - 1.0 = 0.35;                   A1 = 0.35 + 0.45 * 0.5 = 0.575
            # t=0: delta = 1 + 0.9 * 1.0 - 0.5 = 1.4;                    A0 = 1.4 + 0.45 * 0.575 = 1.65875
            [1.65875, 0.575, 0.5],
            # t=1 is the last real token: delta = 1.0 - 2.0 = -1.0;       A1 = -1.0
            # t=0: delta = 0.5 + 0.9 * 2.0 - 1.0 = 1.3;                  A0 = 1.3 + 0.45 * -1.0 = 0.85
            [0.85, -1.0, 0.0],
        ]
    )
    expected_returns = torch.tensor(
        [
            [2.15875, 1.575, 2.0],  # A + V: 1.65875 + 0.5; 0.575 + 1.0; 0.5 + 1.5
            [1.85, 1.0, 0.0],  # 0.85 + 1.0; -1.0 + 2.0; padding -> 0
        ]
    )
    torch.testing.assert_close(out.advantages, expected_advantages)
    torch.testing.assert_close(out.returns, expected_returns)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value() -> None:
    # with gamma = lam = 1, A_t = sum_{k>=t} r_k - V_t: rewards [1, 2, 3] -> reward-to-go [6, 5, 3]
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 0.25, 1.0]])
    out = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(out.advantages, torch.tensor([[5.5, 4.75, 2.0]]))  # 6 - 0.5; 5 - 0.25; 3 - 1
    torch.testing.assert_close(out.returns, torch.tensor([[6.0, 5.0, 3.0]]))


def _reference_gae(
    rewards: torch.Tensor, values: torch.Tensor, lengths: list[int], gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample, per-step loop over the real tokens only."""
    advantages = torch.zeros_like(values)
    returns = torch.zeros_like(values)
    for i, length in enumerate(lengths):
        next_advantage = 0.0
        for t in reversed(range(length)):
            next_value = values[i, t + 1].item() if t + 1 < length else 0.0
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            next_advantage = delta + gamma * lam * next_advantage
            advantages[i, t] = next_advantage
            returns[i, t] = next_advantage + values[i, t].item()
    return advantages, returns


def test_gae_matches_reference_loop_with_random_lengths() -> None:
    gen = torch.Generator().manual_seed(0)
    b, t = 6, 9
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=gen).tolist()
    lengths[0], lengths[1] = 1, t  # make sure the edge cases are there
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.5, 0.0)):
        out = gae(rewards, values, mask, gamma=gamma, lam=lam)
        ref_adv, ref_ret = _reference_gae(rewards, values, lengths, gamma, lam)
        torch.testing.assert_close(out.advantages, ref_adv)
        torch.testing.assert_close(out.returns, ref_ret)


def test_gae_padding_garbage_changes_nothing() -> None:
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 5, generator=gen)
    values = torch.randn(4, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    clean = gae(rewards * mask, values * mask, mask, gamma=0.99, lam=0.95)
    pad = ~mask.bool()
    dirty_rewards, dirty_values = rewards.clone(), values.clone()
    dirty_rewards[pad], dirty_values[pad] = GARBAGE, float("nan")
    dirty = gae(dirty_rewards, dirty_values, mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(dirty.advantages, clean.advantages)
    torch.testing.assert_close(dirty.returns, clean.returns)
    assert (dirty.advantages[pad] == 0).all() and (dirty.returns[pad] == 0).all()
