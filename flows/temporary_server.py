"""The temporary Prefect server of a command run without one (PREFECT_API_URL unset).

Prefect starts it in a subprocess when the flow first talks to its API: seven seconds or so of imports and start-up
on a quiet 2-core machine, after the command's own ten seconds of importing torch, transformers, MLflow and the flow.
`start_early` starts it before those imports, so that the two overlap; the first Prefect client that asks for the
server then waits until it answers (`_ServerStart`) instead of starting one. The server runs in a session of its own
and dies with the command (`temporary_server_in_own_session`). `_ServerStart` polls ``/health`` itself: Prefect
3.9's `api_healthcheck()` needs a client, and a client without PREFECT_API_URL starts the server being started.
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SERVER_APP = "prefect.server.api.server:create_app"  # in the command line Prefect starts its temporary server with


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """Linux's prctl, looked up here, in the parent: a child of a process with threads must not load anything."""
    import ctypes

    try:
        return ctypes.CDLL(None).prctl
    except (OSError, AttributeError):  # pragma: no cover (not glibc)
        return None


def _die_with_parent() -> None:  # pragma: no cover (runs in the forked child)
    """In a child before it runs its program: SIGTERM when the thread that started it ends (PR_SET_PDEATHSIG)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(1, signal.SIGTERM)


@functools.cache
def _server_logging_settings() -> str | None:
    """Prefect's own logging settings file, with SQLAlchemy's connection-pool logger quiet, written once into
    PREFECT_HOME: the temporary server, stopped by SIGTERM when the command ends, at times cancels a connection's
    rollback and printed that as a 30-line traceback after the command's last line."""
    import yaml
    from prefect.logging.configuration import DEFAULT_LOGGING_SETTINGS_PATH
    from prefect.settings import PREFECT_HOME

    try:
        settings = yaml.safe_load(DEFAULT_LOGGING_SETTINGS_PATH.read_text())
        settings["loggers"]["sqlalchemy.pool"] = {"level": "CRITICAL"}
        path = Path(PREFECT_HOME.value()) / "temporary-server-logging.yml"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(yaml.safe_dump(settings, sort_keys=False))
        partial.replace(path)
    except (OSError, KeyError, TypeError, yaml.YAMLError):  # another layout or no place to write: Prefect's own
        return None
    return str(path)


class _OwnSessionSubprocess:
    """The `subprocess` module as Prefect's temporary server module sees it: a server started from the main thread
    gets a session of its own and dies with this process, and any temporary server logs with
    `_server_logging_settings` (unless the user set PREFECT_LOGGING_SETTINGS_PATH)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen:  # noqa: N802 (subprocess's name)
        command, env = kwargs.get("args", args[0] if args else ()), kwargs.get("env")
        if isinstance(env, dict) and _SERVER_APP in command and "PREFECT_LOGGING_SETTINGS_PATH" not in env:
            settings = _server_logging_settings()
            if settings is not None:
                kwargs["env"] = {**env, "PREFECT_LOGGING_SETTINGS_PATH": settings}
        if threading.current_thread() is threading.main_thread() and _prctl() is not None:
            kwargs.setdefault("start_new_session", True)
            kwargs.setdefault("preexec_fn", _die_with_parent)
        return subprocess.Popen(*args, **kwargs)


@functools.cache
def temporary_server_in_own_session() -> None:
    """Prefect's temporary server, started from the main thread, runs in a session of its own (a terminal's Ctrl-C
    does not stop it while the run still records its end in it) and gets SIGTERM when this process dies."""
    try:
        from prefect.server.api import server
    except ImportError:  # pragma: no cover (another Prefect layout: the server stays in the process group)
        return
    if isinstance(getattr(server, "subprocess", None), type(subprocess)):
        server.subprocess = _OwnSessionSubprocess()


class _ServerStart:
    """Stands in for the server object's `start` until the early-started server answers: the first caller waits for
    its health check as Prefect's own `start` does (the same time limit; a new port where the first was taken), then
    the server is Prefect's as if Prefect had started it. Where it does not come up, it is stopped and Prefect's own
    `start` runs, with its own error."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.lock = threading.Lock()

    def __call__(self, timeout: int | None = None) -> None:
        with self.lock:
            server = self.server
            if server.__dict__.get("start") is self:
                del server.start  # from here on Prefect's own method
                if not _wait_until_healthy(server, timeout):
                    server.server_process.kill()
                    server.server_process.wait()
                    server.server_process, server.running = None, False
            server.start(timeout)


def _wait_until_healthy(server: Any, timeout: int | None) -> bool:
    import httpx
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    deadline = time.monotonic() + (timeout or PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if server.server_process.poll() == 3:  # the port was taken in the meantime (Prefect's own rule)
                server.port = server.find_available_port()
                server.server_process = server._run_uvicorn_command()
                continue
            if server.server_process.poll() is not None:
                return False
            try:
                if client.get(f"{server.api_url}/health").status_code == 200:
                    server.running = True
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return False


def start_early() -> bool:
    """Start this process's temporary Prefect server now, in the background, where the command will need one (no
    PREFECT_API_URL) and Prefect's layout is the known one; whether it did. Call it from the main thread, after the
    database is prepared (`flows.prefect_home.prepare_prefect_database`) and before the slow imports."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return False
    try:
        from prefect.server.api.server import SubprocessASGIServer
    except ImportError:  # pragma: no cover (another Prefect layout: Prefect starts it when the flow begins)
        return False
    server = SubprocessASGIServer()
    layout = ("port", "running", "server_process", "api_url", "find_available_port", "stop")
    if server.running or server.server_process is not None or not all(hasattr(server, a) for a in layout):
        return False
    if not hasattr(server, "_run_uvicorn_command"):  # Prefect's own way of starting it, reused
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    temporary_server_in_own_session()
    if server.port is None:
        server.port = server.find_available_port()
    server.server_process = server._run_uvicorn_command()
    atexit.register(server.stop)
    server.start = _ServerStart(server)
    return True


def stop_early() -> None:
    """Stop a server `start_early` started that no Prefect client has used yet (the command ends before its flow:
    a bad input), without a word: the command's one line is its error."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if not isinstance(server.__dict__.get("start"), _ServerStart) or server.server_process is None:
        return
    del server.start
    server.server_process.kill()
    server.server_process.wait()
    server.server_process = None
