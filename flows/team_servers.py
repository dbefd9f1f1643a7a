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

Exit codes: 0 stopped by Ctrl-C or SIGTERM; 1 a server died 6 times in a row (its log is named); 2 bad input, one
sentence (an unreachable database, a URL without a driver, wrong credentials, a port in use, a schema of another
Prefect or MLflow version). One person on one machine keeps the embedded SQLite default (`make ui`, `make run`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from flows.prefect_home import PERSISTENT_LEASES
from flows.team_database import (
    EXAMPLE,
    DatabaseError,
    TeamDatabases,
    check_schema_versions,
    create_databases,
    parse_database,
)
from rlhf.processes import StopRequest, SupervisedServer, stop_servers
from rlhf.stages import GPU_TAG

AUTH_ENV, DATABASE_ENV = "RLHF_SERVE_AUTH", "RLHF_DATABASE_URL"
# Prefect's setting of the folder that holds task results, the stages' cache (also read as PREFECT_LOCAL_STORAGE_PATH:
# the docs use this name only); without it a worker keeps its own under ~/.prefect/storage and rebuilds shared stages
RESULTS_ENV = "PREFECT_RESULTS_LOCAL_STORAGE_PATH"
POOL = "rlhf-local"
# how long each server may take to answer its health check: Prefect migrates a new database, which took over 180 s on
# the 2-core machine while a training run had both cores
START_S = 600
DEPLOY_S = 900  # each step of the deploy (`prefect deploy --all` took over 300 s on the busy 2-core machine)
STOP_S = 15  # how long the servers may take to stop after SIGTERM (then SIGKILL)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# MLflow's login checks a password with scrypt on every request (about 0.3 s of a core on the 2-core machine): a
# checked login is trusted for this long in each server worker (a changed password takes up to this long to apply)
AUTH_CACHE_S = 60
# Prefect's server gives back the slots of expired leases this often (its repossessor service, every 15 s), plus 5 s
REPOSSESS_S = 20.0


class ServeError(Exception):
    """Bad input to `rlhf serve`: one sentence, exit code 2."""


@dataclass(frozen=True)
class Login:
    user: str
    password: str
    file: Path | None = None  # the --auth-file it was read from (None: RLHF_SERVE_AUTH)


@dataclass(frozen=True)
class Plan:
    """What `rlhf serve` starts, checked before anything starts."""

    team: TeamDatabases
    login: Login | None
    host: str
    public: str  # the address the other machines use
    prefect_port: int
    mlflow_port: int
    artifacts: str
    state: Path
    results: Path  # Prefect's result store (the stage cache) that every worker and `rlhf` command of the team shares
    extra_hosts: tuple[str, ...] = ()  # other names the MLflow server answers to (--allowed-hosts)

    @property
    def prefect_api(self) -> str:
        return f"http://{self.public}:{self.prefect_port}/api"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.public}:{self.mlflow_port}"


def read_login(auth_file: str | None) -> Login | None:
    """The login, from `--auth-file` (one line USER:PASSWORD) or RLHF_SERVE_AUTH; None where neither is given."""
    if auth_file is not None:
        path = Path(auth_file)
        if not path.is_file():
            raise ServeError(f"the auth file {auth_file} does not exist: write USER:PASSWORD into it (chmod 600)")
        text, where = path.read_text().strip(), f"the auth file {auth_file}"
    elif os.environ.get(AUTH_ENV):
        text, where = os.environ[AUTH_ENV].strip(), AUTH_ENV
    else:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password or "\n" in text:
        raise ServeError(f"{where} must hold one line USER:PASSWORD")
    if len(password) < 12:  # MLflow's basic-auth app refuses shorter passwords
        raise ServeError(f"the password in {where} has {len(password)} characters; MLflow's login needs 12 or more")
    return Login(user, password, Path(auth_file).resolve() if auth_file is not None else None)


