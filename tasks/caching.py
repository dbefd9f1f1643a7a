"""Content-addressed cache keys and output folders for the pipeline's Prefect tasks.

A stage's key is a digest of: its name, the config sections it reads, the content digests of its upstream
outputs and the version (source digest) of the library code. The same key names the stage's output folder, so a
cached Prefect result always points at files that were written for exactly those inputs. Cached results are
only used while those files are still complete: otherwise the task is re-run with ``refresh_cache``.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from prefect.context import TaskRunContext
from pydantic import BaseModel

import rlhf
from rlhf.checkpoints import is_complete, stage_lock


class StageOutput(BaseModel):
    """What a stage hands the next one: where its files are and their content digest, never models."""

    stage: str
    path: str
    digest: str
    mlflow_run_id: str | None = None
    metrics: dict[str, float] = {}
    extra: dict[str, Any] = {}


class TrackingContext(BaseModel):
    """Where to log: passed explicitly to every task (MLflow's active run is thread-local)."""

    uri: str
    experiment: str
    artifact_location: str | None = None
    parent_run_id: str
    flow_run_id: str | None = None
    log_checkpoints: bool = True
    registered_model: str | None = None


# Parameters that never change a stage's result, so they are left out of its key.
NOT_IN_KEY = {"tracking", "runtime"}


@cache
def code_version() -> str:
    """Digest of the library's source: a code change invalidates the cached stages."""
    h = hashlib.sha256()
    root = Path(rlhf.__file__).parent
    for file in sorted(root.rglob("*.py")):
        h.update(str(file.relative_to(root)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()[:16]


def _key_part(value: Any) -> Any:
    if isinstance(value, StageOutput):
        return value.digest
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def stage_key(stage: str, parameters: dict[str, Any]) -> str:
    parts = {k: _key_part(v) for k, v in sorted(parameters.items()) if k not in NOT_IN_KEY}
    payload = json.dumps({"stage": stage, "code": code_version(), "inputs": parts}, sort_keys=True, default=str)
    return f"{stage}-{hashlib.sha256(payload.encode()).hexdigest()[:20]}"


def stage_dir(output_root: str | Path, stage: str, parameters: dict[str, Any]) -> Path:
    return Path(output_root).resolve() / stage / stage_key(stage, parameters)


def content_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """Prefect cache_key_fn: the stage key (the flow run id is not part of it, so runs share the cache)."""
    return stage_key(context.task.name, parameters)


def run_stage(task, **parameters: Any) -> Any:
    """Call a stage task; refresh its cache entry when its output folder is missing or incomplete.

    The stage's folder is locked meanwhile (`stage_lock`): a second pipeline process on the same output folder
    waits for the first to finish the stage, then finds it complete and gets the cached result."""
    runtime = parameters["runtime"]
    folder = stage_dir(runtime.output_dir, task.name, parameters)
    with stage_lock(folder):
        # PPO keeps its resume state beside the final models, which carry the manifest in final/.
        complete = is_complete(folder) or is_complete(folder / "final")
        return task.with_options(refresh_cache=not complete)(**parameters)
