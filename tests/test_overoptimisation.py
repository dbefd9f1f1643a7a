"""The over-optimisation figure and its numbers: hand-made histories, and a sweep in a real SQLite MLflow store
read back through rlhf.tracking.client (a variant whose PPO came from the cache included)."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from rlhf.sweeps import overoptimisation as oo
from rlhf.tracking.client import RUN_TYPE_TAG, Tracker

PNG = b"\x89PNG\r\n\x1a\n"


def _history(steps, scores, golds, kls) -> pd.DataFrame:
    return pd.DataFrame({"step": steps, oo.SCORE: scores, oo.GOLD: golds, oo.KL: kls})


HISTORIES = {
    # a long run with little KL penalty: the proxy keeps rising, gold peaks at KL 4 and falls
    "kl_coef=0.001": _history([0, 10, 20, 30], [0.0, 1.0, 2.0, 3.0], [0.1, 0.5, 0.7, 0.2], [0.0, 1.0, 4.0, 16.0]),
    # a short run with a strong KL penalty: stays close to SFT
    "kl_coef=0.2": _history([0, 10], [0.0, 0.6], [0.1, 0.4], [0.0, 0.5]),
}


def test_summary_figures():
    s = oo.summarize(HISTORIES)
    assert (s.n_variants, s.n_points, s.n_nonfinite) == (2, 6, 0)
    assert (s.peak_gold, s.kl_at_peak_gold, s.step_at_peak_gold, s.variant_at_peak_gold) == (
        0.7,
        4.0,
        20,
        "kl_coef=0.001",
    )
    assert (s.largest_kl, s.proxy_at_largest_kl, s.gold_at_largest_kl) == (16.0, 3.0, 0.2)
    assert (s.sft_gold, s.sft_proxy) == (0.1, 0.0)
    assert s.as_metrics()["overoptimisation/peak_gold"] == 0.7
    assert "variant_at_peak_gold" not in str(s.as_metrics())


def test_a_nan_evaluation_is_counted_not_hidden(tmp_path):
    with_nan = {**HISTORIES, "diverged": _history([0, 10], [0.0, float("nan")], [0.1, -0.5], [0.0, 30.0])}
    s = oo.summarize(with_nan)
    assert s.n_nonfinite == 1 and s.n_points == 7
    assert s.largest_kl == 16.0  # the NaN point is not the largest KL
    assert "1 NaN/inf left out" in oo.format_summary(s)
    with pytest.raises(ValueError, match="no evaluation has finite"):
        oo.summarize({"diverged": _history([5], [float("nan")], [0.0], [1.0])})


def test_plot_writes_a_png(tmp_path):
    path = oo.overoptimisation_plot(HISTORIES, tmp_path / "fig" / "overoptimisation.png")
    assert path.read_bytes().startswith(PNG)
    with pytest.raises(ValueError, match="no histories"):
        oo.overoptimisation_plot({}, tmp_path / "empty.png")


def _variant(tracker: Tracker, sweep: str, label: str, history: pd.DataFrame | None, served_from: str = "") -> str:
    """A pipeline run attached to the sweep, with a PPO child run holding `history` (none: PPO came from the cache
    and the run names the run that computed it)."""
    tags = {"rlhf.results_from_run": served_from} if served_from else {}
    run_id = tracker.start_run(f"pipeline-{label}", tags=tags)
    data = tracker.start_run("prepare_preferences", run_id, tags={"stage": "prepare_preferences"})
    tracker.end_run(data)
    if history is not None:
        ppo = tracker.start_run(f"pipeline-{label}/ppo", run_id, tags={"stage": "train_policy_ppo"})
        for row in history.itertuples(index=False):
            tracker.log_metrics(ppo, {oo.SCORE: row[1], oo.GOLD: row[2], oo.KL: row[3]}, int(row[0]))
            tracker.log_metrics(ppo, {"objective/kl": 1.0}, int(row[0]) + 1)  # training metrics: not evaluations
        tracker.end_run(ppo)
    tracker.end_run(run_id)
    if sweep:
        tracker.attach_to_sweep(run_id, sweep, "overoptimisation", label)
    return run_id


def test_collect_histories_and_report_from_a_sweep_run(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "exp", str(tmp_path / "art"))
    sweep = tracker.start_run("sweep-overoptimisation", tags={RUN_TYPE_TAG: "sweep", "sweep.name": "overoptimisation"})
    low = _variant(tracker, sweep, "kl_coef=0.001", HISTORIES["kl_coef=0.001"])
    _variant(tracker, sweep, "kl_coef=0.2", None, served_from=_variant(tracker, "", "x", HISTORIES["kl_coef=0.2"]))
    _variant(tracker, "", "not-in-the-sweep", HISTORIES["kl_coef=0.2"])
    tracker.end_run(sweep)

    histories = oo.collect_histories(tracker, sweep)
    assert sorted(histories) == ["kl_coef=0.001", "kl_coef=0.2"]
    got = histories["kl_coef=0.001"].dropna(subset=[oo.KL]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got[["step", *oo.HISTORY_KEYS]], HISTORIES["kl_coef=0.001"], check_dtype=False)
    assert oo.summarize(histories) == oo.summarize(HISTORIES)
    assert oo.sweep_run(tracker, "overoptimisation").run_id == sweep
    assert oo.sweep_run(tracker, sweep[:8]).run_id == sweep
    assert low not in {oo.sweep_run(tracker, sweep).run_id}

    assert (
        oo.main(
            ["--sweep", "overoptimisation", "--tracking-uri", uri, "--experiment", "exp", "--out", str(tmp_path / "o")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "peak gold reward:        0.700 at KL 4.00 (kl_coef=0.001, update 20)" in out
    assert "proxy / gold there:    3.000 / 0.200" in out
    assert (tmp_path / "o" / "overoptimisation.png").read_bytes().startswith(PNG)
    points = pd.read_csv(tmp_path / "o" / "overoptimisation_points.csv")
    assert len(points) == 6 and math.isclose(points["sqrt_kl"].max(), 4.0)
    assert oo.main(["--sweep", "nope", "--tracking-uri", uri, "--experiment", "exp"]) == 2
    no_evals = tracker.start_run("sweep-plain", tags={RUN_TYPE_TAG: "sweep", "sweep.name": "plain"})
    _variant(tracker, no_evals, "kl_coef=0.1", None)
    assert oo.report(tracker, no_evals, tmp_path / "none") is None
    assert oo.main(["--sweep", "plain", "--tracking-uri", uri, "--experiment", "exp"]) == 2
    assert "has periodic evaluations" in capsys.readouterr().err


# -- The exploitable setting of the synthetic task (data.synthetic.length_bias, max_clauses) ----------------------


def test_length_bias_labels_by_gold_plus_clauses_and_the_held_out_pairs_stay_gold():
    from rlhf.data import synthetic

    biased = synthetic.preference_pairs(400, 0, 0.0, "train", length_bias=0.3, max_clauses=5)
    for pair in biased:
        assert synthetic.labeller_preference(pair.prompt, pair.chosen, 0.3) > synthetic.labeller_preference(
            pair.prompt, pair.rejected, 0.3
        )
    against_gold = [p for p in biased if p.gold_chosen < p.gold_rejected]
    assert 0.05 < len(against_gold) / len(biased) < 0.4  # the bias decides some pairs, not most
    assert all(synthetic.clause_count(p.chosen) > synthetic.clause_count(p.rejected) for p in against_gold)
    unbiased = synthetic.preference_pairs(400, 0, 0.0, "eval", max_clauses=5)
    assert all(p.gold_chosen > p.gold_rejected for p in unbiased)


def test_max_clauses_widens_the_reviews_and_defaults_keep_the_task():
    from rlhf.config import DataConfig
    from rlhf.data import synthetic

    counts = {synthetic.clause_count(d.response) for d in synthetic.demonstrations(300, 0, max_clauses=5)}
    assert counts == {2, 3, 4, 5}
    assert {synthetic.clause_count(d.response) for d in synthetic.demonstrations(300, 0)} == {2, 3}
    task = DataConfig().synthetic
    assert (task.length_bias, task.max_clauses) == (0.0, 3)
    with pytest.raises(ValueError, match="max_clauses"):
        DataConfig(synthetic={"max_clauses": 1})


def test_sft_max_clauses_keeps_the_demonstrations_shorter_than_the_pairs(tmp_path):
    """The over-optimisation setting: 5-clause reviews in the labelled pairs (which the labellers favour) but at most
    4 clauses in the SFT demonstrations, so the SFT policy rarely writes what the reward model over-rates."""
    from rlhf.config import DataConfig
    from rlhf.data import synthetic
    from rlhf.data.prepare import prepare_preferences

    task = {"n_sft": 300, "n_train_pairs": 200, "n_eval_pairs": 20, "max_clauses": 5, "sft_max_clauses": 4}
    out = prepare_preferences(DataConfig(synthetic=task), tmp_path / "data")
    sft_counts = {synthetic.clause_count(r) for r in pd.read_parquet(out.sft)["response"]}
    pair_counts = {synthetic.clause_count(r) for r in pd.read_parquet(out.train)["chosen"]}
    assert sft_counts == {2, 3, 4} and 5 in pair_counts
    plain = prepare_preferences(DataConfig(synthetic={**task, "sft_max_clauses": None}), tmp_path / "plain")
    assert {synthetic.clause_count(r) for r in pd.read_parquet(plain.sft)["response"]} == {2, 3, 4, 5}
    assert plain.digest != out.digest  # the knob is part of the data's cache key
