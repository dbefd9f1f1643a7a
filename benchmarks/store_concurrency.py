"""Where SQLite stops being enough: N smoke pipelines at once on the embedded SQLite default, and on the team's
PostgreSQL servers (`rlhf serve`), for N = 1, 2, 4 and 8.

    make bench-store DATABASE=postgresql://USER@HOST:5432/NAME      # PGPASSWORD (or ~/.pgpass) in the environment
    .venv/bin/python benchmarks/store_concurrency.py [--database URL] [--n 1 2 4 8] [--backends sqlite postgres]

* sqlite: N processes of `rlhf run --config conf/smoke.yaml`, started together, with one shared MLflow SQLite file
  and one shared PREFECT_HOME (each process starts its temporary Prefect server over the same SQLite database):
  what N terminals on one machine get with the defaults.
* postgres: `rlhf serve --no-deploy` on `<NAME>_bench<N>` (new databases for each N, behind a login), and the same
  N processes with PREFECT_API_URL and `tracking.uri` pointing at its two servers.

Run i has `seed=i` (the stage cache is shared; another seed makes every stage its own). For each N the table gives
the runs that failed, the lines with `database is locked` in their output, the metric points lost and duplicated
(every metric history of every stage's MLflow run, read from the store's tables, against the N = 1 run of the same
backend) and the wall time
from the first start to the last end. Serialise it with other benchmarks on a shared machine: `flock
/tmp/rlhf-bench.lock make bench-store ...`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy
from sqlalchemy.engine import URL, make_url

REPO = Path(__file__).resolve().parent.parent

EXPERIMENT = "store-bench"
LOCKED = "database is locked"
RUN_TIMEOUT_S = 3600  # a round's runs all end within this, or the late ones are killed and counted as failed
History = dict[tuple[str, str], int]  # (stage, metric key) -> points in the store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(folder: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_", "MLFLOW_TRACKING_"))}
    env |= {"PREFECT_HOME": str(folder / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
    return env | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def run_pipelines(n: int, folder: Path, env: dict[str, str], tracking: list[str]) -> tuple[list[int], int, float]:
    """N pipelines at once; (exit codes, lines with `database is locked`, wall seconds)."""
    rlhf = str(Path(sys.executable).parent / "rlhf")
    procs, logs = [], []
    start = time.monotonic()
    for i in range(n):
        log = folder / f"run{i}.log"
        args = [rlhf, "run", "--config", "conf/smoke.yaml", f"seed={i}", f"runtime.output_dir={folder}/out{i}"]
        args += [*tracking, f"tracking.experiment={EXPERIMENT}"]
        with open(log, "w") as out:
            procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, start + RUN_TIMEOUT_S - time.monotonic())))
        except subprocess.TimeoutExpired:  # counted as failed, never a benchmark waiting for good
            proc.kill()
            codes.append(proc.wait())
    wall = time.monotonic() - start
    locked = sum(log.read_text(errors="replace").count(LOCKED) for log in logs)
    return codes, locked, wall


# every metric point of the experiment, per run, with the run's stage and parent (the tables of MLflow's SQL store)
POINTS = """
SELECT r.run_uuid,
       (SELECT t.value FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = 'stage'),
       (SELECT t.value FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = 'mlflow.parentRunId'),
       m.key, COUNT(*)
FROM runs r JOIN experiments e ON e.experiment_id = r.experiment_id JOIN metrics m ON m.run_uuid = r.run_uuid
WHERE e.name = :experiment AND r.lifecycle_stage = 'active'
GROUP BY r.run_uuid, m.key
"""


def histories(store_url: str | URL) -> list[History]:
    """For each pipeline run in the store: the number of points of every metric of every stage's run. Read from the
    store's tables in one query (through the tracking server's API it is one request per metric history, thousands
    for N = 8, each one paying the login's password check)."""
    engine = sqlalchemy.create_engine(store_url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sqlalchemy.text(POINTS), {"experiment": EXPERIMENT}).all()
    finally:
        engine.dispose()
    pipelines: dict[str, History] = {}
    for run, stage, parent, key, points in rows:  # a stage's run counts in its pipeline's, a pipeline's in its own
        counts = pipelines.setdefault(parent or run, {})
        counts[(stage or "pipeline", key)] = counts.get((stage or "pipeline", key), 0) + points
    return list(pipelines.values())


