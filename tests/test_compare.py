"""Comparing runs: a small MLflow store written through rlhf.tracking.client, read back by rlhf.sweeps.compare."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf.sweeps import compare
from rlhf.tracking.client import RUN_TYPE_TAG, Tracker

PNG = b"\x89PNG\r\n\x1a\n"


def _pipeline_run(tracker: Tracker, name: str, kl_coef: float, gold: float, kl: float, ppo_ran: bool = True) -> str:
    """A parent run shaped like the flow's: config params, summary metrics, stage child runs."""
    run_id = tracker.start_run(name, tags={"code_version": "abc"})
    tracker.log_params(
        run_id,
        {"ppo.kl_coef": kl_coef, "ppo.lr": 1e-4, "runtime.output_dir": f"/tmp/{name}", "tracking.uri": "x"},
    )
    tracker.log_metrics(
        run_id,
        {
            "reward/best_eval_accuracy": 0.9,
            "eval/policy_gold": gold,
            "eval/sft_gold": 0.1,
            "eval/kl": kl,
            "eval/policy_score": 1.0,
        },
        0,
    )
    child = tracker.start_run("prepare_preferences", run_id, tags={"stage": "prepare_preferences"})
    tracker.end_run(child)
    if ppo_ran:
        ppo = tracker.start_run("train_policy_ppo", run_id, tags={"stage": "train_policy_ppo"})
        for step in (1, 2, 3):
            tracker.log_metrics(ppo, {"objective/scores": gold * step, "objective/kl": kl * step / 3}, step)
        tracker.end_run(ppo)
    tracker.end_run(run_id)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "exp", str(tmp_path / "art"))
    ids = {
        "low-kl": _pipeline_run(tracker, "low-kl", 0.2, 0.3, 1.0),
        "high-kl": _pipeline_run(tracker, "high-kl", 0.01, 0.6, 4.0),
        "cached": _pipeline_run(tracker, "cached", 0.01, 0.6, 4.0, ppo_ran=False),
    }
    sweep = tracker.start_run("sweep-kl", tags={RUN_TYPE_TAG: "sweep", "sweep.name": "kl"})
    tracker.attach_to_sweep(ids["low-kl"], sweep, "kl", "ppo.kl_coef=0.2")
    tracker.attach_to_sweep(ids["high-kl"], sweep, "kl", "ppo.kl_coef=0.01")
    return uri, tracker, ids, sweep


def test_tracker_queries(store):
    uri, tracker, ids, sweep = store
    runs = tracker.pipeline_runs()
    # newest first; neither the stage child runs nor the sweep run count as pipeline runs
    assert [r.name for r in runs] == ["cached", "high-kl", "low-kl"]
    assert runs[1].parent_run_id == sweep and runs[1].tags["sweep_run_id"] == sweep
    assert [r.tags["stage"] for r in tracker.child_runs(ids["low-kl"])] == ["train_policy_ppo", "prepare_preferences"]
    (ppo,) = tracker.child_runs(ids["low-kl"], "train_policy_ppo")
    history = tracker.metric_history(ppo.run_id, "objective/scores")
    assert [step for step, _ in history] == [1, 2, 3]
    assert [value for _, value in history] == pytest.approx([0.3, 0.6, 0.9])


def test_compare_table_and_plots(store, tmp_path):
    uri, tracker, ids, sweep = store
    runs = compare.select_runs(tracker, last=None)
    result = compare.compare(tracker, runs, tmp_path / "out")
    # output folder, run name and tracking URI differ too, but do not change what was trained
    assert result.differing == ["ppo.kl_coef"]
    assert list(result.table.columns) == ["cached", "high-kl", "low-kl"]
    assert result.table.loc["param ppo.kl_coef", "low-kl"] == 0.2
    assert result.table.loc["eval/policy_gold", "high-kl"] == 0.6
    for name in ("reward_vs_kl.png", "training_curves.png"):
        assert (tmp_path / "out" / name).read_bytes()[:8] == PNG
    saved = pd.read_csv(tmp_path / "out" / "compare.csv", index_col=0)  # one row per run
    assert saved.loc["low-kl", "eval/kl"] == 1.0 and saved.loc["high-kl", "param ppo.kl_coef"] == 0.01

    assert [r.name for r in compare.select_runs(tracker, last=None, sweep="kl")] == ["high-kl", "low-kl"]
    assert [r.name for r in compare.select_runs(tracker, last=None, sweep=sweep)] == ["high-kl", "low-kl"]
    assert [r.name for r in compare.select_runs(tracker, last=1)] == ["cached"]
    assert [r.name for r in compare.select_runs(tracker, None, [ids["low-kl"][:8]])] == ["low-kl"]


def test_cli(store, tmp_path, capsys):
    uri, *_ = store
    out = tmp_path / "cli"
    assert compare.main(["--experiment", "exp", "--tracking-uri", uri, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 pipeline runs; parameters that differ: ppo.kl_coef" in text
    assert "eval/policy_gold" in text and "low-kl" in text
    assert (out / "training_curves.png").is_file()

    assert compare.main(["--experiment", "nope", "--tracking-uri", uri, "--out", str(out)]) == 2
    assert "experiment 'nope' is not in" in capsys.readouterr().err
    missing = f"sqlite:///{tmp_path}/missing.db"
    assert compare.main(["--tracking-uri", missing, "--out", str(out)]) == 2
    assert "no MLflow store" in capsys.readouterr().err
    assert not (tmp_path / "missing.db").exists()
