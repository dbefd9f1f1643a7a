"""The ``rlhf`` command: one entry point for the pipeline, sweeps, the UIs, comparisons and the benchmark.

    rlhf run [--config conf/default.yaml] [key.sub=value ...]     the whole pipeline (make run)
    rlhf sweep --space conf/sweeps/kl_coef.yaml [--config ...] [key.sub=value ...]   every variant, ranked
    rlhf ui [--host 127.0.0.1] [--config ...] [--sweep-space ...] [--sweep-cron CRON]   the UIs (make ui)
    rlhf serve --database postgresql://USER@HOST/NAME [--host 0.0.0.0] [--auth-file FILE]   a team's servers
    rlhf compare [--experiment rlhf-ppo] [--sweep NAME] ...      runs side by side, plots in outputs/compare
    rlhf bench [--shape cpu] [--updates 10] ...                  PPO throughput on a fixed shape (docs/benchmark.md)
    rlhf memory [--config ...] [--gpu-gb 24 80]                  per-stage memory estimate, before anything is loaded
    rlhf docs [--write]                                          the config reference (docs/config.md)

The installed ``rlhf`` script is a launcher (rlhf/launcher.py) that finds the checkout and runs this file;
``python -m flows.cli`` from the root of a checkout is the same command. ``run``, ``sweep`` and ``ui`` use the Prefect
flows beside this file, which are not installed as packages of their own (see pyproject.toml). As ``make``
does, the command turns hub downloads off unless ``HF_HUB_OFFLINE=0`` is set, keeps Prefect's state in ``.prefect/``
of the current folder (``PREFECT_HOME``) and Prefect's analytics off. Exit codes are those of the subcommand. ``run``
and ``sweep`` (flows/terminal.py): 0 finished; 1 an unexpected failure (with its traceback); 2 bad input (the config,
the data, a model folder, the environment), explained in one sentence; 3 a loss or gradient norm became NaN or
infinite (NonFiniteError; the last saved state is kept); 4 the disk filled up while a checkpoint was written; 5 the
MLflow tracking server stopped answering mid-run; 130 / 143 stopped by Ctrl-C / SIGTERM (the finished stages and the
last saved state are kept, the MLflow runs end KILLED). The others: 0 on success, 2 for a user error.

This module imports no Prefect, torch or MLflow: each subcommand imports what it runs (heavy: seconds of torch,
transformers, Prefect and MLflow imports), so that ``rlhf --help`` and a subcommand's usage error are instant.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from flows.prefect_home import PERSISTENT_LEASES
from rlhf.processes import StopRequest, stop_group, stop_servers

# The environment `make` exports (Makefile); values already set win.
DEFAULT_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


def set_default_env() -> None:
    """The Makefile's environment, where the caller has not set it (before transformers or Prefect is imported)."""
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("HF_DATASETS_OFFLINE", os.environ["HF_HUB_OFFLINE"])
    os.environ.setdefault("PREFECT_HOME", str(Path.cwd() / ".prefect"))


# The checkout's root: flows/ and tasks/ import from it (they are folders of the checkout, not installed packages).
ROOT = Path(__file__).resolve().parent.parent


