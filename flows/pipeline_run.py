"""The pipeline's MLflow run: opened before the stages (the whole config as params), closed after them with the
summary, and the PPO policy registered; the stage runs are its children (tasks/stage_runs.py)."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.runtime import flow_run

from rlhf.config import PipelineConfig, flatten
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.sweeps.optuna_search import TrialRef
from rlhf.tracking.client import source_tags
from rlhf.tracking.default_view import copy_ppo_curves
from tasks.caching import code_version
from tasks.outputs import StageOutput
from tasks.stage_runs import log_data_inputs
from tasks.tracking import TrackingContext, tracker_for

PRUNED_TAG = "sweep.pruned"
CACHED_TAG, RESULTS_FROM_TAG = "rlhf.cached", "rlhf.results_from_run"
# MLflow's source of the pipeline's runs and of the model it logs: the flow's file (MLflow's own guess is the file
# Python started, Prefect's engine.py for a deployment's flow run)
PIPELINE_SOURCE = "flows/pipeline.py"


@task(name="open_pipeline_run")
def open_pipeline_run(config: PipelineConfig, trial: TrialRef | None = None) -> TrackingContext:
    """The parent MLflow run of this pipeline run, with the whole config as params (and the sweep trial it is)."""
    tracker = tracker_for(config.tracking)
    flow_run_id = flow_run.get_id()
    # runs of a pipeline process killed earlier (SIGKILL, power loss) would stay RUNNING for ever; a killed stage's
    # run is reopened by the stage when it resumes
    for killed in tracker.end_orphaned_runs():
        get_run_logger().warning("MLflow run %s of a process that is gone: marked KILLED", killed)
    run_name = config.run_name or f"pipeline-{flow_run.get_name() or 'local'}"
    run_id = tracker.start_run(
        run_name,
        tags={
            **source_tags(PIPELINE_SOURCE),
            "prefect.flow_run_id": str(flow_run_id),
            "code_version": code_version(),
            **({"sweep.trial": str(trial.number), "sweep.study": trial.study} if trial else {}),
        },
    )
    tracker.log_params(run_id, flatten(config))
    return tracking_context(config, run_id, run_name)


def tracking_context(config: PipelineConfig, parent_run_id: str, run_name: str) -> TrackingContext:
    """What the stage tasks log under: their runs are children of `parent_run_id` (a pipeline or a sweep run)."""
    return TrackingContext(
        uri=tracker_for(config.tracking).uri,
        experiment=config.tracking.experiment,
        artifact_location=config.tracking.artifact_location,
        parent_run_id=parent_run_id,
        run_name=run_name,
        flow_run_id=flow_run.get_id(),
        log_checkpoints=config.tracking.log_checkpoints,
        registered_model=config.tracking.registered_model,
    )


@task(name="register_policy")
def register_policy(tracking: TrackingContext, summary: dict[str, Any]) -> str:
    """The PPO policy as a version of the registered model, tagged with the evaluation summary."""
    tracker = tracker_for(tracking)
    assert tracking.registered_model is not None
    metrics = {k: f"{v:.6g}" for k, v in summary.items() if isinstance(v, float) and k.startswith(("eval/", "reward/"))}
    version = tracker.register_model_version(
        tracking.registered_model,
        summary["stage.train_policy_ppo.run_id"],
        "ppo_checkpoint/policy",
        tags={
            **metrics,
            **{k: v for k, v in summary.items() if k == EVAL_WARNING_TAG},
            "pipeline_run_id": tracking.parent_run_id,
            "code_version": code_version(),
        },
        description=f"PPO policy of pipeline run {tracking.parent_run_id}",
    )
    return f"models:/{tracking.registered_model}/{version}"


@task(name="close_pipeline_run")
def close_pipeline_run(
    tracking: TrackingContext,
    summary: dict[str, Any],
    failed: bool = False,
    pruned: bool = False,
    description: str = "",
    killed: bool = False,
) -> None:
    """Log the pipeline summary and the prepared data (as dataset inputs) on the parent run and end it: KILLED when
    `killed` (stopped by a signal) or `pruned` (its sweep's pruner stopped it; tagged ``sweep.pruned``). `description`
    (the summary's notes and warnings) becomes the run's description in the MLflow UI."""
    tracker = tracker_for(tracking)
    if "data" in summary:
        log_data_inputs(tracker, tracking.parent_run_id, summary["data"], summary["data_digest"])
    tracker.log_metrics(tracking.parent_run_id, {k: v for k, v in summary.items() if isinstance(v, float)}, 0)
    copy_ppo_curves(tracker, summary.get("stage.train_policy_ppo.run_id"), tracking.parent_run_id)  # for its charts
    tracker.set_tags(tracking.parent_run_id, {k: v for k, v in summary.items() if isinstance(v, str)})
    if description:
        tracker.set_description(tracking.parent_run_id, description)
    if pruned:
        tracker.set_tags(tracking.parent_run_id, {PRUNED_TAG: "true"})
    tracker.end_run(tracking.parent_run_id, failed=failed, killed=pruned or killed)


def cache_tags(tracking: TrackingContext, outputs: tuple[StageOutput, ...]) -> dict[str, str]:
    """Tags of the pipeline run saying which stages came from the cache: `stage.<stage>.cached` per stage, and
    `rlhf.cached` ("true": every stage, "partial", "false"); when every stage was cached, `rlhf.results_from_run`
    names the pipeline run that computed the evaluation (and `rlhf.results_from_run_name` its name)."""
    tags = {f"stage.{output.stage}.cached": str(output.cached).lower() for output in outputs}
    cached = [output.cached for output in outputs]
    tags[CACHED_TAG] = "true" if all(cached) else "partial" if any(cached) else "false"
    evaluation = outputs[-1]
    if all(cached) and evaluation.mlflow_run_id:
        tracker = tracker_for(tracking)
        origin = tracker.get_run(evaluation.mlflow_run_id).data.tags.get("mlflow.parentRunId")
        if origin:
            tags[RESULTS_FROM_TAG] = origin
            tags[f"{RESULTS_FROM_TAG}_name"] = tracker.get_run(origin).info.run_name or origin
    return tags
