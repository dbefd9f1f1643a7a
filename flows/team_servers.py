"""`rlhf serve`: a team's Prefect server and MLflow tracking server on one PostgreSQL, behind a login.

    export RLHF_SERVE_AUTH=alice:s3cret-team-password      # or --auth-file FILE holding USER:PASSWORD
    export PGPASSWORD=...                                   # or ~/.pgpass, or the whole URL in RLHF_DATABASE_URL
    rlhf serve --database postgresql://rlhf@db.internal:5432/rlhf --artifacts /srv/rlhf/artifacts --host 0.0.0.0

It creates the databases `<name>_prefect`, `<name>_mlflow` and `<name>_mlflow_auth` where they are missing, starts
`prefect server start` (PostgreSQL through asyncpg, the login in PREFECT_SERVER_API_AUTH_STRING) and `mlflow server
--app-name basic-auth` (PostgreSQL through psycopg2, proxying the artifacts to `--artifacts`), deploys prefect.yaml
to the process pool `rlhf-local`, prints what every other machine must export, and waits. Ctrl-C or SIGTERM stops
both servers, each with its own processes, within seconds. Credentials come from the environment or a file, never
from the command line (`ps` shows it); the servers get them through their environment.

A server that dies is started again, alone, after a back-off of 1, 2, 4, 8 and 16 s (the count starts over once it
has stayed up 2 minutes), and each restart is logged; runs ride through the gap on their clients' retries.

What it starts, checked before anything starts: flows/team_plan.py.

Exit codes: 0 stopped by Ctrl-C or SIGTERM; 1 a server died 6 times in a row (its log is named); 2 bad input, one
sentence (an unreachable database, a URL without a driver, wrong credentials, a port in use, a schema of another
Prefect or MLflow version). One person on one machine keeps the embedded SQLite default (`make ui`, `make run`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flows.team_database import EXAMPLE, DatabaseError
from flows.team_plan import AUTH_ENV, LOOPBACK, Plan, ServeError, make_plan, server_commands, server_envs
from rlhf.processes import StopRequest, SupervisedServer, stop_servers
from rlhf.stages import GPU_TAG

# Prefect's setting of the folder that holds task results, the stages' cache (also read as PREFECT_LOCAL_STORAGE_PATH:
# the docs use this name only); without it a worker keeps its own under ~/.prefect/storage and rebuilds shared stages
RESULTS_ENV = "PREFECT_RESULTS_LOCAL_STORAGE_PATH"
POOL = "rlhf-local"
# how long each server may take to answer its health check: Prefect migrates a new database, which took over 180 s on
# the 2-core machine while a training run had both cores
START_S = 600
DEPLOY_S = 900  # each step of the deploy (`prefect deploy --all` took over 300 s on the busy 2-core machine)
STOP_S = 15  # how long the servers may take to stop after SIGTERM (then SIGKILL)
# Prefect's server gives back the slots of expired leases this often (its repossessor service, every 15 s), plus 5 s
REPOSSESS_S = 20.0


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, what: str, stop: StopRequest) -> None:
    """Until `url` answers 200 (or Ctrl-C); a server that exits first, or never answers, is an error naming its log.
    One loop for both servers: MLflow has no `api_healthcheck()`, and Prefect 3.9's would need a client per URL."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and stop.signum is None:
        if proc.poll() is not None:
            raise ServeError(f"the {what} exited with code {proc.returncode} at its start: see {log}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    if stop.signum is None:
        raise ServeError(f"the {what} did not answer {url} within {START_S} s: see {log}")


def check_login(plan: Plan) -> None:
    """The login works on both servers (an MLflow admin created earlier with another password does not)."""
    if plan.login is None:
        return
    auth = (plan.login.user, plan.login.password)
    mlflow = httpx.get(
        f"http://127.0.0.1:{plan.mlflow_port}/api/2.0/mlflow/experiments/search",
        params={"max_results": 1},
        auth=auth,
        timeout=30,
    )
    if mlflow.status_code in (401, 403):
        raise ServeError(
            f"MLflow's login refused user {plan.login.user!r}: its users (in {plan.team.names[2]}) hold another "
            "password for it; give that one, or change it through MLflow's update-password API"
        )
    prefect = httpx.post(f"http://127.0.0.1:{plan.prefect_port}/api/flows/filter", json={}, auth=auth, timeout=30)
    if prefect.status_code in (401, 403):
        raise ServeError(f"the Prefect server refused user {plan.login.user!r}")


def free_orphaned_slots(plan: Plan, recheck_s: float = REPOSSESS_S) -> int:
    """Give back the slots of the `gpu` limit that no lease holds: taken before a restart of a server that kept its
    leases in memory (an earlier `rlhf serve`), they would never be released, and every `gpu` stage would wait for
    good. Returns how many. (Leases now survive a restart: PERSISTENT_LEASES.) A slot whose lease expired while the
    server was down also has no holder until the server's repossessor gives it back: only slots still without a
    holder `recheck_s` later are freed, so no slot is given back twice."""
    api = f"http://127.0.0.1:{plan.prefect_port}/api"
    auth = (plan.login.user, plan.login.password) if plan.login is not None else None

    def orphaned() -> int | None:
        limit = httpx.get(f"{api}/v2/concurrency_limits/tag:{GPU_TAG}", auth=auth, timeout=30)
        if limit.status_code == 404:  # a new server: no limit yet (the deploy step creates it)
            return None
        limit.raise_for_status()
        # the slots first, then their holders: a slot taken in between is counted as held, never freed
        holders = httpx.get(f"{api}/concurrency_limits/tag/{GPU_TAG}", auth=auth, timeout=30)
        holders.raise_for_status()
        return limit.json()["active_slots"] - len(holders.json()["active_slots"])

    if not (first := orphaned()) or first <= 0:
        return 0
    time.sleep(recheck_s)
    count = min(first, orphaned() or 0)
    if count > 0:
        body = {"names": [f"tag:{GPU_TAG}"], "slots": count}
        httpx.post(f"{api}/v2/concurrency_limits/decrement", json=body, auth=auth, timeout=30).raise_for_status()
    return max(count, 0)


def deploy(plan: Plan, client_env: dict[str, str], root: Path) -> None:
    """The process pool, the `gpu` tag limit, every deployment of prefect.yaml, and the automation that marks Crashed
    a flow run whose heartbeats stop (its worker or machine died; flows/crashed_runs.py), on the new server."""
    prefect = str(Path(sys.executable).parent / "prefect")
    log = plan.state / "deploy.log"
    automation = "from flows.crashed_runs import ensure_zombie_automation as ensure; ensure()"
    with open(log, "w") as out:
        for cmd in (
            [prefect, "work-pool", "create", POOL, "--type", "process", "--overwrite"],
            [prefect, "concurrency-limit", "create", GPU_TAG, "1"],
            [prefect, "--no-prompt", "deploy", "--all"],
            [sys.executable, "-c", automation],
        ):
            try:
                done = subprocess.run(
                    cmd, cwd=root, env=client_env, stdout=out, stderr=subprocess.STDOUT, timeout=DEPLOY_S
                )
            except subprocess.TimeoutExpired:
                raise ServeError(f"`{' '.join(cmd[1:])}` did not finish within {DEPLOY_S} s: see {log}") from None
            if done.returncode != 0:
                raise ServeError(f"`{' '.join(cmd[1:])}` failed with exit code {done.returncode}: see {log}")


def exports(plan: Plan) -> str:
    """What every other machine exports (the secrets read from where the user keeps them, never printed)."""
    lines = [
        "On every machine that runs or starts flows (workers, laptops), in the checkout:",
        f"  export PREFECT_API_URL={plan.prefect_api}",
        f"  export MLFLOW_TRACKING_URI={plan.mlflow_url} MLFLOW_UI_URL={plan.mlflow_url}",
        f"  export {RESULTS_ENV}={plan.results}    # the stage cache; elsewhere: this folder on a shared file system",
    ]
    if plan.login is not None:
        lines.append(
            f'  export RLHF_SERVE_AUTH="$(cat {plan.login.file})"    # USER:PASSWORD: elsewhere, a copy (chmod 600)'
            if plan.login.file is not None
            else f"  # set {AUTH_ENV}=USER:PASSWORD as on this machine (in a file or a profile, not on a command line)"
        )
        lines += [
            f'  export PREFECT_API_AUTH_STRING="${AUTH_ENV}"',
            f'  export MLFLOW_TRACKING_USERNAME={plan.login.user} MLFLOW_TRACKING_PASSWORD="${{{AUTH_ENV}#*:}}"',
        ]
    lines += [
        f"  .venv/bin/prefect worker start --pool {POOL}    # where runs should run (make install first)",
        "Runs started there log to this MLflow server (MLFLOW_TRACKING_URI is the default tracking.uri) and share the",
        "stages that another run built (the result store).",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf serve", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2]
    )
    parser.add_argument("--database", default=None, help=f"the team's PostgreSQL ({EXAMPLE}); no password")
    parser.add_argument("--artifacts", default="mlruns/team-artifacts", help="MLflow's artifact store: a folder or URI")
    parser.add_argument("--host", default="127.0.0.1", help="address both servers bind to (0.0.0.0: all)")
    parser.add_argument("--public-host", default=None, help="the name other machines reach this one by")
    parser.add_argument("--prefect-port", type=int, default=4200)
    parser.add_argument("--mlflow-port", type=int, default=5000)
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        help="more names the MLflow server answers to, comma-separated (it answers its own and loopback's)",
    )
    parser.add_argument("--auth-file", default=None, help=f"a file holding USER:PASSWORD (or set {AUTH_ENV})")
    parser.add_argument("--state", default=".serve", help="logs and the Prefect home of the servers")
    parser.add_argument(
        "--results",
        default=str(Path(__file__).resolve().parent.parent / ".prefect" / "storage"),
        help=f"the stage cache that workers and `rlhf` commands share ({RESULTS_ENV}; default: the one `rlhf` commands "
        "in this checkout use)",
    )
    parser.add_argument("--no-deploy", action="store_true", help="do not deploy prefect.yaml")
    return parser


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    args = build_parser().parse_args(argv)
    root = root or Path(__file__).resolve().parent.parent
    try:
        plan = make_plan(args)
    except (ServeError, DatabaseError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if plan.login is None and plan.host not in LOOPBACK:
        print(f"warning: no login: anyone who reaches {plan.host} can start runs and read every artifact", flush=True)
    (plan.state / "prefect").mkdir(parents=True, exist_ok=True)
    plan.results.mkdir(parents=True, exist_ok=True)
    return run(plan, root, deploy_yaml=not args.no_deploy)


def run(plan: Plan, root: Path, deploy_yaml: bool = True) -> int:
    """Start both servers, check the login, deploy prefect.yaml, print the exports, and keep both up until Ctrl-C or
    SIGTERM: one that dies is started again alone, after a back-off (RESTART_BACKOFF_S), while the other serves on;
    after repeated deaths it gives up. Both servers are stopped in every case."""
    prefect_env, mlflow_env, client_env = server_envs(plan, root)
    commands = server_commands(plan)
    logs = (plan.state / "prefect-server.log", plan.state / "mlflow-server.log")
    prefect = SupervisedServer("the Prefect server", commands[0], prefect_env, logs[0])
    mlflow = SupervisedServer("the MLflow server", commands[1], mlflow_env, logs[1])
    servers = [prefect, mlflow]
    stop = StopRequest("the Prefect and MLflow servers")
    try:
        for server in servers:
            server.start()
        wait_healthy(
            f"http://127.0.0.1:{plan.prefect_port}/api/health", prefect.proc, prefect.log, "Prefect server", stop
        )
        wait_healthy(f"http://127.0.0.1:{plan.mlflow_port}/health", mlflow.proc, mlflow.log, "MLflow server", stop)
        if stop.signum is not None:
            return 0
        check_login(plan)
        if freed := free_orphaned_slots(plan):
            print(f"freed {freed} slot(s) of the '{GPU_TAG}' limit that no task held (taken before a restart)")
        if deploy_yaml:
            deploy(plan, client_env, root)
        print(f"Prefect: {plan.prefect_api.removesuffix('/api')}  (database {plan.team.names[0]}; log {logs[0]})")
        print(f"MLflow:  {plan.mlflow_url}  (database {plan.team.names[1]}; artifacts {plan.artifacts}; log {logs[1]})")
        print(exports(plan))
        print("ready; Ctrl-C stops both servers", flush=True)
        while stop.signum is None:
            for server in servers:
                given_up = server.keep_up(lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", flush=True))
                if given_up is not None:
                    print(f"error: {given_up}", file=sys.stderr)
                    return 1
            stop.wait(1.0)
        return 0
    except ServeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        with stop.ignored():
            stop_servers([server.proc for server in servers if server.proc is not None], STOP_S)
        (plan.state / "mlflow-auth.ini").unlink(missing_ok=True)
