"""`rlhf serve` (flows/team_servers.py) against a real PostgreSQL started by the tests (tests/postgres.py): bad input
as one sentence and exit code 2; the login refusing clients without or with wrong credentials on both servers;
prefect.yaml deployed; the smoke pipeline through both servers, its flow run and task states in PostgreSQL; and
SIGTERM stopping both servers with nothing left running. Skipped where PostgreSQL is not installed (the skip names
what to install). One xdist worker runs the module (one PostgreSQL and one `rlhf serve` for all of it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.server.concurrency.lease_storage.filesystem import ConcurrencyLeaseStorage
from prefect.server.utilities.leasing import ResourceLease
from prefect.settings import (
    PREFECT_API_AUTH_STRING,
    PREFECT_API_URL,
    PREFECT_RESULTS_LOCAL_STORAGE_PATH,
    temporary_settings,
)

import tests.test_process_faults as faults
from flows.crashed_runs import ZOMBIE_AFTER_S
from flows.summary import TRACKING_URI_FROM
from flows.sweep import rlhf_sweep
from flows.team_database import migration_revisions, parse_database
from flows.team_plan import Login, Plan, read_login, server_commands
from flows.team_servers import REPOSSESS_S, RESULTS_ENV, build_parser, exports, free_orphaned_slots
from flows.team_servers import main as serve_main
from rlhf.config import load_config
from rlhf.config.sections import TRACKING_URI_ENV
from rlhf.sweeps.space import parse_space
from rlhf.tracking.client import Tracker
from tests.conftest import REPO, drain_prefect_services, free_port, seed_prefect_home
from tests.postgres import postgres_database
from tests.test_ui_server import PIPELINE_FULL, TINY, start, stop, wait_until

pytestmark = pytest.mark.xdist_group("postgres")
psycopg2 = pytest.importorskip("psycopg2", reason="the team extra is not installed: pip install -e '.[team]'")

LOGIN = ("alice", "team-password-123")
BIN = Path(sys.executable).parent
RLHF = str(BIN / "rlhf")


def serve_error(capsys, argv: list[str]) -> str:
    """`rlhf serve argv` in this process: exit code 2 and one line on stderr, returned."""
    assert serve_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "url, expected",
    [
        ("db.internal/rlhf", "names no driver"),
        ("mysql://u@db.internal/rlhf", "needs PostgreSQL"),
        ("postgresql://u:secret@db.internal/rlhf", "would show in `ps`"),
    ],
)
def test_a_database_url_that_cannot_serve_is_one_sentence(capsys, url, expected):
    assert expected in serve_error(capsys, ["--database", url])


def test_an_unreachable_database_is_one_sentence_without_a_traceback():
    port = free_port()  # nothing listens there
    done = subprocess.run(
        [RLHF, "serve", "--database", f"postgresql://rlhf@127.0.0.1:{port}/rlhf"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == done.stderr.strip().splitlines()[0], done.stderr
    assert f"no PostgreSQL server answered at 127.0.0.1:{port}" in done.stderr


def test_wrong_database_credentials_are_one_sentence(postgres_server, capsys, monkeypatch):
    monkeypatch.setenv("PGPASSWORD", "not-the-password")
    assert "wrong or missing password" in serve_error(capsys, ["--database", postgres_server.url])


def test_a_port_in_use_is_one_sentence(postgres_server, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PGPASSWORD", postgres_server.env["PGPASSWORD"])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = serve_error(capsys, ["--database", postgres_server.url, "--prefect-port", str(port)])
    assert f"port {port} on 127.0.0.1 is in use" in err and "--prefect-port" in err


def test_a_login_file_without_a_password_is_one_sentence(postgres_server, capsys, tmp_path):
    (tmp_path / "login").write_text("alice\n")
    err = serve_error(capsys, ["--database", postgres_server.url, "--auth-file", str(tmp_path / "login")])
    assert "must hold one line USER:PASSWORD" in err


def older_mlflow_revision() -> str:
    """A revision of the installed MLflow's migrations that is not its head: a database an older MLflow wrote."""
    known, heads = migration_revisions("mlflow", "store/db_migrations/versions")
    assert len(heads) == 1 and len(known) > 10, heads
    return sorted(known - heads)[0]


