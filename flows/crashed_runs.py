"""Flow and task runs whose process died without reporting (SIGKILL, the OOM killer, a preempted node), marked
Crashed, and the concurrency slots they held released (the link from a rerun to the crashed run it resumed:
flows/resumed_runs.py).

Prefect records a run's end from inside its process: a process killed with SIGKILL records nothing, and its flow
run, its task runs and its in-process subflows (a sweep's variants) would stay Running for good. Prefect 3.9 has no
zombie detection on a temporary server (its heartbeat automation needs a server that outlives the run). So:

* every pipeline flow run labels itself at its start (`check_in`): ``rlhf.process`` names its process (host, pid and
  start time) and ``rlhf.prefect_server`` the Prefect server it reports to (``temporary``: the server a CLI run starts
  for itself, which dies with it; else the API URL);
* `crash_dead_runs` (every pipeline run at its start, and ``python -m flows.sweep`` before its flow) reads the
  Pending, Running and Cancelling flow runs of the Prefect database, and marks Crashed, with a message naming the
  process, those whose process on this host is gone; with them the in-process relatives of each (the parent flow run
  of a subflow and its other subflows: one process ran them all) and their unfinished task runs, also those of flow
  runs that Prefect's runner already marked Crashed (a served run whose process was killed);
* a Running task run holds a slot of each of its tags' concurrency limits (``gpu``, flows/serve.py). The server that
  still has the slot's lease releases it when the task run becomes Crashed; a killed CLI run's lease was in the
  memory of its temporary server, so one slot of each limit is released here.

When (docs/orchestration.md, "A run killed from outside"): a CLI run's zombies are marked by the next pipeline or
sweep that starts on the same Prefect home on this machine, before its first stage (no server runs in between).
A served run's process killed alone is marked Crashed at once by Prefect's runner, its task runs by the next run's
check-in. A run on a Prefect server whose process died with whatever watched it (the serve process, a worker, the
machine) is marked Crashed by the server: every flow run sends a heartbeat every HEARTBEAT_S seconds (flows/__init__.py;
prefect.yaml for a worker's runs; flows/serve.py for served ones), and the automation `ensure_zombie_automation`
creates (`make ui`, `rlhf serve`, and the check-in of a run on a server) marks Crashed a run without one for
`ZOMBIE_AFTER_S` seconds; the server revokes an expired slot lease (60 s) itself.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, NamedTuple
from uuid import UUID

import psutil
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    TaskRunFilter,
    TaskRunFilterFlowRunId,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import FlowRun, StateType, TaskRun
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, get_current_settings
from prefect.states import Crashed

from flows import HEARTBEAT_S
from flows.terminal import prefect_api_problem
from rlhf.checkpoints import stage_lock
from rlhf.tracking.store import process_alive

PROCESS_LABEL, SERVER_LABEL = "rlhf.process", "rlhf.prefect_server"
TEMPORARY = "temporary"  # SERVER_LABEL of a run that reported to the temporary server of its own process
UNFINISHED = [StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]
UNFINISHED_TASK = [*UNFINISHED, StateType.SCHEDULED]  # Scheduled: AwaitingRetry
ZOMBIE_AFTER_S = 3 * HEARTBEAT_S  # the automation's wait for a heartbeat (Prefect's documented 30 s and 90 s)
ZOMBIE_AUTOMATION = "rlhf: crash flow runs without heartbeats"
_PAGE = 200


class CrashedRun(NamedTuple):
    """A flow run marked Crashed: its id, name and why."""

    id: UUID
    name: str
    message: str


# -- The process of a run ------------------------------------------------------------------------------------------


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def process_label(pid: int | None = None) -> str:
    """``<host>:<pid>:<start time>`` of this process (or `pid`): the start time tells a reused pid apart."""
    pid = pid or os.getpid()
    started = _start_time(pid)
    return f"{socket.gethostname()}:{pid}:{started:.0f}" if started is not None else f"{socket.gethostname()}:{pid}:"


def process_gone(label: str) -> bool | None:
    """Whether the process `label` (`process_label`) names has ended: None when it ran on another host or the label
    is not one (it cannot be told from here)."""
    host, _, rest = label.partition(":")
    pid, _, started = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    try:
        return not process_alive(int(pid), float(started) if started else None)
    except ValueError:
        return False


def server_label() -> str:
    """SERVER_LABEL of this process's runs: ``temporary`` without PREFECT_API_URL, else the URL."""
    return PREFECT_API_URL.value() or TEMPORARY


def _pid(label: str) -> str:
    host, _, rest = label.partition(":")
    return f"pid {rest.partition(':')[0]} on {host}"


# -- Finding and crashing ------------------------------------------------------------------------------------------


