"""The Prefect UI path: a real `prefect server`, the deployments of flows/serve.py and of prefect.yaml, and
pipeline runs triggered through the API, executed by the serve process, watched to completion (process-pool workers
running them: tests/test_sweep_parallel.py).

Starts subprocesses on free loopback ports (always killed afterwards). About a minute on two cores;
deselect with ``pytest -k "not server"``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient

from flows import HEARTBEAT_S
from flows.form import PipelineRun, SweepRun, form_parameters, sweep_form_parameters
from rlhf.config import PipelineConfig, load_config
from rlhf.sweeps.space import load_space
from tests.conftest import REPO, free_port, seed_prefect_home

# end-to-end: real servers and processes (deselect with -m "not slow"); one xdist worker runs the module, whose
# tests share one Prefect server
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ui_server")]

BIN = Path(sys.executable).parent
TINY = ["ppo.total_episodes=32", "ppo.batch_size=16", "eval.n_prompts=8", "eval.batch_size=8"]
MLFLOW_UI_URL = "http://127.0.0.1:5999"
# the every-setting deployments of the pipeline and the sweep (flow name / deployment name)
PIPELINE_FULL, SWEEP_FULL = "rlhf-pipeline/run-pipeline-every-setting", "rlhf-sweep/run-sweep-every-setting"


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A subprocess in its own process group (so stop() ends its children too), output to a log file."""
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def request(method: str, url: str, **kwargs) -> httpx.Response:
    """One API call, retried as Prefect's own client retries: on 429/502/503 (the server answers 503 while its
    SQLite database is busy, which happens on two cores while the serve process and the server's background
    services write) and on connection errors, for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            response = httpx.request(method, url, timeout=10, **kwargs)
            if response.status_code not in (429, 502, 503) or time.monotonic() > deadline:
                return response
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def wait_until(check, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll `check()` until it returns a truthy value; fail with the log's tail on timeout or a dead process."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(1.0)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    pytest.fail(f"{what} did not happen within {timeout:.0f}s (process exit code {proc and proc.poll()}):\n{tail}")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory) -> Iterator[tuple[str, dict[str, str], Path]]:
    """`make ui`'s Prefect server (flows/prefect_server.py: `prefect server start` with the schema checked once and
    busy requests retried) on a free port with its own PREFECT_HOME; yields (api url, env, temp folder)."""
    tmp = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {
        "PREFECT_HOME": seed_prefect_home(tmp / "home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_UI_URL": MLFLOW_UI_URL,
    }
    log = tmp / "server.log"
    proc = start([sys.executable, "-m", "flows.prefect_server", "--host", "127.0.0.1", "--port", str(port)], env, log)
    try:
        wait_until(lambda: httpx.get(f"{api}/health", timeout=5).status_code == 200, 120, "server start", proc, log)
        yield api, env, tmp
    finally:
        stop(proc)


SUBMITS = 12  # form submits while a run trains


def submit_later(api: str, deployment_id: str, run: dict) -> tuple[int, str]:
    """The run form's Submit (its parameters, Prefect's schema validation), once, not retried: a flow run scheduled
    a day ahead, so that no runner starts it. Returns (status code, flow-run id or the answer's text)."""
    when = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
    body = {"parameters": {"run": run}, "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": when}}}
    created = httpx.post(f"{api}/deployments/{deployment_id}/create_flow_run", json=body, timeout=120)
    return created.status_code, created.json()["id"] if created.status_code == 201 else created.text


def _training(api: str, flow_run_id: str, stage: str = "sft") -> bool:
    """The flow run's `stage` has logged a training step ('sft step 100 of 1000: ...')."""
    found = request("POST", f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}}).json()
    return any(log["message"].startswith(f"{stage} step ") for log in found)


def trigger_tiny_run(
    api: str, deployment_id: str, folder: Path, later: bool = False
) -> tuple[str, PipelineConfig, str]:
    """Create a flow run of a pipeline deployment with a tiny config writing under `folder` (as the UI's form
    would); `later`: scheduled a day ahead, so that no runner starts it. Returns (MLflow URI, config, flow-run id)."""
    uri = f"sqlite:///{folder}/mlflow.db"
    config = load_config(
        REPO / "conf" / "smoke.yaml",
        [*TINY, f"tracking.uri={uri}", f"tracking.artifact_location={folder}/art", f"runtime.output_dir={folder}/out"],
    )
    body: dict = {"parameters": {"config": config.model_dump(mode="json")}}
    if later:
        when = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
        body["state"] = {"type": "SCHEDULED", "state_details": {"scheduled_time": when}}
    created = request("POST", f"{api}/deployments/{deployment_id}/create_flow_run", json=body)
    assert created.status_code == 201, created.text
    return uri, config, created.json()["id"]


