"""How a sweep runs one variant: as a subflow of the sweep (in this process), or as a flow run of a pipeline
deployment that a worker of its work pool picks up (on any machine). Both wait for the pipeline to end and give an
`Outcome`: completed (with the run's summary), pruned by an Optuna pruner, or failed (with its error).

On one machine, concurrent variants are pinned to devices: `device_slots` makes one Prefect global concurrency limit
of one slot per device (two virtual slots on a CPU-only machine with max_concurrency 2), the sweep gives each
running variant a free slot (``runtime.device`` and ``runtime.device_slot``) and each GPU stage holds its slot while
it computes (tasks/caching.py), so two variants never share a device, also across sweeps and UI runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel

from flows.pipeline import PRUNED_STATE, rlhf_pipeline
from rlhf.config import PipelineConfig
from rlhf.errors import first_line
from rlhf.models.device import device_names
from rlhf.sweeps.optuna_search import TrialRef
from tasks.tracking import tracker_for


class Outcome(BaseModel):
    """How a variant's pipeline ended."""

    status: Literal["completed", "pruned", "failed"]
    summary: dict[str, Any] = {}  # the pipeline's summary (completed): metrics, paths, mlflow_run_id
    mlflow_run_id: str | None = None
    flow_run_id: str | None = None
    error: str | None = None


class DeviceSlot(NamedTuple):
    device: str  # runtime.device of the variant holding the slot
    limit: str  # the Prefect global concurrency limit (one slot) its GPU stages hold


def device_slots(device: str, count: int, owner: str) -> list[DeviceSlot]:
    """`count` slots over the devices `device` names (round robin): one per GPU when `count` is the number of GPUs;
    on a CPU-only machine `count` virtual slots. `owner` (the sweep run's id) is in the limits' names: two sweeps
    started together on one Prefect database each have their own, so neither resets the other's limit while a
    variant holds it (its slot then never came back, and the next variant waited for good)."""
    devices = device_names(device)
    per_device = -(-count // len(devices))
    slots = []
    for i in range(count):
        name, k = devices[i % len(devices)], i // len(devices)
        suffix = f"-{k}" if per_device > 1 or name == "cpu" else ""
        slots.append(DeviceSlot(name, f"rlhf-{owner}-{name.replace(':', '-')}{suffix}"))
    return slots


@task(name="make_device_limits", cache_policy=NO_CACHE)
def make_device_limits(slots: list[DeviceSlot]) -> None:
    """One Prefect global concurrency limit of one slot per device slot, made afresh: a sweep resumed after its
    process was killed while a stage held a slot finds it held (its lease outlives it), which would block every later
    variant on it."""
    with get_client(sync_client=True) as client:
        for slot in slots:
            _delete_limit(client, slot.limit)
            client.upsert_global_concurrency_limit_by_name(slot.limit, 1)


def _delete_limit(client: Any, name: str) -> None:
    try:
        client.delete_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        pass


@contextmanager
def device_limits(slots: list[DeviceSlot]) -> Iterator[None]:
    """The Prefect limits of a sweep's `slots` while its variants run: made at the start, removed at the end (a
    sweep stopped or killed leaves them, and its resumed run makes them afresh). Nothing without slots."""
    if slots:
        make_device_limits(slots)
    yield
    if slots:
        remove_device_limits(slots)


@task(name="remove_device_limits", cache_policy=NO_CACHE)
def remove_device_limits(slots: list[DeviceSlot]) -> None:
    """The sweep's limits, removed when it ends (each sweep run makes its own: `device_slots`)."""
    with get_client(sync_client=True) as client:
        for slot in slots:
            _delete_limit(client, slot.limit)


def pinned(config: PipelineConfig, slot: DeviceSlot, sharing: int) -> PipelineConfig:
    """The variant's config on its slot's device; on CPU each of the `sharing` concurrent variants gets its share of
    the cores (unless runtime.threads is set)."""
    update: dict[str, Any] = {"device": slot.device, "device_slot": slot.limit}
    if slot.device == "cpu" and config.runtime.threads is None:
        update["threads"] = max(1, (os.cpu_count() or 1) // sharing)
    return config.model_copy(update={"runtime": config.runtime.model_copy(update=update)})


def _pipeline_run(config: PipelineConfig, flow_run_id: str | None) -> str | None:
    return tracker_for(config.tracking).pipeline_run_of_flow_run(flow_run_id) if flow_run_id else None


@task(name="run_variant", cache_policy=NO_CACHE)
def run_variant(config: PipelineConfig, trial: TrialRef | None = None) -> Outcome:
    """The pipeline of one variant as a subflow, in this process."""
    state = rlhf_pipeline.with_options(flow_run_name=config.run_name)(config, trial=trial, return_state=True)
    flow_run_id = str(state.state_details.flow_run_id) if state.state_details.flow_run_id else None
    if state.name == PRUNED_STATE:
        return Outcome(status="pruned", mlflow_run_id=_pipeline_run(config, flow_run_id), flow_run_id=flow_run_id)
    if state.is_completed():
        summary = state.result()
        return Outcome(
            status="completed", summary=summary, mlflow_run_id=summary["mlflow_run_id"], flow_run_id=flow_run_id
        )
    return Outcome(
        status="failed",
        mlflow_run_id=_pipeline_run(config, flow_run_id),
        flow_run_id=flow_run_id,
        error=first_line(state.message, "failed", 200),
    )


@task(name="run_deployed_variant", cache_policy=NO_CACHE)
def run_deployed_variant(deployment: str, config: PipelineConfig, trial: TrialRef | None = None) -> Outcome:
    """The pipeline of one variant as a flow run of `deployment`, run by a worker of its work pool; waits for it.
    The summary is read back from the run's MLflow run (the worker may be on another machine)."""
    parameters = {"config": config.model_dump(mode="json"), "trial": trial.model_dump(mode="json") if trial else None}
    run = run_deployment(deployment, parameters=parameters, flow_run_name=config.run_name, timeout=None)
    flow_run_id, state = str(run.id), run.state
    mlflow_run_id = _pipeline_run(config, flow_run_id)
    if state is not None and state.name == PRUNED_STATE:
        return Outcome(status="pruned", mlflow_run_id=mlflow_run_id, flow_run_id=flow_run_id)
    if state is not None and state.is_completed() and mlflow_run_id is not None:
        run_data = tracker_for(config.tracking).get_run(mlflow_run_id).data
        summary = {**run_data.metrics, "mlflow_run_id": mlflow_run_id}
        return Outcome(status="completed", summary=summary, mlflow_run_id=mlflow_run_id, flow_run_id=flow_run_id)
    message = state.message if state is not None else "no final state"
    return Outcome(
        status="failed",
        mlflow_run_id=mlflow_run_id,
        flow_run_id=flow_run_id,
        error=first_line(f"flow run {config.run_name} of {deployment}: {message}", "failed", 200),
    )
