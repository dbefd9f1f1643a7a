"""Prefect artifacts of the flows: stage progress, links to the MLflow runs, and result tables.

They show on the flow run's Artifacts tab in the Prefect UI (and, for keyed ones, on the Artifacts page across
runs). An artifact that cannot be written is a warning in the run's log, never a failed training run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_link_artifact,
    create_table_artifact,
)

from flows.summary import summary_notes
from rlhf.config import TrackingConfig
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.stages import STAGE_TASKS
from rlhf.tracking.default_view import COLUMN_METRICS, mlflow_compare_url, mlflow_experiment_url, mlflow_run_url
from tasks.progress import ProgressBar
from tasks.stages import OVEROPTIMISATION_TAG
from tasks.tracking import TrackingContext, tracker_for


def artifact_key(text: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    key = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in key.split("-") if part)


def _warn(what: str, err: Exception) -> None:
    get_run_logger().warning("could not write the %s artifact: %s", what, err)


def _number(value: Any) -> Any:
    """Tables hold plain JSON values: rounded floats, None for NaN."""
    if isinstance(value, float):
        return None if not math.isfinite(value) else round(value, 4)
    return value


class StageProgress:
    """A progress artifact of the flow run, advanced after each completed stage."""

    def __init__(self, stages: Sequence[str], description: str = "RLHF pipeline") -> None:
        self.stages = list(stages)
        self.description = description
        self.done_count = 0
        self.bar = ProgressBar(f"{description}: starting {self.stages[0]}")

    def done(self, stage: str) -> None:
        """Mark `stage` finished: progress becomes (stages done) / (all stages) in percent."""
        self.done_count += 1
        following = self.stages[self.done_count] if self.done_count < len(self.stages) else None
        text = f"{self.description}: {stage} done ({self.done_count}/{len(self.stages)})"
        text += f", next {following}" if following else ", finished"
        self.bar.set(100.0 * self.done_count / len(self.stages), text)


COMPARED_RUNS = 5  # the evaluation table's compare link: this run and the experiment's 4 previous pipeline runs


def link_mlflow_comparison(tracking: TrackingConfig | TrackingContext, run_ids: list[str], text: str, key: str) -> None:
    """A link artifact to MLflow's comparison of `run_ids` in its model-training view (`mlflow_compare_url`)."""
    try:
        tracker = tracker_for(tracking)
        create_link_artifact(
            mlflow_compare_url(tracker.experiment_id, run_ids),
            link_text=text,
            key=key,
            description=f"MLflow's comparison of {len(run_ids)} runs of experiment '{tracking.experiment}' in its "
            "model-training view (MLflow's own Compare button opens the GenAI view instead). The link needs the MLflow "
            "UI running: make ui starts it with the Prefect UI, make mlflow-ui alone.",
        )
    except Exception as err:
        _warn("MLflow comparison link", err)


def link_mlflow_run(tracking: TrackingConfig | TrackingContext, run_id: str, text: str, key: str | None = None) -> None:
    """A link artifact to an MLflow run in the MLflow UI (base URL from ``$MLFLOW_UI_URL``)."""
    try:
        tracker = tracker_for(tracking)
        create_link_artifact(
            mlflow_run_url(tracker.experiment_id, run_id),
            link_text=text,
            key=key,
            # no code spans (the artifact card's preview drops them), and the experiment's URL, whose '&' the UI
            # shows as a literal '&amp;' in text, behind a Markdown link
            description=f"MLflow run {run_id} of experiment '{tracking.experiment}' "
            f"([the experiment's page]({mlflow_experiment_url(tracker.experiment_id)})), tracking store {tracker.uri}. "
            "The link needs the MLflow UI running: make ui starts it with the Prefect UI, make mlflow-ui alone.",
        )
    except Exception as err:
        _warn("MLflow link", err)


def stage_rows(summary: dict[str, Any], experiment_id: str) -> list[dict[str, Any]]:
    """One row per stage: whether it ran (continuing the stage of a crashed flow run, when it did) or came from the
    cache, and the URL of its MLflow run (for a cached stage, the run that computed the result)."""
    rows = []
    for stage in STAGE_TASKS:
        run_id = summary.get(f"stage.{stage}.run_id")
        if run_id is None:
            continue
        cached = summary.get(f"stage.{stage}.cached") == "true"
        resumed = summary.get(f"stage.{stage}.resumed_from")  # flows/crashed_runs.py
        how = "cached: " if cached else f"ran (resumed from crashed flow run {resumed}): " if resumed else "ran: "
        rows.append({"metric": f"stage {stage}", "value": how + mlflow_run_url(experiment_id, run_id)})
    return rows


def publish_pipeline_results(summary: dict[str, Any], tracking: TrackingConfig | TrackingContext) -> None:
    """The link to the pipeline's MLflow run and a table of its evaluation summary, the stages (ran or cached) and
    their MLflow runs; the summary's notes and warnings (`summary_notes`) open the table's description."""
    notes = summary_notes(summary)
    link_mlflow_run(
        tracking,
        summary["mlflow_run_id"],
        "MLflow run of this pipeline (stages are its child runs)",
        key="rlhf-mlflow-run",
    )
    warning = summary.get(EVAL_WARNING_TAG)
    rows = [{"metric": "note", "value": note} for note in notes if note.startswith("NOTE: ")]
    rows += [{"metric": EVAL_WARNING_TAG, "value": warning}] if warning else []
    alarm = summary.get(OVEROPTIMISATION_TAG)  # the over-optimisation alarm of PPO's periodic evaluations
    rows += [{"metric": OVEROPTIMISATION_TAG, "value": alarm}] if alarm else []
    figures = {k: v for k, v in summary.items() if isinstance(v, float)}
    first = [k for k in COLUMN_METRICS if k in figures]  # the key figures (the MLflow view's columns) on top
    rows += [{"metric": k, "value": _number(figures[k])} for k in first + [k for k in figures if k not in first]]
    rows += [{"metric": k, "value": v} for k, v in summary.items() if k.endswith(("_checkpoint", "completions"))]
    try:
        tracker = tracker_for(tracking)
        rows += stage_rows(summary, tracker.experiment_id)
        # this run beside the experiment's previous pipeline runs, in MLflow's model-training view
        recent = [summary["mlflow_run_id"]] + [
            r.run_id for r in tracker.pipeline_runs(COMPARED_RUNS) if r.run_id != summary["mlflow_run_id"]
        ]
        recent = recent[:COMPARED_RUNS]
        url = mlflow_compare_url(tracker.experiment_id, recent)
        rows.append({"metric": f"compare with the last {len(recent) - 1} runs in MLflow", "value": url})
    except Exception as err:  # noqa: BLE001
        _warn("evaluation table's stage links", err)
    description = (
        "Evaluation of the PPO policy against the SFT policy on held-out prompts (gold reward where the task has "
        "one, reward-model score, win rates at equal length, response lengths and empty answers, KL), where the "
        "outputs are, and each stage (ran, or cached: from an earlier run) with its MLflow run."
    )
    if notes:
        description = " ".join(notes) + " " + description
    try:
        create_table_artifact(rows, key="rlhf-evaluation", description=description)
    except Exception as err:
        _warn("evaluation table", err)


def publish_table(rows: list[dict[str, Any]], key: str, description: str) -> None:
    """A table artifact (e.g. a sweep's ranking), floats rounded for reading."""
    try:
        create_table_artifact(
            [{k: _number(v) for k, v in row.items()} for row in rows], key=artifact_key(key), description=description
        )
    except Exception as err:
        _warn("table", err)