@pytest.mark.parametrize(
    "database, revision, expected",
    [
        ("mlflow", "ffffffffffff", "holds the schema of another mlflow version than the installed"),
        ("prefect", "ffffffffffff", "holds the schema of another prefect version than the installed"),
        ("mlflow", older_mlflow_revision(), "holds an older MLflow's schema"),
    ],
)
def test_a_database_of_another_version_is_refused(postgres_server, capsys, monkeypatch, database, revision, expected):
    """An Alembic revision the installed MLflow or Prefect does not know (a server of another version uses the
    database), or an MLflow schema older than the installed one (named with the command that upgrades it)."""
    monkeypatch.setenv("PGPASSWORD", postgres_server.env["PGPASSWORD"])
    base = f"{database}_{revision[:6]}"  # a server of its own for each case: `<base>_prefect`, `<base>_mlflow`
    conn = psycopg2.connect(postgres_database(postgres_server, f"{base}_{database}").replace("+psycopg2", ""))
    conn.autocommit = True
    with conn.cursor() as cursor:
        cursor.execute("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
        cursor.execute("INSERT INTO alembic_version VALUES (%s)", (revision,))
    conn.close()
    err = serve_error(capsys, ["--database", postgres_server.url_for(base)])
    assert f"the database {base}_{database} on " in err and expected in err and revision in err, err
    if "older" in expected:
        assert f"mlflow db upgrade postgresql://postgres@127.0.0.1:{postgres_server.port}/{base}_mlflow" in err, err


def test_the_printed_exports_run_as_they_are_in_a_shell(tmp_path):
    """What `rlhf serve` prints for the other machines is pasted into a shell as it is: with the login read from
    the auth file, both servers' credentials are set, and no line holds the password."""
    login_file = tmp_path / "login"
    login_file.write_text(":".join(LOGIN) + "\n")
    plan = Plan(
        parse_database("postgresql://rlhf@db.internal/rlhf", True),
        read_login(str(login_file)),
        "0.0.0.0",
        "rlhf.internal",
        4200,
        5000,
        "/srv/artifacts",
        tmp_path,
        Path("/srv/rlhf/results"),
    )
    text = exports(plan)
    assert LOGIN[1] not in text
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("export ")]
    script = "\n".join([*lines, "env"])
    done = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert env["PREFECT_API_URL"] == "http://rlhf.internal:4200/api"
    assert env["PREFECT_API_AUTH_STRING"] == ":".join(LOGIN)
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == LOGIN
    assert env["MLFLOW_TRACKING_URI"] == "http://rlhf.internal:5000"  # the default tracking.uri of the runs there
    assert env[RESULTS_ENV] == "/srv/rlhf/results"  # the stage cache, under Prefect's one name for it
    assert "PREFECT_LOCAL_STORAGE_PATH" not in text and "tracking.uri=" not in text


def test_the_mlflow_server_answers_the_names_it_is_served_on_and_no_wildcard(tmp_path):
    """MLflow's check of the Host header (against DNS rebinding) stays on: the public name, the bound address,
    loopback and the names given with --allowed-hosts, each bare and with the port; never `*`."""
    args = build_parser().parse_args(["--host", "10.0.0.5", "--public-host", "rlhf.internal", "--mlflow-port", "5000"])
    args.allowed_hosts = "mlflow.team.example, 192.168.1.9"
    plan = Plan(
        parse_database("postgresql://rlhf@db.internal/rlhf", True),
        None,
        args.host,
        args.public_host,
        4200,
        args.mlflow_port,
        "/srv/artifacts",
        tmp_path,
        tmp_path / "results",
        tuple(name.strip() for name in args.allowed_hosts.split(",")),
    )
    (_, mlflow) = server_commands(plan)
    hosts = mlflow[mlflow.index("--allowed-hosts") + 1].split(",")
    assert not any("*" in host for host in hosts), hosts
    for name in ("rlhf.internal", "10.0.0.5", "127.0.0.1", "localhost", "[::1]", "mlflow.team.example", "192.168.1.9"):
        assert {name, f"{name}:5000"} <= set(hosts), (name, hosts)


