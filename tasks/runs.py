"""MLflow child runs of the pipeline's stages (through rlhf.tracking, the one module that imports mlflow)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.states import State

from rlhf.errors import CheckpointWriteError, NonFiniteError, UserInputError
from rlhf.tracking import Tracker
from tasks.caching import TrackingContext, code_version

RUN_ID_FILE = ".mlflow_run_id"


def tracker_for(ctx: TrackingContext) -> Tracker:
    return Tracker(ctx.uri, ctx.experiment, ctx.artifact_location)


@contextlib.contextmanager
def stage_run(
    ctx: TrackingContext, stage: str, folder: Path, params: dict[str, Any] | None = None, resume: bool = False
) -> Iterator[tuple[Tracker, str]]:
    """A child run of the pipeline run for one stage; with `resume`, a retry continues the same run."""
    tracker = tracker_for(ctx)
    marker = folder / RUN_ID_FILE
    run_id = marker.read_text().strip() if resume and marker.is_file() else None
    if run_id is not None:
        tracker.reopen_run(run_id)  # a retry continues the run it started
    else:
        run_id = tracker.start_run(
            stage,
            ctx.parent_run_id,
            tags={
                "stage": stage,
                "prefect.flow_run_id": str(ctx.flow_run_id),
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
    except BaseException:
        tracker.end_run(run_id, failed=True)
        raise
    tracker.end_run(run_id)
    tracker.set_tags(ctx.parent_run_id, {f"stage.{stage}.run_id": run_id})


# The prepared data files as MLflow dataset inputs: file -> (dataset name, context).
DATA_FILES = {
    "train.parquet": ("preferences-train", "training"),
    "eval.parquet": ("preferences-eval", "evaluation"),
    "sft.parquet": ("sft-demonstrations", "training"),
    "prompts.parquet": ("ppo-prompts", "training"),
}


def log_data_inputs(tracker: Tracker, run_id: str, folder: str | Path, digest: str, *files: str) -> None:
    """Record prepared data files (all of them when none are named) as dataset inputs of a run."""
    names = files or tuple(DATA_FILES)
    tracker.log_parquet_inputs(run_id, [(Path(folder) / f, *DATA_FILES[f]) for f in names], digest)


def injected_failure(stage: str, folder: Path) -> int | None:
    """Fault injection for tests and drills: ``RLHF_INJECT_FAILURE=train_policy_ppo:2`` makes the first attempt
    of that stage stop (raise) after 2 updates, once; the retry then resumes from the saved state."""
    name, _, after = os.environ.get("RLHF_INJECT_FAILURE", "").partition(":")
    marker = folder / ".failure_injected"
    if name != stage or not after or marker.exists():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(after)
    return int(after)


class ProgressBar:
    """A progress artifact (a bar in the Prefect UI) of the current flow or task run. Writing it never fails the
    run: an API error is a warning in the run's log and the bar stops moving."""

    def __init__(self, description: str) -> None:
        self.artifact_id = None
        try:
            self.artifact_id = create_progress_artifact(0.0, description=description)
        except Exception as err:  # noqa: BLE001
            get_run_logger().warning("could not write the progress artifact '%s': %s", description, err)

    def set(self, percent: float, description: str) -> None:
        if self.artifact_id is None:
            return
        try:
            update_progress_artifact(self.artifact_id, percent, description=description)
        except Exception as err:  # noqa: BLE001
            get_run_logger().warning("could not update the progress artifact '%s': %s", description, err)


class StepProgress:
    """The progress bar of a training task, advanced as steps are logged: at most one update every
    `min_interval` seconds, plus the last step."""

    def __init__(self, stage: str, total: int, min_interval: float = 2.0) -> None:
        self.stage, self.total, self.min_interval = stage, max(1, total), min_interval
        self.last_update = 0.0
        self.bar = ProgressBar(f"{stage}: step 0 of {self.total}")

    def update(self, step: int) -> None:
        now = time.monotonic()
        if now - self.last_update < self.min_interval and step < self.total:
            return
        self.last_update = now
        done = min(step, self.total)
        self.bar.set(100.0 * done / self.total, f"{self.stage}: step {done} of {self.total}")


def progress_logger(stage: str, every: int, total: int | None = None):
    """Echo a few key metrics to the Prefect run's log every `every` steps; with `total`, also advance a progress
    artifact of the task."""
    logger = get_run_logger()
    progress = StepProgress(stage, total) if total else None

    def log(metrics: dict[str, float], step: int) -> None:
        if step % every == 0:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in list(metrics.items())[:6])
            logger.info("%s step %d: %s", stage, step, shown)
        if progress is not None:
            progress.update(step)

    return log


def echo_with_progress(stage: str, total: int, pattern: str):
    """For a child command's output (data-parallel PPO): each line goes to the task's log, and lines matching
    `pattern` advance a progress artifact to the step they name."""
    logger, progress, step_line = get_run_logger(), StepProgress(stage, total), re.compile(pattern)

    def echo(line: str) -> None:
        logger.info("%s", line)
        if match := step_line.match(line):
            progress.update(int(match.group(1)))

    return echo


def retry_unless_user_error(task, task_run, state: State) -> bool:
    """Retry crashes and lost resources; never a bad config or bad data, a NaN loss (the same steps would give it
    again) or a full disk (it stays full for the next seconds): a rerun after a change resumes from the last saved
    state."""
    try:
        state.result()
    except (UserInputError, NonFiniteError, CheckpointWriteError):
        return False
    except Exception:
        return True
    return True
