"""`rlhf serve`'s supervision of its servers (rlhf/processes.py, SupervisedServer), on real processes: one that dies
is started again alone, with what was left of its processes killed; one that keeps dying is given up in one sentence.
(The same with the real servers, the MLflow server killed mid-PPO: tests/test_team_servers.py.)"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rlhf.processes import SupervisedServer, stop_servers

# a "server": a process that starts a child of its own (as `mlflow server` starts uvicorn) and waits
SERVER = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"]


def keep_up_until(server: SupervisedServer, said: list[str], done: Callable[[], bool]) -> str | None:
    """`keep_up` once every 0.05 s (as `rlhf serve` does once a second) until `done()` or it gives up (60 s at most)."""
    deadline = time.monotonic() + 60
    while not done() and time.monotonic() < deadline:
        given_up = server.keep_up(said.append)
        if given_up is not None:
            return given_up
        time.sleep(0.05)
    assert done(), said
    return None


def children(proc) -> list[psutil.Process]:
    deadline = time.monotonic() + 30
    while not (found := psutil.Process(proc.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_a_server_that_dies_is_started_again_alone_with_its_leftover_processes_killed(tmp_path: Path):
    servers = [
        SupervisedServer(f"the {name} server", SERVER, dict(os.environ), tmp_path / f"{name}.log", backoff_s=(0.0, 0.0))
        for name in ("first", "second")
    ]
    first, second = servers
    try:
        for server in servers:
            server.start()
        (orphan,) = children(first.proc)
        other = second.proc.pid
        os.kill(first.proc.pid, signal.SIGKILL)  # the server alone: its child outlives it, as uvicorn's workers do
        dead, said = first.proc, []
        assert keep_up_until(first, said, lambda: first.proc is not dead) is None
        assert said == [
            f"the first server stopped with exit code -9 (see {tmp_path / 'first.log'}); starting it again in 0 s "
            "(restart 1 of 2 in a row)",
            f"the first server started again (pid {first.proc.pid})",
        ]
        assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE  # killed with its server
        assert first.proc.poll() is None and first.deaths == 1
        assert second.proc.pid == other and second.proc.poll() is None and second.keep_up(said.append) is None
        assert len(said) == 2  # the other server was left alone
    finally:
        stop_servers([server.proc for server in servers if server.proc is not None], 10)


def test_a_server_that_keeps_dying_is_given_up_in_one_sentence(tmp_path: Path):
    crashing = [sys.executable, "-c", "raise SystemExit(3)"]
    server = SupervisedServer("the crashing server", crashing, dict(os.environ), tmp_path / "log", backoff_s=(0.0, 0.0))
    server.start()
    said: list[str] = []
    given_up = keep_up_until(server, said, lambda: len(said) >= 10)
    assert (
        given_up == f"the crashing server stopped 3 times in a row, the last with exit code 3: see {tmp_path / 'log'}"
    )
    stopped, started = "the crashing server stopped with exit code 3", "the crashing server started again"
    assert [line.split(" (")[0] for line in said] == [stopped, started] * 2