# -- the servers ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def team(postgres_server, tmp_path_factory) -> Iterator[dict]:
    """`rlhf serve` on the test PostgreSQL (database `team_*`), behind LOGIN, prefect.yaml deployed; yields the
    serve process, the URLs, the client environment and the folders. The last test of the module stops it."""
    tmp = tmp_path_factory.mktemp("team")
    prefect_port, mlflow_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "MLFLOW_TRACKING_"))}
    env |= postgres_server.env | {"RLHF_SERVE_AUTH": ":".join(LOGIN), "PREFECT_HOME": seed_prefect_home(tmp / "home")}
    args = [RLHF, "serve", "--database", postgres_server.url_for("team"), "--state", str(tmp)]
    args += ["--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]
    args += ["--artifacts", str(tmp / "artifacts"), "--results", str(tmp / "results")]
    log = tmp / "serve.log"
    serve = start_serve(args, env, log)
    team = {"serve": serve, "log": log, "args": args, "serve_env": env}
    try:
        client = {k: v for k, v in env.items() if k != "RLHF_SERVE_AUTH"}
        client |= {
            "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
            "PREFECT_API_AUTH_STRING": ":".join(LOGIN),
        }
        client |= {"MLFLOW_TRACKING_USERNAME": LOGIN[0], "MLFLOW_TRACKING_PASSWORD": LOGIN[1]}
        team |= {
            "api": client["PREFECT_API_URL"],
            "mlflow": f"http://127.0.0.1:{mlflow_port}",
            "env": client,
            "tmp": tmp,
            "database": postgres_server.url_for("team_prefect"),
            "pgpassword": postgres_server.env["PGPASSWORD"],
            "servers": [p.pid for p in psutil.Process(serve.pid).children(recursive=True)],
        }
        yield team
    finally:
        if team["serve"].poll() is None:
            team["serve"].send_signal(signal.SIGTERM)
            team["serve"].wait(60)


def start_serve(args: list[str], env: dict[str, str], log: Path, ready: bool = True) -> subprocess.Popen:
    """`rlhf serve args`, its output in `log`; with `ready`, once it printed that it is ready."""
    serve = subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    if ready:
        wait_until(lambda: "ready;" in log.read_text(), 900, "rlhf serve's start", serve, log)
    return serve


@pytest.mark.slow
def test_both_servers_refuse_clients_without_or_with_wrong_credentials(team):
    """Also after the right login was let in: MLflow's server trusts a checked login for a while (AUTH_CACHE_S),
    never another password."""
    mlflow = f"{team['mlflow']}/api/2.0/mlflow/experiments/search"
    prefect = f"{team['api']}/flows/filter"
    for auth, expected in (
        (None, 401),
        (LOGIN, 200),
        (("alice", "wrong-password-123"), 401),
        (("mallory", LOGIN[1]), 401),
        (LOGIN, 200),
        (("alice", LOGIN[1] + "x"), 401),
    ):
        for _ in range(2):  # the server's two workers
            assert httpx.get(mlflow, params={"max_results": 1}, auth=auth, timeout=30).status_code == expected, auth
            assert httpx.post(prefect, json={}, auth=auth, timeout=30).status_code == expected, auth
    # MLflow's check against DNS rebinding is on: a name the server is not served on is refused
    rebound = httpx.get(mlflow, params={"max_results": 1}, auth=LOGIN, headers={"Host": "rebind.example"}, timeout=30)
    assert rebound.status_code in (400, 403), rebound.status_code
    # prefect.yaml is deployed to the process pool that workers start on
    deployment = httpx.get(f"{team['api']}/deployments/name/rlhf-run/run-pipeline", auth=LOGIN, timeout=30).json()
    assert deployment["work_pool_name"] == "rlhf-local"
    # the exports every other machine needs, without the password
    out = team["log"].read_text()
    assert f"export PREFECT_API_URL={team['api']}" in out and LOGIN[1] not in out


@pytest.mark.slow
def test_the_smoke_pipeline_runs_through_both_servers_into_postgres(team, tmp_path, monkeypatch):
    """Every stage's run, metrics, artifacts and the logged model reach MLflow; the flow run and its task states are
    rows of the Prefect database in PostgreSQL."""
    args = [sys.executable, "-m", "flows.pipeline", "--config", "conf/smoke.yaml", *TINY]
    args += [f"tracking.uri={team['mlflow']}", "tracking.artifact_location=mlflow-artifacts:/team-smoke"]
    args += ["tracking.experiment=team-smoke", f"runtime.output_dir={tmp_path}/out"]
    done = subprocess.run(args, cwd=REPO, env=team["env"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", LOGIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", LOGIN[1])
    tracker = Tracker(team["mlflow"], "team-smoke")
    (parent,) = tracker.pipeline_runs()
    assert parent.status == "FINISHED" and "eval/kl" in parent.metrics
    stages = {run.tags["stage"]: run for run in tracker.child_runs(parent.run_id)}
    assert {"prepare_preferences", "supervised_finetune", "train_reward_model", "train_policy_ppo"} <= set(stages)
    assert all(run.status == "FINISHED" for run in stages.values())
    ppo = stages["train_policy_ppo"]
    assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/scores")] == [1, 2]
    artifacts = team["tmp"] / "artifacts" / "team-smoke"
    assert list(artifacts.rglob("model.safetensors"))  # checkpoints through the server's proxy
    assert list(artifacts.rglob("MLmodel"))  # the logged transformers model of the PPO run

    flow_run_id = parent.tags["prefect.flow_run_id"]
    conn = psycopg2.connect(team["database"], password=team["pgpassword"])
    with conn, conn.cursor() as cursor:
        cursor.execute("SELECT state_type FROM flow_run WHERE id = %s", (flow_run_id,))
        assert cursor.fetchone() == ("COMPLETED",)
        cursor.execute("SELECT name, state_type FROM task_run WHERE flow_run_id = %s", (flow_run_id,))
        states = {name.rsplit("-", 1)[0]: state for name, state in cursor.fetchall()}
    conn.close()
    assert set(stages) <= set(states) and set(states.values()) == {"COMPLETED"}, states


@pytest.mark.slow
@pytest.mark.team
def test_a_sweep_on_two_workers_lands_every_variant_exactly_once(team, tmp_path, monkeypatch):
    """4 variants, `max_concurrency: 2`, as flow runs of the deployed pipeline picked up by two process workers:
    every variant's PPO and evaluation run is in MLflow once, with every PPO step once; nothing is left RUNNING."""
    storage = tmp_path / "results"  # Prefect's result store (the stage cache): shared by the sweep and the workers
    env = team["env"] | {RESULTS_ENV: str(storage), "PYTHONPATH": str(REPO)}
    prefect = str(Path(sys.executable).parent / "prefect")
    workers = []
    try:
        for name in ("w1", "w2"):
            log = tmp_path / f"{name}.log"
            workers.append(
                (name, start([prefect, "worker", "start", "--pool", "rlhf-local", "--limit", "1"], env, log))
            )
            wait_until(lambda log=log: "started!" in log.read_text(errors="replace"), 120, f"{name} start", None, log)
        tracking = [f"tracking.uri={team['mlflow']}", "tracking.artifact_location=mlflow-artifacts:/team-sweep"]
        tracking += ["tracking.experiment=team-sweep", f"runtime.output_dir={tmp_path}/out"]
        base = load_config(REPO / "conf" / "smoke.yaml", [*TINY, *tracking])
        space = {"name": "team", "deployment": "rlhf-pipeline/run-pipeline-every-setting", "max_concurrency": 2}
        space = parse_space(space | {"parameters": {"ppo.kl_coef": [0.02, 0.05, 0.1, 0.2]}})
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", LOGIN[0])
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", LOGIN[1])
        login = {PREFECT_API_URL: team["api"], PREFECT_API_AUTH_STRING: ":".join(LOGIN)}
        with temporary_settings(updates=login | {PREFECT_RESULTS_LOCAL_STORAGE_PATH: storage}):
            try:
                table = rlhf_sweep(base, space)["ranking"]
            finally:
                drain_prefect_services()
    finally:
        for _, proc in workers:
            stop(proc)
    assert sorted(row["status"] for row in table) == ["completed"] * 4, table
    tracker = Tracker(team["mlflow"], "team-sweep")
    variants = [run for run in tracker.pipeline_runs() if run.tags.get("sweep.name") == "team"]
    assert sorted(run.params["ppo.kl_coef"] for run in variants) == ["0.02", "0.05", "0.1", "0.2"]
    for variant in variants:
        stages = [run.tags["stage"] for run in tracker.child_runs(variant.run_id)]
        assert stages.count("train_policy_ppo") == 1 and stages.count("evaluate_policies") == 1, stages
        (ppo,) = tracker.child_runs(variant.run_id, "train_policy_ppo")
        assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/kl")] == [1, 2]
    assert [run.name for run in tracker.search_runs() if run.status == "RUNNING"] == []
    assert len(list((team["tmp"] / "artifacts" / "team-sweep").rglob("rollout_samples.json"))) == 4


@pytest.mark.slow
@pytest.mark.team
def test_a_run_killed_mid_ppo_is_crashed_on_the_shared_server_and_the_rerun_names_it(team, tmp_path, monkeypatch):
    """SIGKILL to the process running a pipeline (and its group) mid-PPO: the rerun on this machine marks its flow
    run Crashed on the shared server (a row of PostgreSQL), resumes PPO in the same MLflow run, every update logged
    once, and names the crashed run in its tags."""
    for key, value in team["env"].items():
        if key.startswith(("PREFECT_API_", "MLFLOW_TRACKING_")):
            monkeypatch.setenv(key, value)
    extra = (*TINY, f"tracking.uri={team['mlflow']}", "tracking.artifact_location=mlflow-artifacts:/team-kill")
    extra += ("tracking.experiment=team-kill",)
    proc, _ = faults.start(tmp_path, name="killed", extra=extra)
    faults.kill_when(proc, lambda: faults.saved_state(tmp_path, "train_policy_ppo"))
    output = faults.finish(*faults.start(tmp_path, name="rerun", extra=extra))

    conn = psycopg2.connect(team["database"], password=team["pgpassword"])
    with conn, conn.cursor() as cursor:
        cursor.execute(
            "SELECT r.name, r.state_type, s.message, r.tags FROM flow_run r JOIN flow_run_state s ON s.id = r.state_id"
            " WHERE r.labels->>'rlhf.process' LIKE %s",
            (f"%:{proc.pid}:%",),
        )
        ((name, state, message, _),) = cursor.fetchall()
        cursor.execute("SELECT state_type, tags FROM flow_run WHERE tags @> %s::jsonb", (f'["resumed-from:{name}"]',))
        rerun = cursor.fetchall()
    conn.close()
    assert state == "CRASHED" and f"pid {proc.pid} on" in message, (state, message)
    assert f"flow run {name} marked Crashed" in output
    assert [row[0] for row in rerun] == ["COMPLETED"]
    tracker = Tracker(team["mlflow"], "team-kill")
    (ppo,) = [run for run in tracker.search_runs() if run.tags.get("stage") == "train_policy_ppo"]
    assert ppo.status == "FINISHED"
    assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/kl")] == [1, 2]


def printed_worker_script(team: dict) -> str:
    """The lines `rlhf serve` printed for other machines, as they are (the venv's `prefect` named by its path), ending
    with the worker it prints: what a team member pastes into a shell."""
    printed = team["log"].read_text().split("On every machine that runs or starts flows", 1)[1].splitlines()
    lines = [line.strip() for line in printed if line.strip().startswith(("export ", ".venv/bin/prefect worker"))]
    assert lines[-1].startswith(".venv/bin/prefect worker start --pool rlhf-local"), lines
    lines[-1] = "exec " + lines[-1].replace(".venv/bin/", f"{Path(sys.executable).parent}/", 1)
    return "\n".join(lines)


def printed_worker_env(team: dict) -> dict[str, str]:
    """A team member's shell before the printed lines: the login in RLHF_SERVE_AUTH (as `rlhf serve` says), no
    Prefect, MLflow or result settings of its own."""
    env = {
        k: v for k, v in team["env"].items() if not k.startswith(("PREFECT_API_", "MLFLOW_TRACKING_", "PREFECT_RES"))
    }
    return env | {"RLHF_SERVE_AUTH": ":".join(LOGIN)}


def ppo_saved(out: Path) -> bool:
    """PPO saved a state, anywhere under `out` (a sweep's variants have folders of their own)."""
    return any(out.rglob("train_policy_ppo/*/state/trainer_state.pt"))


def kill_tree(pid: int) -> None:
    """SIGKILL to a process and every process under it (a worker and its flow runs: groups of their own)."""
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for process in tree:
        process.kill()
    psutil.wait_procs(tree, timeout=30)


def kill_at_ppo(pid: int, out: Path) -> None:
    """`kill_tree(pid)` as soon as PPO saved a state under `out` (or after 300 s)."""
    deadline = time.monotonic() + 300
    while not ppo_saved(out) and time.monotonic() < deadline:
        time.sleep(0.02)
    kill_tree(pid)


@pytest.mark.slow
def runs_a_flow_run(worker: subprocess.Popen) -> bool:
    """Whether a process of a flow run (Prefect's engine) is still among the worker's descendants."""
    try:
        children = psutil.Process(worker.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    for child in children:
        try:
            if "prefect.engine" in " ".join(child.cmdline()):
                return True
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return False


@pytest.mark.team
def test_a_worker_killed_mid_ppo_leaves_a_run_the_server_marks_crashed_and_the_rerun_names_it(
    team, tmp_path, monkeypatch
):
    """A `prefect worker` and the flow run it started, killed together with SIGKILL mid-PPO (its machine lost): with no
    other run's help, the server's automation marks the flow run Crashed once its heartbeats stop (prefect.yaml gives
    a worker's runs one every HEARTBEAT_S); a rerun of the deployment on a new worker resumes PPO in the same MLflow
    run, every update once, names the crashed run, and marks its task runs Crashed."""
    overrides = [*TINY, "ppo.save_every=1", "reward.save_every=1", f"runtime.output_dir={tmp_path}/out"]
    config = load_config(REPO / "conf" / "smoke.yaml", [*overrides, "tracking.experiment=team-worker"])
    # as prefect.yaml's deployment holds it: no tracking.uri, no artifact location (the worker's environment decides)
    parameters = {"config": config.model_dump(mode="json", exclude={"tracking": {"uri", "artifact_location"}})}

    def worker(name: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        proc = start(["bash", "-euc", printed_worker_script(team)], printed_worker_env(team), log)
        wait_until(lambda: "started!" in log.read_text(errors="replace"), 120, f"{name} start", proc, log)
        return proc, log

    login = {PREFECT_API_URL: team["api"], PREFECT_API_AUTH_STRING: ":".join(LOGIN)}
    with temporary_settings(updates=login), get_client(sync_client=True) as client:
        first, log = worker("w1")
        try:
            killed = run_deployment(PIPELINE_FULL, parameters=parameters, timeout=0)
            faults.kill_when(first, lambda: ppo_saved(tmp_path / "out"), stop=False)
            assert runs_a_flow_run(first)
            kill_tree(first.pid)  # the worker and its flow run's process (a process group of its own)
        finally:
            stop(first)
        assert client.read_flow_run(killed.id).state_type == StateType.RUNNING

        def crashed():
            run = client.read_flow_run(killed.id)
            return run if run.state_type == StateType.CRASHED else None

        marked = wait_until(crashed, ZOMBIE_AFTER_S + 180, "the automation marking the killed run Crashed", None, log)
        assert f"no heartbeat for {ZOMBIE_AFTER_S} s" in marked.state.message, marked.state.message

        second, log = worker("w2")
        try:
            rerun = run_deployment(PIPELINE_FULL, parameters=parameters, timeout=600)
            # the way docs/scaling.md gives to stop a worker, once its runs have ended (their processes too): SIGTERM
            # to the worker alone, and a second one where it is still up 30 s later (Prefect 3.9's worker at times
            # stays up after the first even when idle; on the second its command kills its worker process at once)
            wait_until(lambda: not runs_a_flow_run(second), 120, "the rerun's process to exit", second, log)
            second.send_signal(signal.SIGTERM)
            try:
                second.wait(30)
            except subprocess.TimeoutExpired:
                second.send_signal(signal.SIGTERM)
                second.wait(30)
            assert "Received SIGTERM" in log.read_text(errors="replace")
        finally:
            stop(second)
        rerun = client.read_flow_run(rerun.id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[killed.id])))
    assert rerun.state_type == StateType.COMPLETED, (rerun.state, log.read_text()[-3000:])
    assert f"resumed-from:{killed.name}" in rerun.tags, rerun.tags
    assert {task.state_type for task in tasks} <= {StateType.COMPLETED, StateType.CRASHED}, tasks
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", LOGIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", LOGIN[1])
    tracker = Tracker(team["mlflow"], "team-worker")
    (ppo,) = [run for run in tracker.search_runs() if run.tags.get("stage") == "train_policy_ppo"]
    assert ppo.status == "FINISHED"
    assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/kl")] == [1, 2]
    (pipeline,) = [run for run in tracker.pipeline_runs() if run.status == "FINISHED"]
    assert pipeline.tags["rlhf.resumed_from_flow_run_name"] == killed.name
    # the store came from the printed MLFLOW_TRACKING_URI, and the run says so; its artifacts are the server's
    assert (pipeline.params["tracking.uri"], pipeline.tags[TRACKING_URI_FROM]) == (team["mlflow"], TRACKING_URI_ENV)
    assert list((team["tmp"] / "artifacts").rglob("rollout_samples.json"))
    assert [p.name for p in (team["tmp"] / "results").iterdir()], "the workers' results are in the printed store"


@pytest.mark.slow
@pytest.mark.team
def test_a_sweep_whose_worker_dies_records_the_variant_failed_and_the_sweep_rerun_resumes_it(
    team, tmp_path, monkeypatch
):
    """A sweep whose variant runs on a worker, and that worker killed with its flow run mid-PPO: the sweep gets the
    variant's Crashed state from the server's automation (its heartbeats stopped) and ends, its one variant failed,
    where it used to wait for good; the same sweep run again, with a new worker, resumes the variant's PPO."""
    storage = tmp_path / "results"
    env = team["env"] | {RESULTS_ENV: str(storage), "PYTHONPATH": str(REPO)}
    tracking = [f"tracking.uri={team['mlflow']}", "tracking.artifact_location=mlflow-artifacts:/team-dead-worker"]
    tracking += ["tracking.experiment=team-dead-worker", f"runtime.output_dir={tmp_path}/out"]
    base = load_config(REPO / "conf" / "smoke.yaml", [*TINY, "ppo.save_every=1", "reward.save_every=1", *tracking])
    space = {"name": "dead-worker", "deployment": PIPELINE_FULL, "max_concurrency": 1}
    space = parse_space(space | {"parameters": {"ppo.kl_coef": [0.05]}})
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", LOGIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", LOGIN[1])
    prefect = str(Path(sys.executable).parent / "prefect")
    login = {PREFECT_API_URL: team["api"], PREFECT_API_AUTH_STRING: ":".join(LOGIN)}
    with (
        temporary_settings(updates=login | {PREFECT_RESULTS_LOCAL_STORAGE_PATH: storage}),
        get_client(sync_client=True) as client,
    ):
        for attempt in ("killed", "rerun"):
            log = tmp_path / f"worker-{attempt}.log"
            worker = start([prefect, "worker", "start", "--pool", "rlhf-local"], env, log)
            wait_until(lambda log=log: "started!" in log.read_text(errors="replace"), 120, "worker start", worker, log)
            try:
                if attempt == "killed":
                    killer = threading.Thread(target=kill_at_ppo, args=(worker.pid, tmp_path / "out"), daemon=True)
                    killer.start()
                    with pytest.raises(RuntimeError, match="every variant of sweep 'dead-worker' failed"):
                        rlhf_sweep(base, space)
                    killer.join(330)
                    crashed = client.read_flow_runs(
                        flow_run_filter=FlowRunFilter(
                            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CRASHED]))
                        )
                    )
                else:
                    (row,) = rlhf_sweep(base, space)["ranking"]
            finally:
                stop(worker)
                drain_prefect_services()
    experiment = [run.parameters.get("config", {}).get("tracking", {}).get("experiment") for run in crashed]
    (variant,) = [run for run, name in zip(crashed, experiment, strict=True) if name == "team-dead-worker"]
    assert f"no heartbeat for {ZOMBIE_AFTER_S} s" in variant.state.message, variant.state.message
    assert row["status"] == "completed", row
    tracker = Tracker(team["mlflow"], "team-dead-worker")
    (ppo,) = [run for run in tracker.search_runs() if run.tags.get("stage") == "train_policy_ppo"]
    assert ppo.status == "FINISHED"
    assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/kl")] == [1, 2]


