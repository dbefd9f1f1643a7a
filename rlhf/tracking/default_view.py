"""The experiment's default view in the MLflow UI: the runs table's columns and the order of the chart sections.

MLflow 3's server keeps no default columns or chart layout for an experiment; the UI keeps them per browser (local
storage). What it does read from the server is a *shared view*: the experiment tag ``mlflow.sharedViewState.<key>``
(a JSON object with the runs page's search facets and UI state: ``selectedColumns``, ``compareRunSections``, ...),
applied when the experiment page is opened with ``?viewStateShareKey=<key>`` (the UI's own "Share" button writes such
tags). :class:`rlhf.tracking.client.Tracker` writes the tag below on every experiment it opens, and every MLflow link
the project writes opens the experiment with it: the win rates, KL, reward-model accuracy and key parameters as columns,
and the PPO charts (``objective/``, ``periodic_eval/``, ``policy/``, ``value/``) first. The experiment page's rows are
pipeline runs, so the PPO curves are copied onto them when they close (:func:`copy_ppo_curves`).
"""

from __future__ import annotations

import base64
import json
import os
import zlib
from urllib.parse import quote

from rlhf.config.estimators import OBJECTIVE_LABEL_TAG
from rlhf.metrics import (
    EVAL_KL,
    EVAL_POLICY_GOLD,
    EVAL_POLICY_LENGTH,
    EVAL_WIN_RATE_GOLD,
    EVAL_WIN_RATE_GOLD_LC,
    EVAL_WIN_RATE_RM,
    EVAL_WIN_RATE_RM_LC,
    REWARD_BEST_EVAL_ACCURACY,
    TIME_POLICY_TRAIN,
)

VIEW_KEY = "rlhf-default"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_NAME = "RLHF: win rates, KL, PPO charts first"
# The query that opens the model-training view of an experiment (MLflow 3 also has a GenAI one) with this view.
EXPERIMENT_QUERY = f"viewStateShareKey={VIEW_KEY}&workflowType=machine_learning"  # after #/experiments/<id>/runs

COLUMN_METRICS = (
    EVAL_WIN_RATE_GOLD,
    EVAL_WIN_RATE_GOLD_LC,
    EVAL_WIN_RATE_RM,
    EVAL_WIN_RATE_RM_LC,
    EVAL_KL,
    REWARD_BEST_EVAL_ACCURACY,
    EVAL_POLICY_GOLD,
    EVAL_POLICY_LENGTH,
    TIME_POLICY_TRAIN,
)
# What trained the policy, as the summary names it ('PPO', 'GRPO', 'GSPO', 'DPO'; the param `algorithm` says 'ppo'
# for every objective of the online stage): a study's runs (make study) read as arm and seed beside their win rates.
# MLflow shows tag columns after the metrics and parameters, whatever their order here.
COLUMN_TAGS = (OBJECTIVE_LABEL_TAG,)
COLUMN_PARAMS = (
    "ppo.advantage_estimator",
    "policy_seed",
    "ppo.kl_coef",
    "ppo.total_episodes",
    "ppo.batch_size",
    "ppo.lr",
    "sft.model",
    "data.source",
    "seed",
)
# Chart sections (a metric's prefix before the last '/'), in display order; the UI appends any other one. The
# sections from `CHART_SECTIONS_COLLAPSED` on start collapsed.
CHART_SECTIONS = (
    "objective",
    "periodic_eval",
    "policy",
    "value",
    "loss",
    "advantages",
    "returns",
    "eval",
    "reward",
    "reward/train",
    "reward/eval",
    "sft",
    "dist",
    "tokens",
    "data",
    "speed",
    "time",
    "memory",
)
CURVE_SECTIONS = ("objective", "periodic_eval")  # copied from the PPO run onto its pipeline run
CHART_SECTIONS_COLLAPSED = ("dist", "tokens", "data", "speed", "time", "memory")


def copy_ppo_curves(tracker, ppo_run_id: str | None, pipeline_run_id: str) -> None:
    """The PPO stage run's training curves (``objective/``, ``periodic_eval/``) also on its pipeline run, so the
    experiment page, whose rows are pipeline runs, charts them (its chart sections only see the visible rows)."""
    if ppo_run_id:
        logged = tracker.get_run(ppo_run_id).data.metrics
        keys = [k for k in logged if k.split("/")[0] in CURVE_SECTIONS]
        tracker.copy_metrics(ppo_run_id, pipeline_run_id, keys)