def _flow_run_state(api: str, flow_run_id: str) -> dict | None:
    state = request("GET", f"{api}/flow_runs/{flow_run_id}").json()["state"]
    return state if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None


@pytest.mark.long
def test_served_pipeline_deployment_runs_from_the_api(prefect_server):
    api, env, tmp = prefect_server
    log = tmp / "serve.log"
    serve = start(
        [sys.executable, "-m", "flows.serve", "--config", "conf/smoke.yaml", "--sweep-cron", "0 2 * * *"], env, log
    )
    try:
        deployment = wait_until(
            lambda: (r := request("GET", f"{api}/deployments/name/{PIPELINE_FULL}")).status_code == 200 and r.json(),
            120,
            "the pipeline deployment",
            serve,
            log,
        )
        # the form: typed, documented fields with conf/smoke.yaml's values as defaults
        assert deployment["parameters"]["config"] == load_config(REPO / "conf" / "smoke.yaml").model_dump(mode="json")
        definitions = deployment["parameter_openapi_schema"]["definitions"]
        assert definitions["PPOConfig"]["properties"]["kl_coef"]["description"]
        sweep_form = wait_until(  # serve registers the deployments one after the other
            lambda: (
                (r := request("GET", f"{api}/deployments/name/rlhf-sweep-run/run-sweep")).status_code == 200
                and r.json()
            ),
            60,
            "the sweep form deployment",
            serve,
            log,
        )
        assert [s["schedule"]["cron"] for s in sweep_form["schedules"]] == ["0 2 * * *"]
        # the sweep's short form: its base as the run form takes it, a drop-down of conf/sweeps/, space overrides
        assert sweep_form["parameters"] == sweep_form_parameters("conf/smoke.yaml", "conf/sweeps/kl_coef.yaml")
        definitions = sweep_form["parameter_openapi_schema"]["definitions"]
        assert set(definitions["SweepRun"]["properties"]) == {"base", "space_file", "space_path", "space_overrides"}
        assert "conf/sweeps/ppo_optuna.yaml" in definitions["SweepRun"]["properties"]["space_file"]["enum"]
        assert "conf/smoke.yaml" in definitions["PipelineRun"]["properties"]["config_file"]["enum"]
        sweep = wait_until(
            lambda: (r := request("GET", f"{api}/deployments/name/{SWEEP_FULL}")).status_code == 200 and r.json(),
            60,
            "the every-setting sweep deployment",
            serve,
            log,
        )
        assert sweep["schedules"] == []
        # the search space as typed fields: a row per parameter (values, or a range), trials, concurrency
        (row,) = sweep["parameters"]["space"]["parameters"]
        assert (row["key"], row["values"], row["low"]) == ("ppo.kl_coef", [0.01, 0.05, 0.2], None)
        space_schema = sweep["parameter_openapi_schema"]["definitions"]
        assert set(space_schema["SearchParameter"]["properties"]) == {"key", "values", "low", "high", "log", "integer"}
        assert {"method", "trials", "max_concurrency", "optuna"} <= set(space_schema["SweepSpace"]["properties"])
        limit = request("GET", f"{api}/concurrency_limits/tag/gpu").json()
        assert limit["concurrency_limit"] == 1

        # the short form: a drop-down of the shipped configs (this one preselected) and a list of overrides
        form = wait_until(
            lambda: (
                (r := request("GET", f"{api}/deployments/name/rlhf-run/run-pipeline")).status_code == 200 and r.json()
            ),
            60,
            "the form deployment",
            serve,
            log,
        )
        assert form["parameters"]["run"] == form_parameters("conf/smoke.yaml")["run"]
        run_schema = form["parameter_openapi_schema"]["definitions"]["PipelineRun"]["properties"]
        assert {"conf/default.yaml", "conf/smoke.yaml", "conf/examples/hh-rlhf.yaml"} <= set(
            run_schema["config_file"]["enum"]
        )

        # a run as the UI's "Run" button creates it, with a tiny config writing to temp folders: accepted with its
        # typed config, scheduled a day ahead (the same deployment's runs are executed by process workers in
        # tests/test_sweep_parallel.py; the serve process executes the short form's run below)
        _, config, later_id = trigger_tiny_run(api, deployment["id"], tmp / "served", later=True)
        later = request("GET", f"{api}/flow_runs/{later_id}").json()
        assert PipelineConfig.model_validate(later["parameters"]["config"]) == config
        # ... and one from the short form: a shipped config and two overrides (plus the temp folders)
        folder = tmp / "form"
        form_uri = f"sqlite:///{folder}/mlflow.db"
        where = [
            f"tracking.uri={form_uri}",
            f"tracking.artifact_location={folder}/art",
            f"runtime.output_dir={folder}/out",
        ]
        sizes = {"ppo_total_episodes": 32, "ppo_batch_size": 16}  # the typed fields of the form
        # SFT long enough (seconds, on any machine) that the submits below overlap it, once its first step is logged
        longer = ["sft.steps=1000", "ppo.kl_coef=0.1", "seed=1"]
        run = {"config_file": "conf/smoke.yaml", **sizes, "overrides": [*TINY[2:], *where, *longer]}
        created = request("POST", f"{api}/deployments/{form['id']}/create_flow_run", json={"parameters": {"run": run}})
        assert created.status_code == 201, created.text
        form_run_id = created.json()["id"]

        # what the server's schema validation refuses: a config that is not shipped, an override without '='
        for bad in ({"config_file": "conf/nope.yaml"}, {"config_file": "conf/smoke.yaml", "overrides": ["seed"]}):
            refused = request(
                "POST", f"{api}/deployments/{form['id']}/create_flow_run", json={"parameters": {"run": bad}}
            )
            assert refused.status_code in (409, 422), (bad, refused.status_code, refused.text)
        # a cross-field rule: refused by the server's schema validation, before a flow run exists
        bad = {"config_file": "conf/smoke.yaml", "ppo_num_mini_batches": 3}
        refused = request("POST", f"{api}/deployments/{form['id']}/create_flow_run", json={"parameters": {"run": bad}})
        assert refused.status_code == 409 and "ppo_num_mini_batches" in refused.text, refused.text
        form_runs = request("POST", f"{api}/flow_runs/filter", json={"deployments": {"id": {"any_": [form["id"]]}}})
        assert [r["id"] for r in form_runs.json()] == [form_run_id]

        # Submit while that run trains: the form's call, sent once each (no retry here), is accepted every time
        wait_until(lambda: _training(api, form_run_id), 300, "a training step of the form's run", serve, log)
        submitted = [submit_later(api, form["id"], run)]
        # the first submit came back while that run trained (the later ones may outlast it on a fast machine)
        still = request("GET", f"{api}/flow_runs/{form_run_id}").json()["state"]["type"]
        submitted += [submit_later(api, form["id"], run) for _ in range(SUBMITS - 1)]
        assert [code for code, _ in submitted] == [201] * SUBMITS, submitted
        assert still == "RUNNING", f"the submits were meant to overlap the training run, which is {still}"
        for _, flow_run_id in submitted:
            request("DELETE", f"{api}/flow_runs/{flow_run_id}")

        state = wait_until(lambda: _flow_run_state(api, form_run_id), 300, "the form's flow run", serve, log)
        assert state["type"] == "COMPLETED", (state, log.read_text(errors="replace")[-3000:])
    finally:
        stop(serve)

    form_client = MlflowClient(form_uri)
    (form_parent,) = [
        r
        for r in form_client.search_runs([form_client.get_experiment_by_name(config.tracking.experiment).experiment_id])
        if "stage" not in r.data.tags
    ]
    assert form_parent.data.params["ppo.kl_coef"] == "0.1" and form_parent.data.params["seed"] == "1"
    assert form_parent.data.tags["prefect.flow_run_id"] == form_run_id

    assert request("GET", f"{api}/flow_runs/{later_id}").json()["state"]["type"] == "SCHEDULED"
    artifacts = request(
        "POST", f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [form_run_id]}}}
    ).json()
    progress = {a["description"].split(":")[0]: a for a in artifacts if a["type"] == "progress"}
    assert set(progress) == {"RLHF pipeline", "sft", "reward", "PPO"}  # the stages, and each trainer's steps
    assert all(a["data"] == 100.0 for a in progress.values())
    assert progress["RLHF pipeline"]["description"] == "RLHF pipeline: evaluation done (6/6), finished"
    assert progress["PPO"]["description"].startswith("PPO: step 2 of 2; score ")
    assert "KL " in progress["PPO"]["description"]
    by_key = {a["key"]: a for a in artifacts if a["key"]}
    table = json.loads(by_key["rlhf-evaluation-figures"]["data"])
    assert {"eval/kl", "reward/best_eval_accuracy"} <= {row["metric"] for row in table}
    # the short table links the full one on the server's UI
    assert f"/artifacts/artifact/{by_key['rlhf-evaluation-figures']['id']})" in by_key["rlhf-evaluation"]["data"]

    experiment = form_client.get_experiment_by_name(config.tracking.experiment)
    link = f"{MLFLOW_UI_URL}/#/experiments/{experiment.experiment_id}/runs/{form_parent.info.run_id}"
    link += "?workflowType=machine_learning"
    assert link in by_key["rlhf-mlflow-run"]["data"]