def pythonpath_with(root: Path) -> str:
    """``PYTHONPATH`` with the checkout root first, for subprocesses that import the flows (Prefect's flow runs)."""
    parts = [str(root), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return os.pathsep.join(dict.fromkeys(parts))


def sqlite_store() -> str:
    """The MLflow store of ``make run`` in the current folder, as the Makefile names it."""
    return f"sqlite:///{Path.cwd() / 'mlruns' / 'mlflow.db'}"


# Each subcommand: (help line, main(argv) -> exit code). The delegated mains parse their own options, so that
# `rlhf run --help` shows exactly the options of `python -m flows.pipeline`.


def cmd_run(argv: list[str]) -> int:
    from flows.pipeline_command import main  # heavy: the pipeline's checks (each subcommand imports what it runs)

    return main(argv)


def cmd_sweep(argv: list[str]) -> int:
    from flows.sweep_command import main  # heavy: the sweep's checks

    return main(argv)


def cmd_serve(argv: list[str]) -> int:
    from flows.team_servers import main  # heavy: Prefect's client, SQLAlchemy, MLflow

    return main(argv)


def cmd_compare(argv: list[str]) -> int:
    from rlhf.sweeps.compare import main  # heavy: MLflow, pandas, matplotlib

    if not any(a == "--tracking-uri" or a.startswith("--tracking-uri=") for a in argv):
        argv = ["--tracking-uri", sqlite_store(), *argv]
    return main(argv)


def cmd_bench(argv: list[str]) -> int:
    from benchmarks import main  # heavy: torch, transformers

    return main(argv)


def cmd_memory(argv: list[str]) -> int:
    from rlhf.memory.report import main  # heavy: pydantic config models, transformers' config classes

    return main(argv)


def cmd_docs(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlhf docs",
        description="Print the config reference, or write the generated parts of the docs: the config reference "
        "(docs/config.md) and the metric tables (docs/metrics.md) (make docs).",
    )
    parser.add_argument("--write", action="store_true", help="update the generated parts between the pages' markers")
    parser.add_argument("--page", default="docs/config.md", help="the config reference's page")
    parser.add_argument("--metrics-page", default="docs/metrics.md", help="the metrics' page")
    args = parser.parse_args(argv)
    from rlhf.config.docs import reference_markdown, update_reference  # heavy: pydantic config models
    from rlhf.metrics import update_metrics_page

    if not args.write:
        print(reference_markdown())
        return 0
    for page, update in ((args.page, update_reference), (args.metrics_page, update_metrics_page)):
        if not Path(page).is_file():
            print(f"error: {page} does not exist; run this from the root of a checkout", file=sys.stderr)
            return 2
        try:
            changed = update(page)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"{page} updated" if changed else f"{page} already current")
    return 0


