"""Where the task layer logs: the tracking context handed to every task, and the one way to build a Tracker."""

from __future__ import annotations

from pydantic import BaseModel

from rlhf.config import TrackingConfig
from rlhf.logs import LogFn
from rlhf.tracking import Tracker

# The training stages write their per-step metrics to MLflow in batches, every this many seconds (and before each
# resume state and at the end): one store transaction per step cost several per cent of a PPO update. With
# METRICS_IN_BACKGROUND, a writer thread of the stage's own writes them, so that the training loop only waits for
# what is left at a resume state or at the end.
METRICS_EVERY_S = 1.0
METRICS_IN_BACKGROUND = True


class TrackingContext(BaseModel):
    """Where to log: passed explicitly to every task (MLflow's active run is thread-local)."""

    uri: str
    experiment: str
    artifact_location: str | None = None
    parent_run_id: str
    run_name: str | None = None  # of the parent run: the stage runs are named `<run_name>/<stage>`
    flow_run_id: str | None = None
    log_checkpoints: bool = True
    registered_model: str | None = None


def tracker_for(tracking: TrackingContext | TrackingConfig) -> Tracker:
    """The Tracker of a pipeline's experiment, from its tracking config or the context its tasks get."""
    return Tracker(tracking.uri, tracking.experiment, tracking.artifact_location)


def training_logger(tracker: Tracker, run_id: str, also: LogFn) -> LogFn:
    """The `log(metrics, step)` of a training stage: its steps written to the stage's run in batches (by a writer
    thread with METRICS_IN_BACKGROUND), `also` (the progress display) seeing each as it comes; `end_run` writes
    the rest."""
    return tracker.metric_logger(run_id, also, METRICS_EVERY_S, METRICS_IN_BACKGROUND)