def test_prefect_yaml_deploys_every_deployment_to_its_process_pool(prefect_server):
    """`prefect deploy --all` from the checkout: every deployment of prefect.yaml on the `rlhf-local` process pool,
    with its entrypoint and schedule. (Process workers running the pipeline deployment's flow runs:
    tests/test_sweep_parallel.py, whose variants are flow runs of this deployment picked up by two workers.)"""
    api, env, tmp = prefect_server
    pool = request("POST", f"{api}/work_pools/", json={"name": "rlhf-local", "type": "process"})
    assert pool.status_code == 201, pool.text
    done = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", "deploy", "--all"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nightly = request("GET", f"{api}/deployments/name/rlhf-sweep-run/sweep-nightly").json()
    assert nightly["work_pool_name"] == "rlhf-local"
    assert [(s["schedule"]["cron"], s["active"]) for s in nightly["schedules"]] == [("0 2 * * *", True)]
    for name, entrypoint in (("rlhf-sweep-run/run-sweep", "rlhf_sweep_run"), ("rlhf-run/run-pipeline", "rlhf_run")):
        deployment = request("GET", f"{api}/deployments/name/{name}").json()
        assert deployment["entrypoint"] == f"flows/form.py:{entrypoint}"
        assert deployment["work_pool_name"] == "rlhf-local"
    pipeline = request("GET", f"{api}/deployments/name/rlhf-pipeline/run-pipeline-every-setting").json()
    assert pipeline["entrypoint"] == "flows/pipeline.py:rlhf_pipeline"
    assert pipeline["work_pool_name"] == "rlhf-local"
    # the pipeline's parameters are conf/default.yaml's (test_prefect_yaml_parameters_match_the_conf_files)
    assert PipelineConfig.model_validate(pipeline["parameters"]["config"]) == load_config(
        REPO / "conf" / "default.yaml"
    )


