"""rlhf/tracking/store.py `start_from_empty_store`: a new SQLite store is a copy of an empty one of this MLflow version,
the same as the store MLflow creates itself."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from rlhf.tracking.client import Tracker
from rlhf.tracking.store import SQLITE_PREFIX, start_from_empty_store


def _schema(path: Path) -> tuple[list, list]:
    """Tables, indexes and the migration version; each definition's lines as a set (MLflow's own migrations write a
    table's constraints in an order that differs from process to process)."""
    with closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT type, name, sql FROM sqlite_master WHERE name != 'sqlite_sequence'")
        tables = sorted(
            (kind, name, sorted(line.strip(" ,") for line in (sql or "").splitlines())) for kind, name, sql in rows
        )
        return tables, db.execute("SELECT version_num FROM alembic_version").fetchall()


def _experiments(path: Path) -> list[tuple]:
    with closing(sqlite3.connect(path)) as db:
        return db.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments").fetchall()


def test_a_new_store_is_the_one_mlflow_creates(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns of the current folder
    by_mlflow, by_copy = tmp_path / "mlflow.db", tmp_path / "copy.db"
    MlflowClient(tracking_uri=SQLITE_PREFIX + str(by_mlflow)).search_experiments()
    Tracker(SQLITE_PREFIX + str(by_copy), "exp")  # the copy, then what the tracker adds
    assert _schema(by_copy) == _schema(by_mlflow)
    default = [row for row in _experiments(by_copy) if row[1] == "Default"]
    assert default == [row for row in _experiments(by_mlflow) if row[1] == "Default"]
    assert default[0][2] == str(tmp_path / "mlruns" / "0")  # this process's artifact root, not the builder's
    assert [row[1] for row in _experiments(by_copy)] == ["Default", "exp"]


def test_only_a_missing_sqlite_store_is_copied(tmp_path):
    def must_not_build(uri: str) -> None:
        raise AssertionError(uri)

    existing = tmp_path / "existing.db"
    existing.write_bytes(b"not touched")
    assert not start_from_empty_store(SQLITE_PREFIX + str(existing), must_not_build)
    assert existing.read_bytes() == b"not touched"
    assert not start_from_empty_store("http://127.0.0.1:5000", must_not_build)
    assert not start_from_empty_store("file:///tmp/mlruns", must_not_build)


def test_an_experiment_another_process_created_meanwhile_is_used(tmp_path, monkeypatch):
    """Runs started together on a tracking server all find no experiment, then all but one fail to create it
    (RESOURCE_ALREADY_EXISTS, measured by benchmarks/store_concurrency.py): the loser reads its id back."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = Tracker(uri, "together", str(tmp_path / "art"))
    lookups = []
    real = MlflowClient.get_experiment_by_name

    def late(self, name):  # the first lookup happens before the other process created it
        lookups.append(name)
        return None if len(lookups) == 1 else real(self, name)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", late)
    assert Tracker(uri, "together", str(tmp_path / "art")).experiment_id == first.experiment_id
    assert lookups == ["together", "together"]
