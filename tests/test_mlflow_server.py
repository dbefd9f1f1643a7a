"""Tracking past one machine: a real `mlflow server` (SQLite backend, proxied artifact store) on a free loopback
port, used through rlhf.tracking.client and by the smoke pipeline with ``tracking.uri=http://...``.

About 45 seconds on two cores; deselect with ``pytest -k "not server"``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rlhf.config import load_config
from rlhf.tracking.client import Tracker, prepare_store
from tests.conftest import REPO, free_port, seed_prefect_home
from tests.postgres import postgres_database

pytestmark = pytest.mark.slow  # end-to-end: real servers and processes (deselect with -m "not slow")

BIN = Path(sys.executable).parent
TINY = ["ppo.total_episodes=32", "ppo.batch_size=16", "eval.n_prompts=8", "eval.batch_size=8"]


def start_server(tmp: Path, port: int, store: str | None = None) -> subprocess.Popen:
    """`mlflow server` on `port` over the store in `tmp` (or the database URL `store`), in its own process group;
    returns once it answers."""
    url = f"http://127.0.0.1:{port}"
    if store is None:
        store = f"sqlite:///{tmp}/db.sqlite"
        prepare_store(store)  # as `rlhf ui` does: the server finds a migrated store
    cmd = [
        str(BIN / "mlflow"),
        "server",
        "--backend-store-uri",
        store,
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
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600  # a restart on a busy 2-core machine took over 120 s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            pytest.fail(f"mlflow server did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(1.0)


def stop_server(proc: subprocess.Popen, signals=((signal.SIGTERM, 15), (signal.SIGKILL, 10))) -> None:
    for sig, wait in signals:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """`mlflow server` in its own process group (killed with its workers afterwards); yields (url, temp folder)."""
    tmp = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    proc = start_server(tmp, port)
    try:
        yield f"http://127.0.0.1:{port}", tmp
    finally:
        stop_server(proc)


@pytest.mark.xdist_group("mlflow_server")  # one worker runs the tests of the module's server (one server)
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


@pytest.mark.xdist_group("mlflow_server")
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


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("sqlite", marks=pytest.mark.long),
        pytest.param("postgres", marks=[pytest.mark.xdist_group("postgres"), pytest.mark.team]),
    ],
)
def test_a_server_that_goes_away_mid_run_loses_no_training(tmp_path, shared_prefect_api, backend, request):
    """The tracking server dies while PPO trains: the run fails with PPO's saved state kept; once the server is back,
    the same command resumes PPO from that state in the same MLflow run, every update logged once. On SQLite, and on
    a real PostgreSQL (tests/postgres.py; the store of `rlhf serve`).

    MLflow's client retries a request that finds no server (7 times, exponential backoff: minutes) before the stage
    fails; this test turns those retries off to see the failure at once."""
    port, store = free_port(), tmp_path / "server"
    store.mkdir()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": seed_prefect_home(tmp_path / "prefect"), "PYTHONUNBUFFERED": "1"}
    env |= {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    env["PREFECT_API_URL"] = shared_prefect_api  # Prefect in passing: no temporary server for each attempt
    args = [sys.executable, "-m", "flows.pipeline", "--config", "conf/smoke.yaml", f"tracking.uri={url}"]
    args += [f"runtime.output_dir={tmp_path}/out", "ppo.save_every=1", "tracking.experiment=server-goes-away"]
    args += ["tracking.log_checkpoints=false", f"tracking.artifact_location={tmp_path}/artifacts"]
    ppo_states = tmp_path / "out" / "train_policy_ppo"
    database = None
    if backend == "postgres":
        database = postgres_database(request.getfixturevalue("postgres_server"), f"restart_{os.getpid()}")

    server = start_server(store, port, database)
    with open(tmp_path / "first.log", "w") as log:
        run = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(ppo_states.glob("*/state/trainer_state.pt")):
            assert run.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "PPO never saved a state"
            time.sleep(0.05)
        stop_server(server, ((signal.SIGKILL, 10),))  # the server goes away mid-PPO
        assert run.wait(300) != 0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    (state,) = ppo_states.glob("*/state/trainer_state.pt")  # the training done so far is on disk
    assert not any(ppo_states.glob("*/final/manifest.json"))

    server = start_server(store, port, database)  # back, with the same store
    try:
        rerun = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        tracker = Tracker(url, "server-goes-away")
        ppo_runs = [r for r in tracker.search_runs() if r.tags.get("stage") == "train_policy_ppo"]
        (ppo,) = ppo_runs  # the rerun continued the run of the first attempt
        assert ppo.status == "FINISHED"
        assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/kl")] == [1, 2, 3, 4]
    finally:
        stop_server(server)
