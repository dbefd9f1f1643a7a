"""The PostgreSQL side of `rlhf serve` (flows/team_servers.py): the one URL a team gives, the databases made from
it (Prefect's, MLflow's and its login's), and the checks that turn a bad URL, an unreachable server, wrong
credentials or a schema of another Prefect or MLflow version into one sentence before any server starts.

psycopg2 (`pip install psycopg2-binary`, the `team` extra) is MLflow's PostgreSQL driver and the one these checks
use; Prefect's server uses asyncpg. Both read a password left out of the URL from PGPASSWORD or ~/.pgpass.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

SCHEMES = ("postgresql", "postgresql+psycopg2", "postgresql+asyncpg", "postgres")
EXAMPLE = "postgresql://USER@HOST:5432/NAME"
INSTALL_DRIVER = "pip install psycopg2-binary (or `pip install -e '.[team]'`)"


class DatabaseError(Exception):
    """A database a user named that cannot serve (one sentence, exit code 2)."""


@dataclass(frozen=True)
class TeamDatabases:
    """The server the team named, and the databases on it: `<name>_prefect`, `<name>_mlflow`, `<name>_mlflow_auth`."""

    url: URL  # as given, the driver normalised to psycopg2

    @property
    def where(self) -> str:
        return f"{self.url.host or 'localhost'}:{self.url.port or 5432}"

    @property
    def names(self) -> tuple[str, str, str]:
        """Prefect's, MLflow's tracking store, and the users of MLflow's login (a database of their own, apart from
        the tracking store's tables, which MLflow's own checks of its schema look at)."""
        base = self.url.database or "postgres"
        return f"{base}_prefect", f"{base}_mlflow", f"{base}_mlflow_auth"

    @property
    def prefect_url(self) -> str:
        """Prefect's server: asyncpg (a password left out is read from PGPASSWORD or ~/.pgpass)."""
        url = self.url.set(drivername="postgresql+asyncpg", database=self.names[0])
        return url.render_as_string(hide_password=False)

    @property
    def mlflow_url(self) -> str:
        return self.url.set(database=self.names[1]).render_as_string(hide_password=False)

    @property
    def mlflow_auth_url(self) -> str:
        return self.url.set(database=self.names[2]).render_as_string(hide_password=False)

    def connect(self, database: str = "postgres"):
        """A psycopg2 connection (autocommit) to `database` (default: `postgres`, which every server has)."""
        import psycopg2  # the optional `team` extra: checked in parse_database

        try:
            conn = psycopg2.connect(
                host=self.url.host,
                port=self.url.port,
                user=self.url.username,
                password=self.url.password,
                dbname=database,
                connect_timeout=5,
            )
        except psycopg2.OperationalError as err:
            raise DatabaseError(self._explain(str(err), database)) from None
        conn.autocommit = True
        return conn

    def _explain(self, message: str, database: str) -> str:
        first = message.strip().splitlines()[0].strip() if message.strip() else "no answer"
        if "password" in message or "authentication failed" in message:
            return (
                f"PostgreSQL at {self.where} refused user {self.url.username!r}: wrong or missing password (set "
                "PGPASSWORD, ~/.pgpass, or the whole URL in RLHF_DATABASE_URL)"
            )
        if "does not exist" in message:
            return f"PostgreSQL at {self.where} has no database {database} or no role {self.url.username} ({first})"
        return f"no PostgreSQL server answered at {self.where} ({first}): start it, or fix --database"


def parse_database(text: str, from_command_line: bool) -> TeamDatabases:
    """The team's database URL, checked: PostgreSQL with a driver that is installed, no password on a command line."""
    if "://" not in text:
        raise DatabaseError(f"the database URL {text!r} names no driver: write it as {EXAMPLE}")
    try:
        url = make_url(text)
    except ArgumentError:
        raise DatabaseError(f"the database URL {text!r} is not a URL: write it as {EXAMPLE}") from None
    if url.drivername not in SCHEMES:
        raise DatabaseError(
            f"the database URL names {url.drivername!r}; `rlhf serve` needs PostgreSQL ({EXAMPLE}); one person on "
            "one machine keeps the embedded SQLite default with `make ui`"
        )
    if from_command_line and url.password:
        raise DatabaseError(
            "the password in --database would show in `ps`: leave it out and set PGPASSWORD or ~/.pgpass, or put the "
            "whole URL in RLHF_DATABASE_URL"
        )
    for module, what in (("psycopg2", INSTALL_DRIVER), ("asyncpg", "pip install asyncpg")):
        if importlib.util.find_spec(module) is None:
            raise DatabaseError(f"the PostgreSQL driver {module} is not installed: {what}")
    return TeamDatabases(url.set(drivername="postgresql+psycopg2"))


def create_databases(team: TeamDatabases) -> None:
    """Connect (the check that the server answers and takes the credentials), then create the databases where
    they are missing."""
    conn = team.connect()
    try:
        with conn.cursor() as cursor:
            for name in team.names:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if cursor.fetchone() is None:
                    _create(cursor, name, team)
    finally:
        conn.close()


def _create(cursor, name: str, team: TeamDatabases) -> None:
    import psycopg2  # the optional `team` extra

    try:
        cursor.execute(f'CREATE DATABASE "{name}"')
    except psycopg2.errors.InsufficientPrivilege:
        raise DatabaseError(
            f"user {team.url.username!r} may not create databases on {team.where}: create {name} for it, or grant it "
            "CREATEDB"
        ) from None


def migration_revisions(package: str, folder: str) -> tuple[set[str], set[str]]:
    """(every revision, the heads) of the Alembic migrations under `folder` of an installed `package`."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    versions = Path(spec.submodule_search_locations[0]) / folder
    scripts = ScriptDirectory(str(versions.parent), version_locations=[str(versions)])
    return {script.revision for script in scripts.walk_revisions()}, set(scripts.get_heads())


def check_schema_versions(team: TeamDatabases) -> None:
    """Refuse a database whose schema another Prefect or MLflow version wrote (a server of that version may be
    using it): Prefect migrates an older schema of its own at its start; MLflow's server refuses one, so that is
    named here with the command that migrates it."""
    for package, folder, name in (
        ("prefect", "server/database/_migrations/versions/postgresql", team.names[0]),
        ("mlflow", "store/db_migrations/versions", team.names[1]),
    ):
        revision = _schema_revision(team, name)
        if revision is None:
            continue
        known, heads = migration_revisions(package, folder)
        where = f"the database {name} on {team.where}"
        if revision not in known:
            raise DatabaseError(
                f"{where} holds the schema of another {package} version than the installed {version(package)} "
                f"(revision {revision}): serve it with that version, or name another database"
            )
        if package == "mlflow" and revision not in heads:
            raise DatabaseError(
                f"{where} holds an older MLflow's schema (revision {revision}): stop the servers of that version, "
                f"then run `mlflow db upgrade postgresql://{team.url.username}@{team.where}/{name}`"
            )


def _schema_revision(team: TeamDatabases, name: str) -> str | None:
    """The Alembic revision recorded in database `name`; None for a database no server has used yet."""
    conn = team.connect(name)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT to_regclass('alembic_version')")
            if cursor.fetchone()[0] is None:
                return None
            cursor.execute("SELECT version_num FROM alembic_version")
            row = cursor.fetchone()
            return row[0] if row else None
    finally:
        conn.close()
