"""What `rlhf serve` starts, checked before anything starts (flows/team_servers.py runs it): the login, the ports, the
team's databases and their schema versions (`make_plan`), and each server's command line and environment, every URL
and secret in the environment, none on a command line."""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from flows.prefect_home import PERSISTENT_LEASES
from flows.team_database import EXAMPLE, TeamDatabases, check_schema_versions, create_databases, parse_database

AUTH_ENV, DATABASE_ENV = "RLHF_SERVE_AUTH", "RLHF_DATABASE_URL"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# MLflow's login checks a password with scrypt on every request (about 0.3 s of a core on the 2-core machine): a
# checked login is trusted for this long in each server worker (a changed password takes up to this long to apply)
AUTH_CACHE_S = 60


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