def _all(read: Callable[..., list[Any]], **filters: Any) -> list[Any]:
    """Every page of a read_flow_runs or read_task_runs query."""
    found: list[Any] = []
    while True:
        page = read(**filters, limit=_PAGE, offset=len(found))
        found += page
        if len(page) < _PAGE:
            return found


def _flow_runs(client: SyncPrefectClient, ids: Iterable[UUID] | None = None, states: list[StateType] | None = None):
    state = FlowRunFilterState(type=FlowRunFilterStateType(any_=states)) if states else None
    id_filter = FlowRunFilterId(any_=list(ids)) if ids is not None else None
    return _all(client.read_flow_runs, flow_run_filter=FlowRunFilter(id=id_filter, state=state))


def _in_process_parents(client: SyncPrefectClient, runs: list[FlowRun]) -> dict[UUID, UUID]:
    """subflow -> parent flow run, for the subflows among `runs` that run in their parent's process (no deployment of
    their own: a sweep's variants; a variant started with run_deployment runs elsewhere)."""
    parents = {}
    for run in runs:
        if run.parent_task_run_id is not None and run.deployment_id is None:
            parent_task = client.read_task_run(run.parent_task_run_id)
            if parent_task.flow_run_id is not None:
                parents[run.id] = parent_task.flow_run_id
    return parents


def _dead_flow_runs(client: SyncPrefectClient) -> tuple[dict[UUID, FlowRun], dict[UUID, str], set[UUID]]:
    """The unfinished flow runs whose process is gone, with why, and the flow runs (any state) whose unfinished task
    runs are as dead: theirs and their in-process parents'."""
    active = {run.id: run for run in _flow_runs(client, states=UNFINISHED)}
    why = {
        run.id: f"its process ({_pid(run.labels[PROCESS_LABEL])}) ended without reporting: it was killed (SIGKILL, "
        "the out-of-memory killer, a preempted node)"
        for run in active.values()
        if isinstance(run.labels.get(PROCESS_LABEL), str) and process_gone(run.labels[PROCESS_LABEL])
    }
    owners = set(why)
    if not why:
        return active, why, owners
    parents = _in_process_parents(client, list(active.values()))
    changed = True
    while changed:  # one process ran a subflow and its parent: a dead one's relatives are dead too
        changed = False
        for child, parent in parents.items():
            for dead, other in ((child, parent), (parent, child)):
                if dead in why and other not in owners:
                    owners.add(other)
                    changed = True
                    if other in active:
                        why[other] = f"the process that ran it and flow run {active[dead].name} is gone: {why[dead]}"
    return active, why, owners


def _tasks_of_runner_crashed_runs(client: SyncPrefectClient) -> list[TaskRun]:
    """Unfinished task runs of Crashed flow runs whose labelled process is gone (a served run whose process the runner
    saw die: it marks the flow run Crashed, not its task runs)."""
    tasks = _all(
        client.read_task_runs,
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CRASHED]))),
        task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED_TASK))),
    )
    if not tasks:
        return []
    owners = {run.id: run for run in _flow_runs(client, ids={task.flow_run_id for task in tasks})}
    return [
        task
        for task in tasks
        if (owner := owners.get(task.flow_run_id)) is not None
        and isinstance(owner.labels.get(PROCESS_LABEL), str)
        and process_gone(owner.labels[PROCESS_LABEL])
    ]


def _crash_task_run(client: SyncPrefectClient, task: TaskRun, message: str, leases_lost: bool) -> None:
    """Crashed; a Running task run's tag slots released where its server's lease died with that server."""
    was_running = task.state_type == StateType.RUNNING
    client.set_task_run_state(task.id, Crashed(message=message), force=True)
    if was_running and leases_lost and task.tags:
        started = task.start_time or datetime.now(timezone.utc) - timedelta(seconds=1)
        held = max((datetime.now(timezone.utc) - started).total_seconds(), 1.0)
        client.release_concurrency_slots(
            names=[f"tag:{tag}" for tag in sorted(task.tags)], slots=1, occupancy_seconds=held
        )


