"""Tracking past one machine: a real `mlflow server` (SQLite backend, proxied artifact store) on a free loopback
port, used through rlhf.tracking and by the smoke pipeline with ``tracking.uri=http://...``.

About 45 seconds on two cores; deselect with ``pytest -k "not server"``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlhf.config import load_config
from rlhf.tracking import Tracker
from tests.conftest import REPO

pytestmark = pytest.mark.slow  # end-to-end: real servers and processes (deselect with -m "not slow")

BIN = Path(sys.executable).parent
TINY = ["ppo.total_episodes=32", "ppo.batch_size=16", "eval.n_prompts=8", "eval.batch_size=8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """`mlflow server` in its own process group (killed with its workers afterwards); yields (url, temp folder)."""
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(BIN / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{tmp}/db.sqlite",
        "--artifacts-destination",
        str(tmp / "artifacts"),  # proxied: clients upload over HTTP, as they would from other machines
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = tmp / "server.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(1.0)
        yield url, tmp
    finally:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue


def test_tracker_round_trip_through_a_server(mlflow_server, tmp_path):
    url, server_tmp = mlflow_server
    tracker = Tracker(url, "remote-round-trip", "mlflow-artifacts:/remote-round-trip")
    run_id = tracker.start_run("round-trip", tags={"stage": "none"})
    tracker.log_params(run_id, {"ppo.kl_coef": 0.05})
    for step in (1, 2):
        tracker.log_metrics(run_id, {"objective/kl": 0.5 * step}, step)
    (tmp_path / "note.txt").write_text("hello")
    tracker.log_artifacts(run_id, tmp_path / "note.txt", "notes")
    tracker.end_run(run_id)

    (record,) = tracker.search_runs()
    assert record.params == {"ppo.kl_coef": "0.05"} and record.status == "FINISHED"
    assert tracker.metric_history(run_id, "objective/kl") == [(1, 0.5), (2, 1.0)]
    # the artifact went through the server into its artifact store
    stored = list((server_tmp / "artifacts").rglob("note.txt"))
    assert [p.read_text() for p in stored] == ["hello"]


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_smoke_pipeline_logs_to_a_tracking_server(mlflow_server, harness, tmp_path):
    from flows.pipeline import rlhf_pipeline

    url, server_tmp = mlflow_server
    config = load_config(
        REPO / "conf" / "smoke.yaml",
        [
            *TINY,
            f"tracking.uri={url}",
            "tracking.experiment=remote-smoke",
            "tracking.artifact_location=mlflow-artifacts:/remote-smoke",
            f"runtime.output_dir={tmp_path}",
        ],
    )
    summary = rlhf_pipeline(config)
    assert summary["tracking_uri"] == url

    tracker = Tracker(url, "remote-smoke")
    (parent,) = tracker.pipeline_runs()
    assert parent.run_id == summary["mlflow_run_id"] and parent.status == "FINISHED"
    assert "eval/kl" in parent.metrics
    (ppo,) = tracker.child_runs(parent.run_id, "train_policy_ppo")
    assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/scores")] == [1, 2]
    # checkpoints were uploaded to the server's artifact store, not written beside the client
    assert list((server_tmp / "artifacts" / "remote-smoke").rglob("model.safetensors"))
