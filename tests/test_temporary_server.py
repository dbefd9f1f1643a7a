"""flows/temporary_server.py: the temporary Prefect server started before a command's slow imports is the one its
flow then reports to, in a session of its own; one stopped before any flow used it goes without a word."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import seed_prefect_home

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import os, sys
from flows.prefect_home import prepare_prefect_database
from flows.temporary_server import start_early, stop_early
from prefect.server.api.server import SubprocessASGIServer

prepare_prefect_database()
server = SubprocessASGIServer()

# a command that ends before its flow (a bad input): the server goes, quietly
assert start_early()
first = server.server_process
stop_early()
assert first.poll() is not None and server.server_process is None and not server.running

# a command that runs its flow: the flow's client waits for the early server and keeps it
assert start_early()
process, port = server.server_process, server.port
assert os.getsid(process.pid) == process.pid  # a session of its own: a terminal's Ctrl-C does not reach it

from prefect import flow, get_run_logger

@flow
def answer() -> int:
    get_run_logger().info("inside the flow")
    return 42

assert answer() == 42
assert server.running and server.server_process is process and server.port == port, (server.port, port)
assert process.poll() is None
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    (run,) = client.read_flow_runs()
    assert run.state.is_completed() and str(port) in str(client.api_url), client.api_url

# the server, stopped by SIGTERM at the end, does not print SQLAlchemy's pool-reset traceback (a cancelled rollback)
import subprocess
environ = dict(e.split("=", 1) for e in open(f"/proc/{process.pid}/environ").read().split(chr(0)) if "=" in e)
probe = (
    "import logging; from prefect.logging.configuration import setup_logging; setup_logging(); "
    "print(logging.getLogger('sqlalchemy.pool.impl.AsyncAdaptedQueuePool').isEnabledFor(logging.ERROR), "
    "logging.getLogger('prefect.server').isEnabledFor(logging.ERROR))"
)
probed = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True, text=True)
assert probed.stdout.split()[-2:] == ["False", "True"], probed.stdout + probed.stderr
print("ok", port)
"""


def test_an_early_server_is_the_flows_server_and_a_stopped_one_goes_quietly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env |= {"PREFECT_HOME": seed_prefect_home(tmp_path / "prefect"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("ok "), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("Starting temporary server") == 0  # Prefect did not start a second one


def test_no_early_server_where_the_command_has_a_prefect_server(tmp_path):
    code = "from flows.temporary_server import start_early; print(start_early())"
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
