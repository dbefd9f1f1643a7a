"""The warning of a stage that waits on a concurrency slot no running task holds (tasks/slot_watch.py), against a
Prefect test harness: a real flow whose `gpu`-tagged task waits on the `tag:gpu` limit. A slot taken without a lease
(what a restart of a server that kept its leases in memory leaves) gets one WARNING line, and the command it names
frees the slot; a slot a lease holds, or an orphaned slot while the stage itself runs, gets none."""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.settings import PREFECT_API_URL

import tasks.slot_watch as slot_watch
from tasks.slot_watch import watch_slots
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("harness")

STAGE = "slot-watch-stage"
EVERY_S = 1.0  # not shorter: a stage between its slot and its Running state still waits, for one check
let_go = threading.Event()  # the stage's body returns once it is set


@task(name=STAGE, tags=["gpu"])
def _stage() -> str:
    let_go.wait(120)
    return "ran"


@flow(name="slot-watch-flow")
def _pipeline(logger_name: str) -> str:
    with watch_slots(STAGE, {"gpu"}, logging.getLogger(logger_name), every_s=EVERY_S):
        return _stage()


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def watched(request, monkeypatch):
    """A logger the watch writes to (its lines), the count of the watch's checks, and the flow started in a thread
    (`start()`; `result()` joins it)."""
    name = f"test-slot-watch-{request.node.name}"
    lines = Lines()
    logging.getLogger(name).addHandler(lines)
    checks = []
    original = slot_watch.orphaned_slots
    monkeypatch.setattr(slot_watch, "orphaned_slots", lambda tags: checks.append(1) or original(tags))
    outcome: dict = {}

    def start() -> None:
        let_go.clear()
        thread = threading.Thread(target=lambda: outcome.update(result=_pipeline(name)), daemon=True)
        thread.start()
        outcome["thread"] = thread

    def result() -> str:
        outcome["thread"].join(120)
        return outcome["result"]

    yield {"lines": lines.lines, "checks": checks, "start": start, "result": result}
    let_go.set()
    logging.getLogger(name).removeHandler(lines)


def gpu_limit(slots: int, taken: int) -> None:
    """The `tag:gpu` limit with `slots` slots, `taken` of them taken without a lease (no holder)."""
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="gpu", concurrency_limit=slots)
        limit = client.read_global_concurrency_limit_by_name("tag:gpu")
        assert limit.limit == slots
        client.update_global_concurrency_limit("tag:gpu", GlobalConcurrencyLimitUpdate(active_slots=taken))


def wait_for(check, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_stage_waiting_on_a_slot_no_task_holds_warns_once_with_the_command_that_frees_it(watched):
    gpu_limit(slots=1, taken=1)
    watched["start"]()
    wait_for(lambda: watched["lines"])
    (line,) = watched["lines"]
    assert line.startswith("WARNING ") and "\n" not in line, line
    assert f"stage {STAGE} has waited" in line and "'tag:gpu'" in line and "1 of its 1 slot(s) are taken" in line
    command = re.search(r"free them with: (prefect .*)$", line).group(1)
    assert command == "prefect global-concurrency-limit update tag:gpu --active-slots 0"
    # the command as the warning gives it, run against this server, frees the slot: the stage runs and ends
    let_go.set()
    env = os.environ | {"PREFECT_API_URL": PREFECT_API_URL.value()}
    argv = shlex.split(command)
    done = subprocess.run(
        [str(Path(sys.executable).parent / argv[0]), *argv[1:]], cwd=REPO, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert watched["result"]() == "ran"
    assert len(watched["lines"]) == 1


def test_a_slot_held_by_a_lease_is_waited_on_without_a_warning(watched):
    gpu_limit(slots=1, taken=0)
    with get_client(sync_client=True) as client:
        holder = ConcurrencyLeaseHolder(type="task_run", id="00000000-0000-0000-0000-000000000001")
        lease = client.increment_concurrency_slots_with_lease(["tag:gpu"], 1, "concurrency", 300, holder)
        watched["start"]()
        wait_for(lambda: len(watched["checks"]) >= 5 or watched["lines"])  # the stage still waits: the slot is held
        assert watched["lines"] == []
        let_go.set()
        client.release_concurrency_slots_with_lease(lease.json()["lease_id"])
    assert watched["result"]() == "ran"
    assert watched["lines"] == []


def test_an_orphaned_slot_says_nothing_while_the_stage_runs_on_another(watched):
    """Limit 2, one slot orphaned: the stage gets the other and runs; the limit is full with a slot no lease holds,
    but this stage does not wait on it."""
    gpu_limit(slots=2, taken=1)
    watched["start"]()
    wait_for(lambda: len(watched["checks"]) >= 5 or watched["lines"])
    assert watched["lines"] == []
    let_go.set()
    assert watched["result"]() == "ran"
    assert watched["lines"] == []
    gpu_limit(slots=1, taken=0)
