"""Runs of killed processes marked Crashed (flows/crashed_runs.py), against a Prefect test harness: a sweep whose
process is gone (its flow run, its variant's subflow and their task runs), a served run the runner already marked
Crashed (its task run left Running), and a live run left alone; the slots the dead ones held released. The whole
story with a real pipeline killed by SIGKILL: tests/test_process_faults.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from uuid import UUID

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import ConcurrencyLeaseHolder, StateType
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
from prefect.states import Crashed, Running

from flows import HEARTBEAT_S
from flows.crashed_runs import (
    PROCESS_LABEL,
    SERVER_LABEL,
    TEMPORARY,
    ZOMBIE_AFTER_S,
    ZOMBIE_AUTOMATION,
    check_in,
    crash_dead_runs_with,
    ensure_zombie_automation,
    process_gone,
    process_label,
    zombie_automation,
)

pytestmark = pytest.mark.usefixtures("harness")


@flow(name="crash-test-flow")
def _flow() -> None:
    pass


@task(name="crash-test-task")
def _task() -> None:
    pass


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_process_gone_tells_a_dead_or_reused_pid_from_a_live_one():
    assert process_gone(process_label()) is False  # this process
    assert process_gone(f"{socket.gethostname()}:{_dead_pid()}:") is True
    host, pid, started = process_label().split(":")
    assert process_gone(f"{host}:{pid}:{float(started) - 100:.0f}") is True  # this pid, another process's start
    assert process_gone(f"another-host-{host}:{pid}:{started}") is None  # cannot be told from here
    assert process_gone("not a label") is None


def _running_flow_run(client, labels: dict[str, str] | None = None, parent_task_run_id: UUID | None = None):
    run = client.create_flow_run(_flow, parent_task_run_id=parent_task_run_id, state=Running())
    if labels:
        client.update_flow_run_labels(run.id, labels)
    return run


def _running_task_run(client, flow_run_id: UUID, key: str, tags: tuple[str, ...] = ()):
    return client.create_task_run(_task, flow_run_id, key, extra_tags=tags, state=Running())


def test_runs_of_a_killed_process_become_crashed_and_release_their_slots():
    dead = {PROCESS_LABEL: f"{socket.gethostname()}:{_dead_pid()}:", SERVER_LABEL: TEMPORARY}
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="gpu", concurrency_limit=3)
        # a sweep on a temporary server, killed: its flow run (not labelled), the task running a variant, the
        # variant's subflow (labelled) and its PPO stage holding a gpu slot (the lease died with that server)
        sweep = _running_flow_run(client)
        variant = _running_task_run(client, sweep.id, "variant")
        pipeline = _running_flow_run(client, dead, parent_task_run_id=variant.id)
        ppo = _running_task_run(client, pipeline.id, "ppo", ("gpu",))
        client.increment_concurrency_slots(names=["tag:gpu"], slots=1, mode="concurrency")
        # a served run whose process the runner saw die (flow run Crashed), its stage still Running on a lease
        served = _running_flow_run(client, {**dead, SERVER_LABEL: "http://127.0.0.1:4200/api"})
        served_stage = _running_task_run(client, served.id, "stage", ("gpu",))
        holder = ConcurrencyLeaseHolder(type="task_run", id=served_stage.id)
        client.increment_concurrency_slots_with_lease(["tag:gpu"], 1, "concurrency", 300, holder)
        client.set_flow_run_state(served.id, Crashed(message="Process exited with status code: -9"), force=True)
        # a run of this (live) process, holding a slot too
        live = _running_flow_run(client, {PROCESS_LABEL: process_label(), SERVER_LABEL: TEMPORARY})
        live_stage = _running_task_run(client, live.id, "stage", ("gpu",))
        client.increment_concurrency_slots(names=["tag:gpu"], slots=1, mode="concurrency")
        assert client.read_global_concurrency_limit_by_name("tag:gpu").active_slots == 3

        crashed = crash_dead_runs_with(client, "the test")

        assert {run.id for run in crashed} == {sweep.id, pipeline.id}
        for run_id in (sweep.id, pipeline.id):
            state = client.read_flow_run(run_id).state
            assert state.type == StateType.CRASHED and f"pid {dead[PROCESS_LABEL].split(':')[1]}" in state.message
            assert "marked by the test" in state.message
        for task_run in (variant, ppo, served_stage):
            assert client.read_task_run(task_run.id).state.type == StateType.CRASHED, task_run.name
        assert client.read_flow_run(live.id).state.type == StateType.RUNNING
        assert client.read_task_run(live_stage.id).state.type == StateType.RUNNING
        # the dead ones' slots (lost lease: released here; live lease: by the Crashed state), not the live one's
        assert client.read_global_concurrency_limit_by_name("tag:gpu").active_slots == 1
        assert crash_dead_runs_with(client, "the test again") == []  # nothing left, nothing released twice
        assert client.read_global_concurrency_limit_by_name("tag:gpu").active_slots == 1


def test_the_zombie_automation_is_prefects_documented_one_and_made_once():
    automation = zombie_automation()
    assert automation.trigger.posture == "Proactive" and automation.trigger.within.total_seconds() == 90
    assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
    assert automation.actions[0].state == StateType.CRASHED
    with get_client(sync_client=True) as client:  # another test's run may have made it on this harness
        for made in client.read_automations_by_name(ZOMBIE_AUTOMATION):
            client.delete_automation(made.id)
    assert ensure_zombie_automation() is True
    assert ensure_zombie_automation() is False
    with get_client(sync_client=True) as client:
        assert len(client.read_automations_by_name(ZOMBIE_AUTOMATION)) == 1


@flow(name="check-in-test-flow")
def _checking_in() -> None:
    check_in()


@pytest.mark.parametrize("every, watched", [(HEARTBEAT_S, True), (180, False)])
def test_a_run_on_a_server_is_watched_only_with_heartbeats_often_enough(caplog, every, watched):
    """The check-in of a run on a Prefect server creates the zombie automation when the run's heartbeats come every
    HEARTBEAT_S; slower ones (Prefect's default, 180 s) would be marked Crashed while alive: a warning says so, and
    the run creates no automation."""
    with get_client(sync_client=True) as client:
        for automation in client.read_automations_by_name(ZOMBIE_AUTOMATION):
            client.delete_automation(automation.id)
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: every}), caplog.at_level("WARNING"):
            _checking_in()
        assert len(client.read_automations_by_name(ZOMBIE_AUTOMATION)) == int(watched)
    warned = [r.getMessage() for r in caplog.records if "PREFECT_FLOWS_HEARTBEAT_FREQUENCY" in r.getMessage()]
    if watched:
        assert warned == []
    else:
        (message,) = warned
        assert "a heartbeat every 180 s" in message and f"without one for {ZOMBIE_AFTER_S} s" in message


def test_a_pid_label_is_this_process():
    host, pid, _ = process_label().split(":")
    assert (host, int(pid)) == (socket.gethostname(), os.getpid())


def test_a_resumed_flow_run_of_another_server_is_named_by_its_id(tmp_path, caplog):
    """A run that resumed the saved state of a flow run this server never had (killed under `make run`'s temporary
    server, resumed under make ui): the links name it by its id, and the log says why, without a warning."""
    from uuid import uuid4

    from flows.resumed_runs import resume_links
    from rlhf.tracking.client import Tracker
    from tasks.stage_runs import RESUMED_FROM_TAG
    from tasks.tracking import TrackingContext

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "resumed", str(tmp_path / "art"))
    earlier = str(uuid4())
    parent = tracker.start_run("pipeline", tags={RESUMED_FROM_TAG: earlier})
    context = TrackingContext(uri=uri, experiment="resumed", parent_run_id=parent)

    @flow(name="resumed-elsewhere")
    def resumed() -> dict[str, str]:
        return resume_links(context)

    links = resumed()
    assert links[RESUMED_FROM_TAG] == earlier and links[f"{RESUMED_FROM_TAG}_name"] == earlier
    said = [r.getMessage() for r in caplog.records if "resumed" in r.getMessage()]
    assert any(f"flow run {earlier}, which ran on another Prefect server" in m for m in said), said
    assert not any(r.levelname == "WARNING" and "could not name" in r.getMessage() for r in caplog.records)
