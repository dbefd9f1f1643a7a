"""The tracking store without MLflow: URI resolution, the reachability check of a store, the tags that tie a run to
its process (and whether that process is alive), the lock that serialises creating a SQLite store and the empty store
new ones start from, the plain record of a run that queries return, the content digest of the data files logged
as dataset inputs, the source tags of a run, and the retry of an MLflow client's calls on a transiently locked
SQLite store.

`rlhf.tracking.client` (the one module that imports mlflow) builds on these; the preflight uses them without mlflow.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import socket
import sqlite3
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil

from rlhf.checkpoints import file_digest, stage_lock
from rlhf.errors import ConfigError
from rlhf.metrics import current_metric_name

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


def process_alive(pid: int, started: float | None = None) -> bool:
    """Whether process `pid` of this host still runs (a zombie has ended) and, given its start time `started`, is the
    process that started then rather than another that reused the pid."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # ended, not yet reaped by its parent
            return False
        return started is None or abs(process.create_time() - started) <= 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process
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
            # a run of an earlier release reads under today's names (rlhf.metrics.RENAMED_METRICS)
            metrics={current_metric_name(k): v for k, v in run.data.metrics.items()},
            tags=dict(run.data.tags),
        )

    @property
    def parent_run_id(self) -> str | None:
        return self.tags.get("mlflow.parentRunId")


# MLflow's source of a run (the run page's Source) and of a logged model (the Models tab's "Logged from")
SOURCE_NAME_TAG, SOURCE_TYPE_TAG = "mlflow.source.name", "mlflow.source.type"
_CHECKOUT = Path(__file__).resolve().parents[2]  # rlhf/tracking/store.py -> the project's folder


# SQLite errors of two processes writing one store at once (MLflow sets a busy timeout, but SQLite gives up at once
# on some lock upgrades, and two processes may create the tables of a new store together): retried.
_TRANSIENT = re.compile(r"database (table )?is locked|table \w+ already exists")
RETRY_ATTEMPTS, RETRY_DELAY_S = 8, 0.25


class RetryingClient:
    """An ``MlflowClient`` whose calls are retried, with a growing delay, on a transient SQLite error."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            for attempt in range(RETRY_ATTEMPTS):
                try:
                    return method(*args, **kwargs)
                except Exception as err:
                    if attempt == RETRY_ATTEMPTS - 1 or not _TRANSIENT.search(str(err)):
                        raise
                    time.sleep(RETRY_DELAY_S * 2**attempt)
            raise AssertionError("unreachable")

        return call


def source_tags(name: str) -> dict[str, str]:
    """The tags that make `name` (e.g. ``flows/pipeline.py``) MLflow's source of a run or a logged model."""
    return {SOURCE_NAME_TAG: name, SOURCE_TYPE_TAG: "LOCAL"}


def default_source() -> str:
    """What started this process, as the project names it: ``rlhf run`` (the `rlhf` command and its subcommand),
    a file of the checkout (``benchmarks/overhead_bench.py``), else ``rlhf``. MLflow's own guess is the file Python
    started, which for a flow run of a deployment is Prefect's engine.py."""
    main = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if main is None:
        return "rlhf"
    if main.name == "rlhf":
        command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), None)
        return f"rlhf {command}" if command else "rlhf"
    main = main.resolve()
    installed = Path(sys.prefix).resolve()  # a virtual environment inside the checkout is not the project's code
    if main.suffix == ".py" and main.is_relative_to(_CHECKOUT) and not main.is_relative_to(installed):
        return main.relative_to(_CHECKOUT).as_posix()
    return "rlhf"