def gpu_slots(team: dict) -> tuple[int, list[str]]:
    """The `gpu` limit's taken slots, and the task runs whose leases hold them (what `prefect concurrency-limit
    inspect gpu` lists)."""
    taken = httpx.get(f"{team['api']}/v2/concurrency_limits/tag:gpu", auth=LOGIN, timeout=30).json()["active_slots"]
    holders = httpx.get(f"{team['api']}/concurrency_limits/tag/gpu", auth=LOGIN, timeout=30).json()["active_slots"]
    return taken, holders


def held_lease(team: dict, holder: str) -> ResourceLease:
    """The lease by which task run `holder` holds its `gpu` slot, as `rlhf serve`'s Prefect server stored it: on disk,
    in Prefect's file-backed lease storage under the server's PREFECT_HOME (PERSISTENT_LEASES), where a restarted
    server reads it. Prefect's memory storage (the default) leaves nothing there."""
    storage = ConcurrencyLeaseStorage(team["tmp"] / "prefect" / "concurrency_leases")

    async def read() -> list[ResourceLease]:
        leases = [await storage.read_lease(lease_id) for lease_id in await storage.read_active_lease_ids()]
        return [lease for lease in leases if lease and lease.metadata and lease.metadata.holder]

    leases = asyncio.run(read())
    (lease,) = [lease for lease in leases if str(lease.metadata.holder.id) == holder]
    return lease


