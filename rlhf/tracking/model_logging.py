"""What MLflow's transformers flavour does around `Tracker.log_transformers_model` that says nothing about a run:
quieted or skipped for the duration of the call; and the fluent API's tracking URI, set for the call alone."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from rlhf.config.sections import TRACKING_URI_ENV


@contextlib.contextmanager
def hub_card_warnings_off() -> Iterator[None]:
    """MLflow's transformers flavour looks a logged model up on the hub for its model card and licence and warns on
    every run when a local checkpoint has neither; those two warnings say nothing about the run: quiet while logging."""
    logger = logging.getLogger("mlflow.transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def no_requirement_check() -> Iterator[None]:
    """MLflow checks a logged model's pip requirements against the installed packages by mapping every installed
    distribution to its modules (about 2 s on the first call in a process, i.e. once per pipeline run). The
    requirements `log_transformers_model` gives are the running versions of transformers and torch: the check cannot
    fail, so it is skipped while logging (the caller holds the Tracker's fluent-API lock)."""
    from mlflow.utils import environment

    check = getattr(environment, "warn_dependency_requirement_mismatches", None)
    if check is None:  # another MLflow: its own check runs
        yield
        return
    environment.warn_dependency_requirement_mismatches = lambda requirements: None
    try:
        yield
    finally:
        environment.warn_dependency_requirement_mismatches = check


@contextlib.contextmanager
def fluent_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (global to the process) on `uri` for the block; after it, MLflow's global URI and
    $MLFLOW_TRACKING_URI as they were. MLflow's own restore unsets the variable where no global URI was set: a
    pipeline whose tracking.uri came from an exported MLFLOW_TRACKING_URI lost it once PPO logged its model, and its
    summary then named the config as the store's origin."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    exported = os.environ.get(TRACKING_URI_ENV)
    try:
        with _use_tracking_uri(uri):
            yield
    finally:
        if exported is None:
            os.environ.pop(TRACKING_URI_ENV, None)
        else:
            os.environ[TRACKING_URI_ENV] = exported