def lost_and_duplicated(found: list[History], n: int, reference: History) -> tuple[int, int]:
    """Points missing and points beyond the reference, summed over the runs; a missing run loses all of its own."""
    lost = dup = 0
    for counts in found + [{}] * max(0, n - len(found)):
        for key, expected in reference.items():
            got = counts.get(key, 0)
            lost, dup = lost + max(0, expected - got), dup + max(0, got - expected)
    return lost, dup


def sqlite_round(n: int, folder: Path) -> tuple[list[int], int, float, list[History]]:
    uri = f"sqlite:///{folder}/mlflow.db"
    tracking = [f"tracking.uri={uri}", f"tracking.artifact_location={folder}/artifacts"]
    codes, locked, wall = run_pipelines(n, folder, base_env(folder), tracking)
    return codes, locked, wall, histories(uri)


def postgres_round(n: int, folder: Path, database: str) -> tuple[list[int], int, float, list[History]]:
    """`rlhf serve` on new databases for this N, the runs through it, then Ctrl-C to the servers."""
    import httpx

    prefect_port, mlflow_port = free_port(), free_port()
    login = f"bench:{secrets.token_hex(12)}"
    env = base_env(folder) | {"RLHF_SERVE_AUTH": login}
    serve_args = [str(Path(sys.executable).parent / "rlhf"), "serve", "--no-deploy", "--state", str(folder / "serve")]
    serve_args += ["--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]
    serve_args += ["--artifacts", str(folder / "artifacts")]
    env["RLHF_DATABASE_URL"] = f"{database.rstrip('/')}_bench{n}"
    with open(folder / "serve.log", "w") as out:
        serve = subprocess.Popen(serve_args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "ready" not in (folder / "serve.log").read_text():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"rlhf serve did not start: {(folder / 'serve.log').read_text()[-2000:]}")
            time.sleep(1)
        user, password = login.split(":", 1)
        client = env | {"PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api", "PREFECT_API_AUTH_STRING": login}
        client |= {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
        uri = f"http://127.0.0.1:{mlflow_port}"
        tracking = [f"tracking.uri={uri}", f"tracking.artifact_location=mlflow-artifacts:/{EXPERIMENT}"]
        codes, locked, wall = run_pipelines(n, folder, client, tracking)
        assert httpx.get(f"{uri}/health", timeout=10).status_code == 200  # the server outlived its load
        store = make_url(env["RLHF_DATABASE_URL"]).set(drivername="postgresql+psycopg2")
        return codes, locked, wall, histories(store.set(database=f"{store.database}_mlflow"))
    finally:
        serve.send_signal(2)
        serve.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", default=os.environ.get("RLHF_DATABASE_URL"), help="the PostgreSQL to use")
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8], help="concurrent runs (1 first)")
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"])
    args = parser.parse_args(argv)
    if "postgres" in args.backends and not args.database:
        parser.error("the postgres backend needs --database postgresql://USER@HOST:5432/NAME (or RLHF_DATABASE_URL)")
    print(f"load before: {os.getloadavg()[0]:.2f} (1-minute average, {os.cpu_count()} cores)")
    print("| backend | N | failed runs | `database is locked` lines | metric points lost | duplicated | wall s |")
    print("|---|---|---|---|---|---|---|")
    for backend in args.backends:
        reference: History | None = None
        for n in args.n:
            folder = Path(tempfile.mkdtemp(prefix=f"rlhf-store-bench-{backend}{n}-"))
            if backend == "sqlite":
                codes, locked, wall, found = sqlite_round(n, folder)
            else:
                codes, locked, wall, found = postgres_round(n, folder, args.database)
            if reference is None:
                reference = max(found, key=lambda c: sum(c.values())) if found else {}
            lost, dup = lost_and_duplicated(found, n, reference)
            failed = sum(code != 0 for code in codes)
            load = os.getloadavg()[0]
            print(f"| {backend} | {n} | {failed} | {locked} | {lost} | {dup} | {wall:.0f} (load {load:.1f}) |")
            points = sum(sum(counts.values()) for counts in found)
            print(f"  ({len(found)} pipeline runs, {points} metric points counted; logs: {folder})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