@pytest.mark.slow
@pytest.mark.team
def test_a_restart_of_rlhf_serve_while_a_gpu_stage_runs_leaves_no_slot_held(team, tmp_path, monkeypatch):
    """`rlhf serve` stopped (SIGTERM) and started again with the same command while PPO, a `gpu` stage, holds the
    limit's one slot (its process paused across the restart: it holds the slot throughout and renews its lease no
    more). The lease is on disk before the restart, and the restarted server acts on it: while it lasts, PPO is the
    slot's holder; once it has expired (Prefect's task engine takes a 60 s lease, renewed every 45 s, and a restart on
    2 busy cores takes about 2 minutes), the server's repossessor gives the slot back and revokes the lease. Either
    way PPO ends, the evaluation (a `gpu` stage too) starts, the run completes, no slot is left taken, and `rlhf serve`
    frees nothing. With leases kept in memory (Prefect's default) the restarted server had lost the lease: the slot
    stayed taken with no holder and the evaluation waited for good (now `rlhf serve` would free it and say so)."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "flows.pipeline", "--config", "conf/smoke.yaml", *TINY, "ppo.save_every=1"]
    args += [f"runtime.output_dir={out}", "tracking.experiment=team-restart"]
    log = tmp_path / "pipeline.log"
    run = start(args, team["env"] | {"MLFLOW_TRACKING_URI": team["mlflow"]}, log)
    try:
        wait_until(lambda: ppo_saved(out), 300, "PPO's first saved state", run, log)
        os.killpg(run.pid, signal.SIGSTOP)  # PPO holds the slot until it is let go on
        try:
            taken, (holder,) = gpu_slots(team)
            assert taken == 1
            lease = held_lease(team, holder)
            team["serve"].send_signal(signal.SIGTERM)
            assert team["serve"].wait(60) == 0
            team["log"] = team["tmp"] / "serve-restarted.log"
            team["serve"] = start_serve(team["args"], team["serve_env"], team["log"], ready=False)
            health = f"{team['api']}/health"
            wait_until(
                lambda: httpx.get(health, timeout=5).status_code == 200, 900, "restart", team["serve"], team["log"]
            )
            if datetime.now(timezone.utc) < lease.expiration - timedelta(seconds=5):  # the lease lasts: PPO holds it
                assert gpu_slots(team) == (1, [holder])
            else:  # expired while the server was down: the restarted server gives the slot back itself
                wait_until(
                    lambda: gpu_slots(team) == (0, []),
                    REPOSSESS_S + 40,
                    "the expired lease's slot given back",
                    team["serve"],
                    team["log"],
                )
                storage = ConcurrencyLeaseStorage(team["tmp"] / "prefect" / "concurrency_leases")
                assert asyncio.run(storage.read_lease(lease.id)) is None, "the lease was revoked"
        finally:
            os.killpg(run.pid, signal.SIGCONT)
        wait_until(lambda: "ready;" in team["log"].read_text(), 900, "rlhf serve's restart", team["serve"], team["log"])
        team["servers"] = [p.pid for p in psutil.Process(team["serve"].pid).children(recursive=True)]
        assert run.wait(600) == 0, log.read_text()[-3000:]
    finally:
        stop(run)
    assert "freed" not in team["log"].read_text()  # nothing was orphaned
    assert gpu_slots(team) == (0, [])
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", LOGIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", LOGIN[1])
    tracker = Tracker(team["mlflow"], "team-restart")
    stages = {run.tags.get("stage"): run.status for run in tracker.search_runs()}
    assert stages["evaluate_policies"] == stages["train_policy_ppo"] == "FINISHED", stages


def server_pid(team: dict, name: str) -> int:
    """The pid of `rlhf serve`'s `prefect server` or `mlflow server` process (a child of its own session)."""
    (pid,) = [  # by the script's name: its folder is the venv's as the launcher resolved it (a linked venv differs)
        p.pid
        for p in psutil.Process(team["serve"].pid).children()
        if [Path(p.cmdline()[1]).name, p.cmdline()[2]] == [name, "server"]
    ]
    return pid


