"""Where the task layer logs: the tracking context handed to every task, and the one way to build a Tracker."""

from __future__ import annotations

import os

import torch
from pydantic import BaseModel

from rlhf.config import RuntimeConfig, TrackingConfig
from rlhf.models.device import resolve_device
from rlhf.tracking.client import Tracker
from rlhf.tracking.metrics_writer import LogFn

# The training stages write their per-step metrics to MLflow in batches (and before each resume state and at the
# end), not one store transaction per step. Where a core is free of torch's threads, or the model trains on a GPU (the
# CPU threads then mostly wait on the device), a writer thread of the stage's own writes them every
# METRICS_BACKGROUND_EVERY_S seconds and the training loop only waits for what is left at a resume state or at the
# end. Where torch's threads take every core of a CPU run, the training thread writes them itself every
# METRICS_EVERY_S seconds: a writer thread there would take a core (and the GIL) from torch's parallel ops, which then
# wait for their slowest thread (docs/benchmark.md has the measurements).
METRICS_EVERY_S = 5.0
METRICS_BACKGROUND_EVERY_S = 1.0


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


def metrics_in_background(runtime: RuntimeConfig) -> bool:
    """Whether a training stage's metrics are written by a writer thread: on a GPU, or with a core that torch's
    threads leave free (call after the stage has set its threads)."""
    if resolve_device(runtime.device).type == "cuda":
        return True
    return (os.cpu_count() or 1) > torch.get_num_threads()


def training_logger(tracker: Tracker, run_id: str, also: LogFn, runtime: RuntimeConfig) -> LogFn:
    """The `log(metrics, step)` of a training stage: its steps written to the stage's run in batches (by a writer
    thread where `metrics_in_background`), `also` (the progress display) seeing each as it comes; `end_run` writes
    the rest."""
    if metrics_in_background(runtime):
        return tracker.metric_logger(run_id, also, METRICS_BACKGROUND_EVERY_S, True)
    return tracker.metric_logger(run_id, also, METRICS_EVERY_S, False)