def test_prefect_yaml_parameters_match_the_conf_files():
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    flows = {"flows/form.py:rlhf_run": "rlhf-run", "flows/pipeline.py:rlhf_pipeline": "rlhf-pipeline"}
    flows |= {"flows/form.py:rlhf_sweep_run": "rlhf-sweep-run"}
    deployments = {f"{flows[d['entrypoint']]}/{d['name']}": d for d in spec["deployments"]}
    assert set(deployments) == {
        "rlhf-run/run-pipeline",
        "rlhf-pipeline/run-pipeline-every-setting",
        "rlhf-sweep-run/run-sweep",
        "rlhf-sweep-run/sweep-nightly",
    }
    default = load_config(REPO / "conf" / "default.yaml")
    assert PipelineConfig.model_validate(deployments[PIPELINE_FULL]["parameters"]["config"]) == default
    assert PipelineRun.model_validate(deployments["rlhf-run/run-pipeline"]["parameters"]["run"]).config() == default
    space = load_space(REPO / "conf" / "sweeps" / "kl_coef.yaml")
    for name in ("rlhf-sweep-run/run-sweep", "rlhf-sweep-run/sweep-nightly"):
        sweep = SweepRun.model_validate(deployments[name]["parameters"]["run"])
        assert (sweep.base.config(), sweep.space()) == (default, space), name
    # every deployment's flow runs send the heartbeats that the zombie automation watches (flows/crashed_runs.py)
    for name, deployment in deployments.items():
        env = deployment["work_pool"]["job_variables"]["env"]
        assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(HEARTBEAT_S), name
