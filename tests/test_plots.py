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


def test_sweep_points_are_named_by_arm_and_swept_values_and_their_labels_kept_apart():
    from rlhf.sweeps.plots import Point, _label_lifts
    from rlhf.sweeps.ranking import RANK_METRICS, variant_label

    row = {"rank": 1, "variant": "algorithms-04", "arm": "GRPO", "policy_seed": 1, RANK_METRICS[0]: 0.9}
    assert variant_label(row) == "GRPO, policy_seed=1"
    assert variant_label({"rank": 1, "variant": "kl-02", "ppo.kl_coef": 0.1, RANK_METRICS[0]: 0.5}) == "kl_coef=0.1"
    assert variant_label({"rank": 1, "variant": "v-1", RANK_METRICS[0]: 0.5}) == "v-1"
    # three points on top of each other are lifted one above the other; a far one is not
    points = [Point("a", 4.0, 0.9), Point("b", 4.01, 0.9), Point("c", 4.0, 0.901), Point("d", 30.0, 0.1)]
    assert _label_lifts(points) == [0.0, 9.0, 18.0, 0.0]
