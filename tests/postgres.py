"""A real PostgreSQL server for the tests, started in a temporary folder and stopped at the end of the session.

PostgreSQL refuses to run as root: where the tests run as root (CI here) the server runs as the `postgres` system
user (`runuser -u postgres`), in a folder that user owns. Where `pg_ctl` is not installed, or there is no user to run
it as, the tests that need it skip and say what to install.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PASSWORD = "rlhf-test-db-password"  # the test server's own superuser; not a secret: the server lives for one session
INSTALL = "apt-get install postgresql (initdb and pg_ctl on PATH or in /usr/lib/postgresql/*/bin)"


@dataclass(frozen=True)
class Postgres:
    """A running test server: `url` names its `postgres` database (no password in it); `env` holds PGPASSWORD."""

    host: str
    port: int
    user: str
    folder: Path

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"

    @property
    def env(self) -> dict[str, str]:
        return {"PGPASSWORD": PASSWORD}


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _as_server_user() -> list[str]:
    """The prefix that runs a PostgreSQL binary as a user it accepts: `runuser -u postgres --` under root."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("PostgreSQL refuses to run as root and there is no `postgres` user: useradd --system postgres")
    if shutil.which("runuser") is None:
        pytest.skip("PostgreSQL refuses to run as root and runuser is missing: apt-get install util-linux")
    return ["runuser", "-u", "postgres", "--"]


def start_postgres(port: int) -> Iterator[Postgres]:
    """initdb, then pg_ctl start on `port` (free, loopback; password login over TCP); stopped and removed after."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip(f"the PostgreSQL tests need a PostgreSQL server: {INSTALL}")
    prefix = _as_server_user()
    folder = Path(tempfile.mkdtemp(prefix="rlhf-tests-postgres-"))
    if prefix:
        shutil.chown(folder, "postgres")
    (folder / "pwfile").write_text(PASSWORD + "\n")
    if prefix:
        shutil.chown(folder / "pwfile", "postgres")
    data = folder / "data"
    init = [initdb, "-D", str(data), "-U", "postgres", "--pwfile", str(folder / "pwfile"), "--auth-local=trust"]
    init += ["--auth-host=scram-sha-256"]
    # fsync off: the tests never need the data after a power loss, and fsync costs seconds of every migration
    start = [pg_ctl, "-D", str(data), "-l", str(folder / "server.log"), "-w", "-t", "60"]
    start += ["-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"]
    try:
        subprocess.run([*prefix, *init], check=True, capture_output=True, timeout=120)
        subprocess.run([*prefix, *start, "start"], check=True, capture_output=True, timeout=90)
    except subprocess.CalledProcessError as err:
        log = (folder / "server.log").read_text(errors="replace") if (folder / "server.log").exists() else ""
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"PostgreSQL did not start: {err.stderr.decode(errors='replace')[-2000:]}{log[-2000:]}")
    try:
        yield Postgres("127.0.0.1", port, "postgres", folder)
    finally:
        subprocess.run([*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def postgres_database(server: Postgres, name: str) -> str:
    """A new, empty database `name` on the test server; its psycopg2 URL (the password from PGPASSWORD, set here for
    this process and the servers it starts)."""
    import psycopg2

    os.environ.update(server.env)
    conn = psycopg2.connect(server.url)
    conn.autocommit = True
    with conn.cursor() as cursor:
        cursor.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cursor.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return server.url_for(name).replace("postgresql://", "postgresql+psycopg2://")
