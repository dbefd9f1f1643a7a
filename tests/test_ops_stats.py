from __future__ import annotations

import math

import pytest
import torch

from rlhf.ops.stats import (
    explained_variance,
    masked_mean,
    masked_quantiles,
    masked_sum,
    masked_var,
    masked_whiten,
)

GARBAGE = 1e6

# real entries 1, 2 (row 0) and 4 (row 1); the rest is padding
X = torch.tensor([[1.0, 2.0, GARBAGE], [4.0, GARBAGE, -GARBAGE]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_masked_sum() -> None:
    assert masked_sum(X, MASK).item() == pytest.approx(7.0)  # 1 + 2 + 4
    torch.testing.assert_close(masked_sum(X, MASK, dim=1), torch.tensor([3.0, 4.0]))  # 1 + 2; 4
    torch.testing.assert_close(masked_sum(X, MASK, dim=0), torch.tensor([5.0, 2.0, 0.0]))  # 1 + 4; 2; nothing


def test_masked_mean() -> None:
    assert masked_mean(X, MASK).item() == pytest.approx(7.0 / 3.0)  # (1 + 2 + 4) / 3 = 2.33333
    torch.testing.assert_close(masked_mean(X, MASK, dim=1), torch.tensor([1.5, 4.0]))  # 3 / 2; 4 / 1
    # column 2 has no real entry -> 0, not NaN
    torch.testing.assert_close(masked_mean(X, MASK, dim=0), torch.tensor([2.5, 2.0, 0.0]))  # 5 / 2; 2 / 1; 0


def test_masked_mean_bool_mask_and_empty_mask() -> None:
    assert masked_mean(X, MASK.bool()).item() == pytest.approx(7.0 / 3.0)
    empty = torch.zeros_like(MASK)
    assert masked_mean(X, empty).item() == 0.0
    x = X.clone().requires_grad_(True)
    masked_mean(x, empty).backward()
    assert torch.isfinite(x.grad).all()


def test_masked_mean_ignores_inf_and_nan_padding() -> None:
    x = torch.tensor([[1.0, 2.0, float("inf")], [4.0, float("nan"), -float("inf")]], requires_grad=True)
    assert masked_mean(x, MASK).item() == pytest.approx(7.0 / 3.0)
    masked_mean(x, MASK).backward()
    # d/dx of the mean is 1/3 at each of the three real entries, 0 at padding
    torch.testing.assert_close(x.grad, torch.tensor([[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]]))


def test_masked_var() -> None:
    # real entries 1, 2, 4: mean 7/3; deviations -4/3, -1/3, 5/3; squares 16/9 + 1/9 + 25/9 = 42/9
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(42 / 9 / 3)  # 14/9 = 1.55556
    assert masked_var(X, MASK, unbiased=True).item() == pytest.approx(42 / 9 / 2)  # 14/6 = 2.33333
    # one real entry: no Bessel correction, variance 0
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_var(X, one, unbiased=True).item() == 0.0


# real entries 1, 3, 5, 7: mean 4; deviations -3, -1, 1, 3; squares sum 20; unbiased var 20/3; std 2.581989
X_W = torch.tensor([[1.0, 3.0, GARBAGE], [5.0, 7.0, -GARBAGE]])
MASK_W = torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_masked_whiten_shifts_and_scales() -> None:
    out = masked_whiten(X_W, MASK_W)
    expected = torch.tensor(
        [
            [-1.161895, -0.387298, 0.0],  # -3 / 2.581989; -1 / 2.581989; padding -> 0
            [0.387298, 1.161895, 0.0],  # 1 / 2.581989; 3 / 2.581989
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert masked_mean(out, MASK_W).item() == pytest.approx(0.0, abs=1e-6)
    assert masked_var(out, MASK_W).item() == pytest.approx(1.0, abs=1e-5)


def test_masked_whiten_restore_mean_only_scales() -> None:
    out = masked_whiten(X_W, MASK_W, restore_mean=True)
    expected = torch.tensor(
        [
            [2.838105, 3.612702, 0.0],  # 4 - 1.161895; 4 - 0.387298; padding -> 0
            [4.387298, 5.161895, 0.0],  # 4 + 0.387298; 4 + 1.161895
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    assert masked_mean(out, MASK_W).item() == pytest.approx(4.0, abs=1e-5)  # the mean is kept
    assert masked_var(out, MASK_W).item() == pytest.approx(1.0, abs=1e-5)


def test_masked_whiten_with_given_moments() -> None:
    # mean 2, variance 4 (std 2) given: (1 - 2) / 2 = -0.5, (3 - 2) / 2 = 0.5, (5 - 2) / 2 = 1.5, (7 - 2) / 2 = 2.5
    moments = (torch.tensor(2.0), torch.tensor(4.0))
    out = masked_whiten(X_W, MASK_W, moments=moments, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-0.5, 0.5, 0.0], [1.5, 2.5, 0.0]]))
    kept = masked_whiten(X_W, MASK_W, moments=moments, eps=0.0, restore_mean=True)  # + 2 on the real entries
    torch.testing.assert_close(kept, torch.tensor([[1.5, 2.5, 0.0], [3.5, 4.5, 0.0]]))
    own = (masked_mean(X_W, MASK_W), masked_var(X_W, MASK_W))  # its own moments: the default
    torch.testing.assert_close(masked_whiten(X_W, MASK_W, moments=own), masked_whiten(X_W, MASK_W))


def test_masked_whiten_padding_invariance() -> None:
    other = X_W.clone()
    other[~MASK_W.bool()] = torch.tensor([-3.0, 123.0])
    for restore in (False, True):
        torch.testing.assert_close(
            masked_whiten(X_W, MASK_W, restore_mean=restore), masked_whiten(other, MASK_W, restore_mean=restore)
        )


def test_masked_quantiles() -> None:
    x = torch.tensor([[5.0, 1.0, 3.0, GARBAGE], [2.0, 4.0, -GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # sorted real entries 1, 2, 3, 4, 5; position q * (5 - 1), linear interpolation between neighbours
    # q=0.05 -> pos 0.2 -> 1 + 0.2 * (2 - 1) = 1.2; q=0.5 -> pos 2 -> 3; q=0.95 -> pos 3.8 -> 4 + 0.8 = 4.8
    got = masked_quantiles(x, mask)
    assert got == pytest.approx([1.2, 3.0, 4.8])
    assert isinstance(got[0], float)
    assert masked_quantiles(x, mask, qs=(0.0, 1.0)) == pytest.approx([1.0, 5.0])
    assert masked_quantiles(x, torch.zeros_like(mask)) == [0.0, 0.0, 0.0]


def test_explained_variance() -> None:
    returns = torch.tensor([[1.0, 2.0, GARBAGE], [3.0, 4.0, GARBAGE]])
    values = torch.tensor([[1.0, 2.0, -GARBAGE], [3.0, 5.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # var(returns): mean 2.5, squares 2.25 + 0.25 + 0.25 + 2.25 = 5 -> 5 / 4 = 1.25
    # returns - values = 0, 0, 0, -1: mean -0.25; 3 * 0.0625 + 0.5625 = 0.75 -> 0.75 / 4 = 0.1875
    # 1 - 0.1875 / 1.25 = 1 - 0.15 = 0.85
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.85)
    # a perfect critic explains everything
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)


def test_explained_variance_constant_returns_is_zero() -> None:
    returns = torch.full((2, 3), 2.0)
    values = torch.randn(2, 3)
    ev = explained_variance(values, returns, torch.ones(2, 3))
    assert ev.item() == 0.0 and not math.isnan(ev.item())


def test_optimisation_statistics_are_the_running_means_of_their_values() -> None:
    """`OptimStats` takes tensors and floats; the tensors of a micro-batch reach the host in one copy, unrounded."""
    from rlhf.ppo.stats import OptimStats

    stats = OptimStats()
    # float64 1/3 would round in float32; a float64 tensor keeps every bit
    stats.add({"a": torch.tensor(1 / 3, dtype=torch.float64), "b": torch.tensor(2.0, requires_grad=True), "c": 4})
    stats.add({"a": torch.tensor(0.0, dtype=torch.float64), "b": 1.0})
    # a: (1/3 + 0) / 2 = 1/6; b: (2 + 1) / 2 = 1.5; c: 4 / 1
    assert stats.means() == {"a": (1 / 3) / 2, "b": 1.5, "c": 4.0}


def test_groups_without_spread_are_counted_by_each_category_of_their_row():
    from rlhf.ppo.stats import zero_std_by_category, zero_std_counts

    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0])  # groups of 2: equal, spread, equal, equal
    categories = [["a", "b"]] * 2 + [["a"]] * 2 + [["b:c"]] * 2 + [["a"]] * 2
    counts = zero_std_counts(scores, 2, categories)
    assert counts == {"a": (2, 3), "b": (1, 1), "b:c": (1, 1)}
    merged = zero_std_by_category([counts, {"a": (0, 1)}])  # a second process's counts
    assert merged == {
        "group/zero_std_fraction/a": 0.5,
        "group/zero_std_fraction/b": 1.0,
        "group/zero_std_fraction/b.c": 1.0,  # ':' is not in every store's metric names
    }