def column_key(kind: str, name: str) -> str:
    """The runs table's id of a column: ``metrics.`eval/kl```, ``params.`ppo.kl_coef```, ``tags.`rlhf.cached```."""
    return f"{kind}.`{name}`"


def default_view() -> dict:
    """The shared view state: columns, chart sections in order (the UI fills the sections with a chart per metric,
    keeping this order since ``isAccordionReordered`` is set), newest runs first."""
    sections = [
        {
            "uuid": f"rlhf-{name}",
            "name": name,
            "display": name not in CHART_SECTIONS_COLLAPSED,
            "isReordered": True,
            "deleted": False,
            "isGenerated": True,
        }
        for name in CHART_SECTIONS
    ]
    return {
        "orderByKey": "attributes.start_time",
        "orderByAsc": False,
        "selectedColumns": [
            *(column_key("tags", t) for t in COLUMN_TAGS),
            *(column_key("metrics", m) for m in COLUMN_METRICS),
            *(column_key("params", p) for p in COLUMN_PARAMS),
        ],
        "compareRunCharts": [],
        "compareRunSections": sections,
        "isAccordionReordered": True,
        "hideEmptyCharts": True,
    }


# MLflow 3's kind of an experiment (the tag its experiment-type selector writes): model training, not GenAI. MLflow
# 3.17's UI does not choose its navigation from it: it takes the URL's `workflowType`, else the choice last made in
# the browser's side-bar switch (kept in local storage), else GenAI. The tag says what the experiment is to the
# MLflow versions and clients that read it; docs/orchestration.md has the user's one click for 3.17.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"


def experiment_tags() -> dict[str, str]:
    """The tags every experiment the pipeline logs to carries: its kind and the saved view."""
    return {KIND_TAG: KIND, VIEW_TAG: default_view_json()}


def default_view_json() -> str:
    """The tag's value, as the UI's "Save as new view" writes it: a name, and the state deflated and base64-encoded
    (the UI lists such tags under *Views*)."""
    state = json.dumps(default_view(), separators=(",", ":")).encode()
    packed = "deflate;" + base64.b64encode(zlib.compress(state, 9)).decode()
    return json.dumps({"name": VIEW_NAME, "createdAt": 0, "updatedAt": 0, "state": packed}, separators=(",", ":"))


# Links into the MLflow UI

DEFAULT_MLFLOW_UI_URL = "http://127.0.0.1:5000"


def mlflow_ui_url() -> str:
    """Base URL of the MLflow UI the links point at: ``$MLFLOW_UI_URL``, else the local default port."""
    return os.environ.get("MLFLOW_UI_URL", DEFAULT_MLFLOW_UI_URL).rstrip("/")


# MLflow 3's UI has two views of an experiment, GenAI (traces, evaluations) and model training (runs, charts,
# models); this query parameter opens the model-training one.
MLFLOW_VIEW = "workflowType=machine_learning"


def mlflow_experiment_url(experiment_id: str, base: str | None = None) -> str:
    """``http://127.0.0.1:5000/#/experiments/<exp>/runs?viewStateShareKey=rlhf-default&workflowType=machine_learning``:
    the runs table in the project's saved view (its columns, the PPO charts first; rlhf/tracking/default_view.py)."""
    return f"{base or mlflow_ui_url()}/#/experiments/{experiment_id}/runs?{EXPERIMENT_QUERY}"


def mlflow_run_url(experiment_id: str, run_id: str, base: str | None = None) -> str:
    """``http://127.0.0.1:5000/#/experiments/<exp>/runs/<run>?workflowType=machine_learning``: the run's page."""
    return f"{base or mlflow_ui_url()}/#/experiments/{experiment_id}/runs/{run_id}?{MLFLOW_VIEW}"


def mlflow_compare_url(experiment_id: str, run_ids: list[str], base: str | None = None) -> str:
    """``http://127.0.0.1:5000/#/compare-runs?runs=[...]&experiments=[...]&workflowType=machine_learning``: MLflow's
    comparison of `run_ids`, in the model-training view. The UI's own Compare button builds this URL without
    `workflowType`, and its page then switches to the GenAI view (Traces, Sessions, Judges)."""
    runs = quote(json.dumps(list(run_ids), separators=(",", ":")))
    experiments = quote(json.dumps([experiment_id], separators=(",", ":")))
    return f"{base or mlflow_ui_url()}/#/compare-runs?runs={runs}&experiments={experiments}&{MLFLOW_VIEW}"
