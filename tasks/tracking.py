"""Where the task layer logs: the tracking context handed to every task, and the one way to build a Tracker."""

from __future__ import annotations

from pydantic import BaseModel

from rlhf.config import TrackingConfig
from rlhf.tracking import Tracker

# The training stages write their per-step metrics to MLflow in batches, every this many seconds (and before each
# resume state and at the end): one store transaction per step cost several per cent of a PPO update.
METRICS_EVERY_S = 5.0


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
