"""The tracking store without MLflow: URI resolution, the reachability check of a store, the tags that tie a run to
its process (and whether that process is alive), the lock that serialises creating a SQLite store and the empty store
new ones start from, the plain record of a run that queries return, and the content digest of the data files logged
as dataset inputs.

`rlhf.tracking.client` (the one module that imports mlflow) builds on these; the preflight uses them without mlflow.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import sqlite3
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rlhf.checkpoints import stage_lock
from rlhf.errors import ConfigError

SQLITE_PREFIX = "sqlite:///"


def as_uri(location: str) -> str:
    """A local folder becomes an absolute file URI; URIs pass through."""
    if urlparse(location).scheme in ("", "file") and not location.startswith("file:"):
        return Path(location).resolve().as_uri()
    return location


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative ``sqlite:///path`` absolute and create its folder, so any working directory works."""
    prefix = SQLITE_PREFIX
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        path = Path(uri[len(prefix) :]).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(path)
    return uri


PROBE_TIMEOUT_S = 3.0


def check_tracking_uri(uri: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Refuse, in one sentence (ConfigError), a tracking store that cannot work: an http(s) server that does not
    answer within `timeout` seconds (any HTTP answer counts: the server is up), or a SQLite file whose folder cannot
    be created or written. Other URIs pass unchecked. Nothing is created."""
    scheme = urlparse(uri).scheme
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
                return
        except urllib.error.HTTPError:
            return  # it answered (an auth proxy, an older server without /health): the client will say more
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise ConfigError(
                f"tracking.uri: no MLflow tracking server answers at {uri} ({reason}); start it "
                "or point tracking.uri at one, e.g. the default sqlite:///mlruns/mlflow.db"
            ) from None
    prefix = SQLITE_PREFIX
    if uri.startswith(prefix):
        path = Path(uri[len(prefix) :]).resolve()
        existing = path.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        writable = existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
        if path.exists():
            writable = path.is_file() and os.access(path, os.R_OK | os.W_OK) and os.access(path.parent, os.W_OK)
        if not writable:
            raise ConfigError(
                f"tracking.uri: cannot write the SQLite store {path} ({existing} is not a writable folder); "
                "point tracking.uri at a writable place"
            )


# Tags of the process that runs a run: a RUNNING run whose process is gone was killed (end_orphaned_runs).
PID_TAG, HOST_TAG = "rlhf.pid", "rlhf.host"


def process_tags() -> dict[str, str]:
    """The tags naming this process and host (set on every run it starts or reopens)."""
    return {PID_TAG: str(os.getpid()), HOST_TAG: socket.gethostname()}


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def store_lock(uri: str) -> AbstractContextManager:
    """An exclusive lock beside a ``sqlite:///`` store (``<file>.lock``), so that processes starting together do not
    create its tables at once (SQLite: 'duplicate column name'); no lock for other stores."""
    prefix = SQLITE_PREFIX
    return stage_lock(Path(uri[len(prefix) :])) if uri.startswith(prefix) else contextlib.nullcontext()


def store_exists(uri: str) -> bool:
    """False for a ``sqlite:///`` store whose file is missing (opening it would create an empty one)."""
    prefix = SQLITE_PREFIX
    if uri.startswith(prefix):
        return Path(uri[len(prefix) :]).is_file()
    return True


def start_from_empty_store(uri: str, create: Callable[[str], None]) -> bool:
    """Where ``uri`` is a ``sqlite:///`` store whose file does not exist yet, make it a copy of an empty store of this
    MLflow version, built once per machine and user in the temporary folder by ``create(uri)`` (which makes MLflow
    create a store there); whether it did. MLflow creates a store by running its ~60 schema migrations, 5 s on a
    2-core machine, paid by every new store (a new output folder, a sweep in a new folder, every test); a copy takes
    milliseconds. The empty store has MLflow's tables and no experiment: MLflow adds its 'Default' experiment, with
    this process's artifact root, when it first opens the copy, as it does for a new store. Call it under
    `store_lock`."""
    if not uri.startswith(SQLITE_PREFIX):
        return False
    path = Path(uri[len(SQLITE_PREFIX) :])
    if path.exists():
        return False
    from importlib.metadata import version

    empty = Path(tempfile.gettempdir()) / f"rlhf-empty-mlflow-store-{version('mlflow')}-uid{os.getuid()}.db"
    with stage_lock(empty):
        if not empty.is_file():
            building = empty.with_name(empty.name + ".building")
            building.unlink(missing_ok=True)
            create(SQLITE_PREFIX + str(building))
            with contextlib.closing(sqlite3.connect(building)) as db, db:
                db.execute("DELETE FROM experiment_tags")
                db.execute("DELETE FROM experiments")
            os.replace(building, empty)
    partial = path.with_name(path.name + ".copying")
    shutil.copyfile(empty, partial)
    os.replace(partial, path)  # never a half-copied store under the store's name
    return True


RUN_TYPE_TAG = "run_type"


def parquet_digest(path: str | Path) -> str:
    """SHA-256 of a file's content, cached by (path, size, modification time): each prepared file is read once."""
    stat = Path(path).stat()
    return _file_digest(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    from rlhf.checkpoints import file_digest

    return file_digest(path)


@dataclass
class RunRecord:
    """A plain copy of an MLflow run: ids, name, status, times (ms), params, final metrics and tags."""

    run_id: str
    name: str
    status: str
    start_time: int | None = None
    end_time: int | None = None
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def is_pipeline_run(self) -> bool:
        """A pipeline (parent) run: neither a stage's child run nor a sweep run."""
        return "stage" not in self.tags and self.tags.get(RUN_TYPE_TAG) != "sweep"

    @classmethod
    def from_run(cls, run: Any) -> RunRecord:
        info = run.info
        return cls(
            run_id=info.run_id,
            name=info.run_name or info.run_id[:8],
            status=info.status,
            start_time=info.start_time,
            end_time=info.end_time,
            params=dict(run.data.params),
            metrics=dict(run.data.metrics),
            tags=dict(run.data.tags),
        )

    @property
    def parent_run_id(self) -> str | None:
        return self.tags.get("mlflow.parentRunId")
