"""A warning when a stage waits on a concurrency slot that no running task holds.

A stage with a limited tag (``gpu``) asks the Prefect server for a slot of the tag's limit and waits until it gets
one. A slot taken under a lease is given back when its task ends, or when the lease expires (its process died). A
slot taken without a lease is never given back: the server counts it taken, yet lists no holder for it (`prefect
concurrency-limit inspect gpu` shows none). A restart of a Prefect server that kept its leases in memory (Prefect's
default; `rlhf serve` and `make ui` keep them in files) leaves such slots, and every later stage of that tag waits for
good. `watch_slots` checks, while its stage waits, whether the limit is full and some of its slots have no holder:
where that holds at two checks in a row, it logs one WARNING line naming the limit and the command that frees the
orphaned slots.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound

CHECK_EVERY_S = 30.0  # a stage that waits is checked this often; the warning comes after two checks (about 60 s)


@dataclass(frozen=True)
class Orphaned:
    """A full limit some of whose taken slots no lease holds."""

    name: str  # the limit: tag:gpu
    taken: int
    limit: int
    held: int  # the slots that a lease holds

    def warning(self, stage: str, waited_s: float) -> str:
        return (
            f"stage {stage} has waited {waited_s:.0f} s on the Prefect concurrency limit '{self.name}': "
            f"{self.taken} of its {self.limit} slot(s) are taken and no running task holds {self.taken - self.held} "
            "of them (left by a restart of a Prefect server that kept its leases in memory); free them with: "
            f"prefect global-concurrency-limit update {self.name} --active-slots {self.held}"
        )


def orphaned_slots(tags: Iterable[str]) -> Orphaned | None:
    """The first tag limit among `tags` that is full and has slots no lease holds, as the server says now."""
    with get_client(sync_client=True) as client:
        for tag in sorted(tags):
            try:
                limit = client.read_global_concurrency_limit_by_name(f"tag:{tag}")
                # the slots first, then their holders: a slot taken in between counts as held
                holders = client.read_concurrency_limit_by_tag(tag).active_slots
            except ObjectNotFound:
                continue
            if limit.active and limit.active_slots >= limit.limit and limit.active_slots > len(holders):
                return Orphaned(f"tag:{tag}", limit.active_slots, limit.limit, len(holders))
    return None


def stage_waits(flow_run_id: UUID, stage: str) -> bool:
    """Whether a task run of `stage` in the flow run is still Pending (waiting for its slots), not yet Running."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.PENDING]))
            ),
        )
    return any(run.name.startswith(f"{stage}-") for run in runs)


@contextmanager
def watch_slots(
    stage: str, tags: Iterable[str], logger: logging.Logger | logging.LoggerAdapter, every_s: float = CHECK_EVERY_S
) -> Iterator[None]:
    """Around the call of the stage task `stage` that runs with `tags`, in a flow run: until the call returns, check
    every `every_s` whether the stage's task run still waits (Pending) on a full limit with orphaned slots
    (`orphaned_slots`), and warn once through `logger` where two checks in a row say so. A check that fails says
    nothing."""
    tags = set(tags)
    context = FlowRunContext.get()
    if not tags or context is None or context.flow_run is None:
        yield
        return
    flow_run_id, done = context.flow_run.id, threading.Event()

    def watch() -> None:
        seen = 0
        while not done.wait(every_s):
            try:
                found = orphaned_slots(tags)
                if found is not None and not stage_waits(flow_run_id, stage):
                    found = None  # the stage runs: the orphaned slots hold up others, not this one
            except Exception:  # noqa: BLE001 (the server busy or gone: the stage's own requests say so)
                found = None
            seen = seen + 1 if found is not None else 0
            if found is not None and seen >= 2 and not done.is_set():
                logger.warning(found.warning(stage, seen * every_s))
                return

    watcher = threading.Thread(target=watch, name=f"slot-watch-{stage}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=5)
