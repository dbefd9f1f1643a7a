"""The PNG plots: every finite point is inside the axes, negative KL estimates included."""

from __future__ import annotations

from rlhf.sweeps import plots


def test_reward_vs_kl_shows_points_with_a_negative_kl(tmp_path, monkeypatch):
    limits = {}
    original = plots.save_figure

    def keep_limits(fig, path):
        (ax,) = fig.axes
        limits["x"] = ax.get_xlim()
        return original(fig, path)

    monkeypatch.setattr(plots, "save_figure", keep_limits)
    points = [plots.Point("a", -0.02, 0.3), plots.Point("b", 0.5, 0.6), plots.Point("c", float("nan"), 0.1)]
    path = plots.reward_vs_kl(points, tmp_path / "reward_vs_kl.png", baseline=0.1)
    assert path.stat().st_size > 0
    left, right = limits["x"]
    assert left < -0.02 and right > 0.5  # both finite points, and KL 0, are in view