@pytest.mark.slow
@pytest.mark.team
def test_the_mlflow_server_killed_mid_ppo_is_started_again_alone_and_the_run_loses_nothing(team, tmp_path, monkeypatch):
    """SIGKILL to the MLflow server's processes while PPO trains: `rlhf serve` logs it and starts it again after its
    back-off, the Prefect server serving on (the same process throughout); the run rides through on MLflow's retries
    and completes, every PPO update logged once."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "flows.pipeline", "--config", "conf/smoke.yaml", *TINY, "ppo.save_every=1"]
    args += [f"runtime.output_dir={out}", "tracking.experiment=team-mlflow-killed"]
    log = tmp_path / "pipeline.log"
    prefect, mlflow = server_pid(team, "prefect"), server_pid(team, "mlflow")
    run = start(args, team["env"] | {"MLFLOW_TRACKING_URI": team["mlflow"]}, log)
    try:
        wait_until(lambda: ppo_saved(out), 300, "PPO's first saved state", run, log)
        os.killpg(mlflow, signal.SIGKILL)  # the server and its uvicorn workers
        assert run.wait(600) == 0, log.read_text()[-3000:]
    finally:
        stop(run)
    said = team["log"].read_text()
    assert "the MLflow server stopped with exit code -9" in said and "the MLflow server started again" in said, said
    assert "the Prefect server stopped" not in said and team["serve"].poll() is None
    assert server_pid(team, "prefect") == prefect and server_pid(team, "mlflow") != mlflow
    team["servers"] = [p.pid for p in psutil.Process(team["serve"].pid).children(recursive=True)]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", LOGIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", LOGIN[1])
    tracker = Tracker(team["mlflow"], "team-mlflow-killed")
    (ppo,) = [run for run in tracker.search_runs() if run.tags.get("stage") == "train_policy_ppo"]
    assert ppo.status == "FINISHED"
    assert [step for step, _ in tracker.metric_history(ppo.run_id, "objective/kl")] == [1, 2]
    (pipeline,) = tracker.pipeline_runs()
    assert pipeline.status == "FINISHED"


@pytest.mark.slow
def test_an_orphaned_gpu_slot_is_freed_when_rlhf_serve_starts(team):
    """A slot of the `gpu` limit that no lease holds (left by a restart of a server that kept its leases in memory, as
    `rlhf serve` did before) is given back by `free_orphaned_slots`, which `rlhf serve` runs at its start (a held one
    is not: the restart test above)."""
    plan = Plan(
        parse_database("postgresql://rlhf@127.0.0.1/team", True),
        Login(*LOGIN),
        "127.0.0.1",
        "127.0.0.1",
        int(team["api"].rsplit(":", 1)[1].split("/")[0]),
        int(team["mlflow"].rsplit(":", 1)[1]),
        str(team["tmp"] / "artifacts"),
        team["tmp"],
        team["tmp"] / "results",
    )
    assert gpu_slots(team) == (0, [])
    assert free_orphaned_slots(plan, recheck_s=1) == 0
    update = httpx.patch(f"{team['api']}/v2/concurrency_limits/tag:gpu", json={"active_slots": 1}, auth=LOGIN)
    assert update.status_code == 204, update.text
    assert gpu_slots(team) == (1, [])
    assert free_orphaned_slots(plan, recheck_s=1) == 1
    assert gpu_slots(team) == (0, [])


@pytest.mark.slow
def test_sigterm_stops_both_servers_with_nothing_left_running(team):
    """Last in the module: a service manager's SIGTERM to `rlhf serve` alone stops both servers and their workers."""
    serve, servers = team["serve"], team["servers"]
    assert servers and all(psutil.pid_exists(pid) for pid in servers)
    serve.send_signal(signal.SIGTERM)
    assert serve.wait(60) == 0, team["log"].read_text()[-3000:]
    alive = [pid for pid in servers if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert alive == []
    for url in (team["mlflow"] + "/health", team["api"] + "/health"):
        with pytest.raises(httpx.TransportError):
            httpx.get(url, timeout=5)
