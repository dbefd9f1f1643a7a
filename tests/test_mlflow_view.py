"""The experiment's default view in the MLflow UI (rlhf/tracking/default_view.py): a saved view written as the
experiment tag MLflow 3's UI reads, and the links that open it."""

from __future__ import annotations

import base64
import json
import urllib.parse
import zlib

from rlhf.tracking.client import Tracker
from rlhf.tracking.default_view import (
    VIEW_NAME,
    VIEW_TAG,
    copy_ppo_curves,
    default_view_json,
    mlflow_compare_url,
    mlflow_experiment_url,
)


def _state(tag_value: str) -> dict:
    """Decode a saved view as MLflow's UI does: a name and a 'deflate;<base64 zlib>' JSON state."""
    view = json.loads(tag_value)
    kind, packed = view["state"].split(";", 1)
    assert kind == "deflate" and view["name"] == VIEW_NAME
    return json.loads(zlib.decompress(base64.b64decode(packed)))


def test_the_saved_view_has_the_columns_and_the_ppo_charts_first():
    state = _state(default_view_json())
    assert "metrics.`eval/win_rate_gold`" in state["selectedColumns"]
    assert {"metrics.`eval/kl`", "metrics.`reward/best_eval_accuracy`", "params.`ppo.kl_coef`"} <= set(
        state["selectedColumns"]
    )
    # the objective that trained the policy ('GRPO'), not the param `algorithm` ('ppo' for every online objective)
    assert state["selectedColumns"][0] == "tags.`rlhf.objective_label`"
    assert "params.`algorithm`" not in state["selectedColumns"]
    sections = [s["name"] for s in state["compareRunSections"]]
    assert sections[:2] == ["objective", "periodic_eval"] and state["isAccordionReordered"]
    assert state["compareRunCharts"] == []  # the UI adds a chart per metric to its section, in this order


def test_the_tracker_writes_the_view_on_new_and_existing_experiments(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "views", str(tmp_path / "art"))
    tags = tracker.client.get_experiment(tracker.experiment_id).tags
    assert tags[VIEW_TAG] == default_view_json()
    assert tags["mlflow.experimentKind"] == "custom_model_development"  # model training, not GenAI
    tracker.client.set_experiment_tag(tracker.experiment_id, VIEW_TAG, "{}")  # e.g. written by an older version
    again = Tracker(uri, "views")
    assert again.client.get_experiment(again.experiment_id).tags[VIEW_TAG] == default_view_json()
    url = mlflow_experiment_url(tracker.experiment_id, "http://127.0.0.1:5000")
    assert url == (
        f"http://127.0.0.1:5000/#/experiments/{tracker.experiment_id}/runs"
        "?viewStateShareKey=rlhf-default&workflowType=machine_learning"
    )


def test_the_ppo_curves_are_copied_onto_the_pipeline_run(tmp_path):
    """The experiment page charts its rows, the pipeline runs: they get the PPO run's objective/ and periodic_eval/
    curves (every step), not its other metrics; copying twice (a retried task) changes nothing."""
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "curves", str(tmp_path / "art"))
    parent = tracker.start_run("pipeline")
    ppo = tracker.start_run("pipeline/ppo", parent_run_id=parent)
    for step in (1, 2, 3):
        tracker.log_metrics(ppo, {"objective/kl": 0.1 * step, "periodic_eval/score": step, "value/loss": 1.0}, step)
    copy_ppo_curves(tracker, ppo, parent)
    copy_ppo_curves(tracker, ppo, parent)
    copy_ppo_curves(tracker, None, parent)  # a sweep's or a failed run's summary has no PPO run
    assert tracker.metric_history(parent, "objective/kl") == [(1, 0.1), (2, 0.2), (3, 0.30000000000000004)]
    assert [s for s, _ in tracker.metric_history(parent, "periodic_eval/score")] == [1, 2, 3]
    assert "value/loss" not in tracker.get_run(parent).data.metrics


def test_a_runs_source_is_the_projects_entry_point(tmp_path, monkeypatch):
    """MLflow's Source of a run (and a logged model's "Logged from"): the one its starter gives, else its parent's,
    else what started the process as the project names it; never Prefect's engine.py."""
    import sys

    from rlhf.tracking import client
    from rlhf.tracking.client import SOURCE_NAME_TAG, SOURCE_TYPE_TAG, default_source, source_tags

    repo = client._CHECKOUT
    for argv, source in (
        ([str(repo / "flows" / "pipeline.py"), "--config", "conf/smoke.yaml"], "flows/pipeline.py"),
        ([str(repo / ".venv" / "bin" / "rlhf"), "--quiet", "run", "--config", "x"], "rlhf run"),
        ([f"{sys.prefix}/lib/python3/site-packages/prefect/engine.py"], "rlhf"),
        ([""], "rlhf"),
    ):
        monkeypatch.setattr(sys, "argv", argv)
        assert default_source() == source, argv

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "e", str(tmp_path / "artifacts"))
    parent = tracker.start_run("pipeline", tags=source_tags("flows/sweep.py"))
    child = tracker.start_run("pipeline/ppo", parent)
    alone = tracker.start_run("alone")
    assert tracker.get_run(child).data.tags[SOURCE_NAME_TAG] == "flows/sweep.py"
    assert tracker.get_run(child).data.tags[SOURCE_TYPE_TAG] == "LOCAL"
    assert tracker.get_run(alone).data.tags[SOURCE_NAME_TAG] == "rlhf"  # argv is [""] here
    assert tracker.source_of(child) == source_tags("flows/sweep.py")


def test_the_compare_link_stays_in_the_model_training_view():
    url = mlflow_compare_url("3", ["run-a", "run-b"], base="http://mlflow.example:5000")
    query = urllib.parse.parse_qs(url.split("#/compare-runs?", 1)[1])
    assert url.startswith("http://mlflow.example:5000/#/compare-runs?")
    assert json.loads(query["runs"][0]) == ["run-a", "run-b"] and json.loads(query["experiments"][0]) == ["3"]
    assert query["workflowType"] == ["machine_learning"]
