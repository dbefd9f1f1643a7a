"""Ctrl-C on `make ui` with a served run going: the flow run ends Cancelled in Prefect (the user's stop), as the
terminal says, not Crashed (flows/terminal.py: `cancel_served_run`)."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from prefect import flow

from flows.terminal import SERVED_STOP, quiet_stop_in_served_run, served_stop_cancels


@flow(name="served-stop-check")
def stopped_by_ctrl_c(send: bool) -> str:
    quiet_stop_in_served_run()
    with served_stop_cancels():
        if send:
            os.kill(os.getpid(), signal.SIGINT)  # as make ui's Ctrl-C reaches the served run's process
        return "finished"


@pytest.fixture
def served(monkeypatch):
    """A deployment's flow run, as make ui serves it; SIGINT's handler and the console filters restored after."""
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "d")
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)
    for handler in logging.getLogger().handlers + logging.getLogger("prefect").handlers:
        handler.filters = [f for f in handler.filters if type(f).__name__ != "_QuietAfterStop"]
    from flows import terminal

    terminal._Served.quiet, terminal._Served.previous = None, signal.default_int_handler


@pytest.mark.xdist_group("harness")
def test_a_served_run_stopped_by_ctrl_c_ends_cancelled_not_crashed(harness, served):
    state = stopped_by_ctrl_c(send=True, return_state=True)
    assert state.type.value == "CANCELLED", state
    assert state.message.startswith(SERVED_STOP)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        stored = client.read_flow_run(state.state_details.flow_run_id).state
    assert stored.type.value == "CANCELLED" and stored.message.startswith(SERVED_STOP)


@pytest.mark.xdist_group("harness")
def test_a_served_run_that_is_not_stopped_completes(harness, served):
    assert stopped_by_ctrl_c(send=False, return_state=True).type.value == "COMPLETED"
