"""The fluent API's tracking URI, set for one call (`Tracker.log_transformers_model`), leaves an exported
MLFLOW_TRACKING_URI as it was: MLflow's own restore unset it, and a pipeline whose store came from it then named the
config as the store's origin in its summary and its pipeline run's tags."""

from __future__ import annotations

import os

import mlflow
import pytest

from rlhf.config.sections import TRACKING_URI_ENV, tracking_uri_origin
from rlhf.tracking.model_logging import fluent_tracking_uri


@pytest.mark.parametrize("exported", ["http://team.internal:5000", None])
def test_the_exported_tracking_uri_is_kept_after_a_fluent_call(monkeypatch, tmp_path, exported):
    if exported is None:
        monkeypatch.delenv(TRACKING_URI_ENV, raising=False)
    else:
        monkeypatch.setenv(TRACKING_URI_ENV, exported)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    with fluent_tracking_uri(store):
        assert mlflow.get_tracking_uri() == store
    assert os.environ.get(TRACKING_URI_ENV) == exported
    if exported is not None:
        assert tracking_uri_origin(exported) == TRACKING_URI_ENV