def check_port(host: str, port: int, option: str) -> None:
    """Refuse a port another process holds, before any server starts."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ServeError(f"port {port} on {host} is in use or not available ({err.strerror}): {option}") from None


def make_plan(args: argparse.Namespace) -> Plan:
    """Every check that needs no server: the URL, the login, the ports, the database and its schema versions."""
    text = args.database or os.environ.get(DATABASE_ENV)
    if not text:
        raise ServeError(f"give the team's PostgreSQL with --database {EXAMPLE} (or {DATABASE_ENV})")
    team = parse_database(text, from_command_line=bool(args.database))
    login = read_login(args.auth_file)
    if args.prefect_port == args.mlflow_port:
        raise ServeError(f"--prefect-port and --mlflow-port are both {args.mlflow_port}: give them different ports")
    check_port(args.host, args.prefect_port, "pick another with --prefect-port")
    check_port(args.host, args.mlflow_port, "pick another with --mlflow-port")
    create_databases(team)
    check_schema_versions(team)
    public = args.public_host or (socket.getfqdn() if args.host in ("0.0.0.0", "::") else args.host)
    results = Path(args.results).resolve()
    return Plan(
        team,
        login,
        args.host,
        public,
        args.prefect_port,
        args.mlflow_port,
        args.artifacts,
        Path(args.state).resolve(),
        results,
        tuple(name.strip() for name in (args.allowed_hosts or "").split(",") if name.strip()),
    )


def server_envs(plan: Plan, root: Path) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The environments of the Prefect server, of the MLflow server and of a client (the deploy step): every URL
    and secret goes through them, none through a command line."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "MLFLOW_TRACKING_"))}
    paths = [str(root), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    base["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))  # the deploy step imports the flows
    base["PREFECT_HOME"] = str(plan.state / "prefect")
    prefect = {**base, "PREFECT_SERVER_DATABASE_CONNECTION_URL": plan.team.prefect_url, **PERSISTENT_LEASES}
    prefect["PREFECT_UI_API_URL"] = plan.prefect_api
    mlflow = {**base, "MLFLOW_BACKEND_STORE_URI": plan.team.mlflow_url, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    client = {**base, "PREFECT_API_URL": f"http://127.0.0.1:{plan.prefect_port}/api"}
    if plan.login is not None:
        prefect["PREFECT_SERVER_API_AUTH_STRING"] = f"{plan.login.user}:{plan.login.password}"
        client["PREFECT_API_AUTH_STRING"] = prefect["PREFECT_SERVER_API_AUTH_STRING"]
        mlflow["MLFLOW_AUTH_CONFIG_PATH"] = str(write_auth_config(plan))
        # the key of the login's CSRF tokens, one for the server's workers: new at each start unless the user set one
        mlflow.setdefault("MLFLOW_FLASK_SERVER_SECRET_KEY", secrets.token_hex(32))
        mlflow["MLFLOW_AUTH_ADMIN_USERNAME"] = plan.login.user
        mlflow["MLFLOW_AUTH_ADMIN_PASSWORD"] = plan.login.password
    return prefect, mlflow, client


def write_auth_config(plan: Plan) -> Path:
    """MLflow's basic-auth settings (its users in the `_mlflow_auth` database; the admin from the environment),
    readable by this user alone (the URL may hold the database's password)."""
    path = plan.state / "mlflow-auth.ini"
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = {plan.team.mlflow_auth_url}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        f"auth_cache_ttl_seconds = {AUTH_CACHE_S}\n"
    )
    return path


def allowed_hosts(plan: Plan) -> list[str]:
    """The Host headers the MLflow server answers (MLflow's check against DNS rebinding): the names it is served on,
    loopback, and those the user named, each bare and with the port. No wildcard: `*` would switch the check off."""
    names = [plan.public, *([] if plan.host in ("0.0.0.0", "::") else [plan.host]), *LOOPBACK, *plan.extra_hosts]
    if plan.host in ("0.0.0.0", "::"):
        names.append(socket.gethostname())
    names = [f"[{name}]" if ":" in name else name for name in dict.fromkeys(names)]  # IPv6 as a Host header has it
    return [host for name in names for host in (name, f"{name}:{plan.mlflow_port}")]


def server_commands(plan: Plan) -> tuple[list[str], list[str]]:
    bindir = Path(sys.executable).parent
    prefect = [str(bindir / "prefect"), "server", "start", "--host", plan.host, "--port", str(plan.prefect_port)]
    mlflow = [str(bindir / "mlflow"), "server", "--host", plan.host, "--port", str(plan.mlflow_port)]
    mlflow += ["--artifacts-destination", plan.artifacts, "--workers", "2"]
    mlflow += ["--allowed-hosts", ",".join(allowed_hosts(plan))]
    if plan.login is not None:
        mlflow += ["--app-name", "basic-auth"]
    return prefect, mlflow


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