def crash_dead_runs_with(client: SyncPrefectClient, found_by: str) -> list[CrashedRun]:
    """Mark Crashed the flow runs (and their task runs) whose process is gone, and release the tag slots held by
    their Running task runs; `found_by` (the flow run or command that looked) goes into the state messages."""
    active, why, owners = _dead_flow_runs(client)
    tasks = (
        _all(
            client.read_task_runs,
            task_run_filter=TaskRunFilter(
                flow_run_id=TaskRunFilterFlowRunId(any_=list(owners)),
                state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED_TASK)),
            ),
        )
        if owners
        else []
    )
    tasks += [task for task in _tasks_of_runner_crashed_runs(client) if task.id not in {t.id for t in tasks}]
    owner_runs = {run.id: run for run in _flow_runs(client, ids={t.flow_run_id for t in tasks})} if tasks else {}
    for task in tasks:
        owner = owner_runs.get(task.flow_run_id)
        name = owner.name if owner else task.flow_run_id
        leases_lost = owner is not None and owner.labels.get(SERVER_LABEL) == TEMPORARY
        _crash_task_run(
            client,
            task,
            f"its flow run {name} crashed: {why.get(task.flow_run_id, 'its process is gone')}; marked by {found_by}",
            leases_lost,
        )
    crashed = []
    for run_id, reason in why.items():
        message = f"{reason}; marked by {found_by}"
        client.set_flow_run_state(run_id, Crashed(message=message), force=True)
        crashed.append(CrashedRun(run_id, active[run_id].name, message))
    return crashed


def _lock():
    """Runs on temporary servers release slots themselves: one process of this Prefect home at a time looks (two
    finding the same task run would release its slots twice)."""
    return stage_lock(Path(PREFECT_HOME.value()) / "crashed-runs")


def check_in() -> list[CrashedRun]:
    """At the start of a flow run: label it with this process (`PROCESS_LABEL`, `SERVER_LABEL`), then mark Crashed the
    runs whose process is gone (`crash_dead_runs_with`), logged as warnings. A problem here never fails the run."""
    from prefect import get_run_logger

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return []
    logger = get_run_logger()
    shared, every = server_label() != TEMPORARY, get_current_settings().flows.heartbeat_frequency
    if shared and every is not None and every > HEARTBEAT_S:
        logger.warning(
            "this flow run sends a heartbeat every %s s, and the server's automation '%s' marks Crashed a run without "
            "one for %s s: set PREFECT_FLOWS_HEARTBEAT_FREQUENCY=%s where its process starts (prefect.yaml does for a "
            "worker's runs)",
            every,
            ZOMBIE_AUTOMATION,
            ZOMBIE_AFTER_S,
            HEARTBEAT_S,
        )
    try:
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(
                context.flow_run.id, {PROCESS_LABEL: process_label(), SERVER_LABEL: server_label()}
            )
            with _lock():
                crashed = crash_dead_runs_with(client, f"flow run {context.flow_run.name}")
                if shared and every is not None and every <= HEARTBEAT_S:
                    ensure_zombie_automation()  # a run whose machine dies is marked Crashed by the server
    except Exception as err:  # noqa: BLE001 (bookkeeping: the run itself goes on)
        logger.warning("could not look for flow runs of killed processes: %s", err)
        return []
    for run in crashed:
        logger.warning("flow run %s marked Crashed: %s", run.name, run.message)
    return crashed


def crash_dead_runs(command: str) -> list[CrashedRun]:
    """`crash_dead_runs_with` outside a flow (a command's main(), before its flow starts the temporary server: this
    starts it), each one a line on stderr. Skipped when PREFECT_API_URL names a server that does not answer (the
    command says so)."""

    if prefect_api_problem(timeout=2.0) is not None:
        return []
    try:
        with get_client(sync_client=True) as client, _lock():
            crashed = crash_dead_runs_with(client, f"{command} (pid {os.getpid()})")
    except Exception as err:  # noqa: BLE001
        print(f"warning: could not look for flow runs of killed processes: {err}", file=sys.stderr)
        return []
    for run in crashed:
        print(f"flow run {run.name} marked Crashed: {run.message}", file=sys.stderr)
    return crashed


# -- Served runs: heartbeats --------------------------------------------------------------------------------------


def zombie_automation() -> Any:
    """Prefect's documented zombie-run detection: an automation that marks Crashed a flow run whose heartbeats (every
    HEARTBEAT_S seconds: flows/__init__.py, prefect.yaml, flows/serve.py) stop for ZOMBIE_AFTER_S seconds before it
    ends."""
    from prefect.automations import Automation
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    ends = {f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")}
    return Automation(
        name=ZOMBIE_AUTOMATION,
        description=f"A flow run whose heartbeats stopped for {ZOMBIE_AFTER_S} s (its process was killed) is marked "
        "Crashed (flows/crashed_runs.py); its unfinished task runs are marked by the next pipeline run.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *ends},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=ZOMBIE_AFTER_S),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {ZOMBIE_AFTER_S} s: its process ended without reporting (killed)",
            )
        ],
    )


def ensure_zombie_automation() -> bool:
    """Create `zombie_automation` on the Prefect server (PREFECT_API_URL) unless it is there; True when created."""
    from prefect.automations import Automation

    try:
        Automation.read(name=ZOMBIE_AUTOMATION)
        return False
    except ValueError:  # not there yet
        zombie_automation().create()
        return True
