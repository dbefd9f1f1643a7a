"""MLflow child runs of the pipeline's stages, and the prepared data files as their dataset inputs (through
rlhf.tracking.client, the one module that imports mlflow)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from prefect.context import TaskRunContext
from prefect.exceptions import ExternalSignal

from rlhf.config import RuntimeConfig
from rlhf.models.device import configure_cpu
from rlhf.stages import stage_of
from rlhf.tracking.client import Tracker
from rlhf.tracking.metrics_writer import LogFn
from tasks.caching import code_version, current_stage_dir
from tasks.faults import injected_failure
from tasks.progress import progress_logger, task_logger
from tasks.tracking import TrackingContext, tracker_for, training_logger

RUN_ID_FILE = ".mlflow_run_id"
# The flow run a stage run belongs to, and the earlier flow run (killed: a rerun, not a retry) whose stage run it
# continued; also a tag of the pipeline run (with `stage.<stage>.resumed_from_flow_run`), flows/resumed_runs.py
FLOW_RUN_TAG, RESUMED_FROM_TAG = "prefect.flow_run_id", "rlhf.resumed_from_flow_run"
# MLflow's tag of a child run's parent, and the pipeline run a resumed stage run was a child of before
PARENT_RUN_TAG, RESUMED_FROM_PARENT_TAG = "mlflow.parentRunId", "rlhf.resumed_from_parent_run"


def stage_run_name(pipeline_run_name: str | None, stage: str) -> str:
    """`<pipeline run name>/<short stage name>` (`pipeline-brave-owl/ppo`, rlhf/stages.py), so the legends of
    charts comparing runs tell the stages of different pipeline runs apart; the stage name alone without a pipeline
    run name."""
    return f"{pipeline_run_name}/{stage_of(stage).short}" if pipeline_run_name else stage


def stopped_by_signal(err: BaseException) -> bool:
    """Whether `err` is how Ctrl-C or SIGTERM reaches running code: a KeyboardInterrupt (SIGINT, and the CLI's
    handler for both), or Prefect's TerminationSignal (SIGTERM in a flow run that Prefect's engine runs)."""
    return isinstance(err, (KeyboardInterrupt, ExternalSignal))


@contextlib.contextmanager
def stage_run(
    tracking: TrackingContext, stage: str, folder: Path, params: dict[str, Any] | None = None, resume: bool = False
) -> Iterator[tuple[Tracker, str]]:
    """A child run of the pipeline run for one stage; with `resume`, a retry continues the same run."""
    tracker = tracker_for(tracking)
    marker = folder / RUN_ID_FILE
    run_id = marker.read_text().strip() if resume and marker.is_file() else None
    if run_id is not None and finished_elsewhere(tracker, run_id, tracking):
        run_id = None  # the stage's work is done, but its run belongs to a pipeline that ended well: a run of its own
    if run_id is not None:
        reopen(tracker, run_id, tracking, stage)  # a retry or a rerun continues the run it started
    else:
        run_id = tracker.start_run(
            stage_run_name(tracking.run_name, stage),
            tracking.parent_run_id,
            tags={
                "stage": stage,
                FLOW_RUN_TAG: str(tracking.flow_run_id),
                "code_version": code_version(),
                "output_dir": str(folder),
            },
        )
        if params:
            tracker.log_params(run_id, params)
        if resume:
            folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(run_id)
    try:
        yield tracker, run_id
    except BaseException as err:  # stopped by Ctrl-C or SIGTERM: KILLED, as the CLI ends it; any other error FAILED
        tracker.end_run(run_id, failed=True, killed=stopped_by_signal(err))
        raise
    tracker.end_run(run_id)
    tracker.set_tags(tracking.parent_run_id, {f"stage.{stage}.run_id": run_id})


def finished_elsewhere(tracker: Tracker, run_id: str, tracking: TrackingContext) -> bool:
    """Whether a stage run found in the stage's folder belongs to another flow run whose pipeline run FINISHED: not
    a killed run to continue, but a finished one that a later pipeline reran (its Prefect cache missed, as for a
    checkpoint used as it is), which keeps its run and its place under its own pipeline."""
    tags = tracker.get_run(run_id).data.tags
    earlier, parent = tags.get(FLOW_RUN_TAG), tags.get(PARENT_RUN_TAG)
    if not earlier or earlier == str(tracking.flow_run_id) or not parent or parent == tracking.parent_run_id:
        return False
    return tracker.get_run(parent).info.status == "FINISHED"


def reopen(tracker: Tracker, run_id: str, tracking: TrackingContext, stage: str) -> None:
    """Reopen a stage's run. Started by an earlier flow run (a rerun after a killed one, not a retry), it becomes
    this flow run's and a child of this pipeline run (its former parent in `RESUMED_FROM_PARENT_TAG`), and it and the
    pipeline run name that earlier flow run (`RESUMED_FROM_TAG`)."""
    earlier = tracker.get_run(run_id).data.tags.get(FLOW_RUN_TAG)
    tracker.reopen_run(run_id)
    current = str(tracking.flow_run_id) if tracking.flow_run_id else None
    if earlier and current and earlier != current:
        # it moves under this pipeline run, which holds the rest of the rerun; the killed one stays named
        former = tracker.get_run(run_id).data.tags.get(PARENT_RUN_TAG, "")
        tracker.set_tags(
            run_id,
            {RESUMED_FROM_TAG: earlier, FLOW_RUN_TAG: current, PARENT_RUN_TAG: tracking.parent_run_id}
            | ({RESUMED_FROM_PARENT_TAG: former} if former else {}),
        )
        tracker.set_tags(
            tracking.parent_run_id, {RESUMED_FROM_TAG: earlier, f"stage.{stage}.resumed_from_flow_run": earlier}
        )


# The prepared data files as MLflow dataset inputs: file -> (dataset name, context).
DATA_FILES = {
    "train.parquet": ("preferences-train", "training"),
    "eval.parquet": ("preferences-eval", "evaluation"),
    "sft.parquet": ("sft-demonstrations", "training"),
    "prompts.parquet": ("ppo-prompts", "training"),
}


@dataclass
class StageScope:
    """The running stage task, as its body sees it: its name (the task's, from rlhf/stages.py), its output
    folder, its MLflow child run, and the step at which an injected failure stops it (tests; None: none)."""

    name: str
    folder: Path
    tracker: Tracker
    run_id: str
    stop_after: int | None

    def training_log(self, runtime: RuntimeConfig, every: int, total: int, name: str | None = None) -> LogFn:
        """The training loop's `log`: MLflow (batched), and the Prefect progress bar every `every` of `total` steps
        (its lines and bar named `name`: the objective that trains, for the policy stage; else the stage)."""
        progress = progress_logger(stage_of(self.name).short, every, total, name)
        return training_logger(self.tracker, self.run_id, progress, runtime)


@contextlib.contextmanager
def stage_scope(
    tracking: TrackingContext, runtime: RuntimeConfig, params: dict[str, Any] | None = None, resume: bool = False
) -> Iterator[StageScope]:
    """The template of every stage task's body (data, SFT, reward, ensemble, init, PPO, DPO, evaluation): torch's
    CPU threads set, the stage's folder, its MLflow child run (continued by a retry with `resume`, which also reads
    an injected failure), ended FAILED or KILLED if the body raises."""
    configure_cpu(runtime.threads)
    name, folder = TaskRunContext.get().task.name, current_stage_dir()
    with stage_run(tracking, name, folder, params, resume) as (tracker, run_id):
        yield StageScope(name, folder, tracker, run_id, injected_failure(name, folder) if resume else None)


def log_data_inputs(tracker: Tracker, run_id: str, folder: str | Path, digest: str, *files: str) -> None:
    """Record prepared data files (all of them when none are named) as dataset inputs of a run."""
    names = files or tuple(DATA_FILES)
    tracker.log_parquet_inputs(run_id, [(Path(folder) / name, *DATA_FILES[name]) for name in names], digest)


def log_policy_checkpoint(tracker: Tracker, run_id: str, final: Path, policy_path: str, stage: str) -> None:
    """A policy stage's final folder as the `<stage>_checkpoint` artifact, and its policy as an MLflow transformers
    model (the Models column, `mlflow models serve`); a model-logging problem is a warning, never a failed stage."""
    tracker.log_artifacts(run_id, final, f"{stage}_checkpoint")
    name = stage.upper()
    try:
        uri = tracker.log_transformers_model(run_id, policy_path, "policy_model")
        task_logger().info("%s policy logged as MLflow model %s", name, uri)
    except Exception as err:  # noqa: BLE001 (a model-logging problem never fails a trained stage)
        task_logger().warning("could not log the %s policy as an MLflow transformers model: %s", name, err)


def rollout_samples(rollouts: Path, every: int, per_update: int = 8) -> pd.DataFrame | None:
    """A sample of the PPO rollouts for an MLflow table: the first `per_update` records (prompt, response, score,
    KL, ...) of every `every`-th update and of the last one; None when none were recorded."""
    files = sorted(rollouts.glob("update_*.parquet"))
    if not files:
        return None
    last = int(files[-1].stem.split("_")[1])
    chosen = [f for f in files if int(f.stem.split("_")[1]) % every == 0 or int(f.stem.split("_")[1]) == last]
    return pd.concat([pd.read_parquet(f).head(per_update) for f in chosen], ignore_index=True)


def samples_every(num_updates: int, tables: int = 10) -> int:
    """Every how many updates a rollout sample goes to the table: about `tables` samples over the run."""
    return max(1, num_updates // tables)