def cmd_ui(argv: list[str]) -> int:
    """The Prefect server and UI, the MLflow UI, and the pipeline and sweep deployments served from this folder."""
    parser = argparse.ArgumentParser(
        prog="rlhf ui",
        description=(
            "Start the Prefect server and UI, the MLflow UI (store: mlruns/mlflow.db of the current folder), and "
            "serve the pipeline and sweep deployments (flows/serve.py): run them from the Prefect UI's forms. "
            "Ctrl-C or SIGTERM (a terminal or a service manager) stops all: the serve process first (it pauses its "
            "schedules through the running server), then the servers, each within seconds (SIGKILL after a bounded "
            "wait). This is `make ui`."
        ),
    )
    parser.add_argument("--host", default="127.0.0.1", help="address the servers bind to (0.0.0.0: all)")
    parser.add_argument("--prefect-port", type=int, default=4200)
    parser.add_argument("--mlflow-port", type=int, default=5000)
    parser.add_argument("--config", default="conf/default.yaml", help="defaults of the pipeline and sweep forms")
    parser.add_argument("--sweep-space", default="conf/sweeps/kl_coef.yaml", help="search space of the sweep")
    parser.add_argument("--sweep-cron", default=None, help="cron schedule of the sweep, e.g. '0 2 * * *'")
    parser.epilog = "Any other option goes to flows/serve.py: --pipeline-cron CRON, --gpu-slots N, --limit N, --wait S."
    args, serve_args = parser.parse_known_args(argv)
    root = ROOT
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: no login on {args.host}: anyone who reaches it can start runs and read every artifact; "
            "a team serves with `rlhf serve --auth-file FILE` (docs/scaling.md)",
            file=sys.stderr,
        )
    for path, what in ((args.config, "config"), (args.sweep_space, "sweep space")):
        if not Path(path).is_file():
            print(f"error: the {what} {path} does not exist", file=sys.stderr)
            return 2

    bindir = Path(sys.executable).parent
    prefect_home = Path(os.environ["PREFECT_HOME"])
    prefect_home.mkdir(parents=True, exist_ok=True)
    Path("mlruns").mkdir(exist_ok=True)
    from rlhf.tracking.client import prepare_store  # heavy: MLflow

    prepare_store(sqlite_store())  # a copy of the empty store where there is none yet (no migrations in the UI)
    # `prefect server start`, with the form's Submit and the runs' own requests kept from failing while runs train
    # (flows/prefect_server.py)
    prefect_cmd = [sys.executable, "-m", "flows.prefect_server", "--host", args.host, "--port", str(args.prefect_port)]
    mlflow_cmd = [
        str(bindir / "mlflow"),
        "ui",
        "--backend-store-uri",
        sqlite_store(),
        "--host",
        args.host,
        "--port",
        str(args.mlflow_port),
        "--workers",
        "2",
    ]
    serve_cmd = [sys.executable, "-m", "flows.serve", "--config", args.config, "--sweep-space", args.sweep_space]
    if args.sweep_cron:
        serve_cmd += ["--sweep-cron", args.sweep_cron]
    serve_cmd += serve_args
    mlflow_url = os.environ.get("MLFLOW_UI_URL", f"http://127.0.0.1:{args.mlflow_port}")
    env = {**os.environ, "PYTHONPATH": pythonpath_with(root)}
    # the API address the Prefect UI (in the browser) calls: Prefect derives it from its own port setting, not from
    # `server start --port`, so any other port than 4200 gave a UI that "can't connect to Server API"
    ui_host = "127.0.0.1" if args.host in ("127.0.0.1", "0.0.0.0", "localhost") else args.host
    prefect_env = {"PREFECT_UI_API_URL": f"http://{ui_host}:{args.prefect_port}/api", **PERSISTENT_LEASES, **env}
    serve_env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{args.prefect_port}/api", "MLFLOW_UI_URL": mlflow_url}

    servers: list[subprocess.Popen] = []
    serve: subprocess.Popen | None = None
    # Every process gets a session of its own: a terminal's Ctrl-C reaches this process only, and it stops them in
    # order, the same way as a SIGTERM from a service manager (which may signal this process alone).
    stop = StopRequest()
    with open(prefect_home / "server.log", "w") as prefect_log, open("mlruns/mlflow-ui.log", "w") as mlflow_log:
        try:
            servers.append(
                subprocess.Popen(
                    prefect_cmd, env=prefect_env, stdout=prefect_log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            servers.append(
                subprocess.Popen(
                    mlflow_cmd,
                    env={**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                    stdout=mlflow_log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            print(f"Prefect UI: http://127.0.0.1:{args.prefect_port}  (server log: {prefect_home / 'server.log'})")
            print(f"MLflow UI:  http://127.0.0.1:{args.mlflow_port}  (log: mlruns/mlflow-ui.log)", flush=True)
            serve = subprocess.Popen(serve_cmd, env=serve_env, start_new_session=True)
            while serve.poll() is None and stop.signum is None:
                stop.wait(0.5)
            return serve.returncode if stop.signum is None else 0
        finally:
            with stop.ignored():  # a second Ctrl-C does not cut the shutdown short: it is bounded
                if serve is not None:
                    # the serve process pauses its schedules through the running server on SIGINT (Ctrl-C)
                    stop_group(serve, signal.SIGINT, SERVE_STOP_S)
                stop_servers(servers, SERVER_STOP_S)


SERVE_STOP_S = 20  # how long the serve process may take to pause its schedules and stop (then SIGTERM, SIGKILL)
SERVER_STOP_S = 15  # how long the servers may take to stop after SIGTERM (then SIGKILL)


COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "run": ("run the whole pipeline: rlhf run [--config FILE] [key.sub=value ...]", cmd_run),
    "sweep": ("run every variant of a sweep space and rank them: rlhf sweep --space FILE ...", cmd_sweep),
    "ui": ("Prefect server and UI, MLflow UI, and the pipeline and sweep deployments", cmd_ui),
    "serve": ("a team's Prefect and MLflow servers on PostgreSQL, behind a login (docs/scaling.md)", cmd_serve),
    "compare": ("compare pipeline runs side by side (tables and plots in outputs/compare)", cmd_compare),
    "bench": ("PPO throughput on a fixed shape (docs/benchmark.md)", cmd_bench),
    "memory": ("estimate the memory of each stage of a config, before anything is loaded", cmd_memory),
    "docs": ("print the config reference, or write it into docs/config.md", cmd_docs),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf",
        description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_line, _) in COMMANDS.items():
        # add_help=False: `rlhf NAME --help` reaches the subcommand's own parser, which lists its real options.
        sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints the help, or the usage and an error (exit 2)
        return 2
    name, rest = argv[0], argv[1:]
    set_default_env()
    _, command = COMMANDS[name]
    # Each delegated parser names itself `rlhf NAME` in its usage and errors.
    sys.argv = [f"rlhf {name}", *rest]
    try:
        return command(rest)
    except KeyboardInterrupt:  # Ctrl-C before a run's own handling is in place (flows/terminal.py): no traceback
        print(f"rlhf {name}: stopped by Ctrl-C (SIGINT)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
