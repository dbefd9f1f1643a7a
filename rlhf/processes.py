"""Servers started as children of a command (`rlhf ui`, `rlhf serve`): each in a session of its own, stopped in
order on Ctrl-C or SIGTERM, with nothing left running."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class StopRequest:
    """SIGINT and SIGTERM, in the main thread, recorded rather than raised: the command's loop then stops its
    processes in order (Python's default would raise KeyboardInterrupt, or end the process at once on SIGTERM and
    leave the servers running). `what` names what is stopped, in the one line printed on the first signal."""

    def __init__(self, what: str = "the deployments and the servers") -> None:
        self.signum: int | None = None
        self.what = what
        self._event = threading.Event()
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            print(f"\n{signal.Signals(signum).name}: stopping {self.what} ...", flush=True)
        self._event.set()

    def wait(self, seconds: float) -> None:
        self._event.wait(seconds)

    @contextmanager
    def ignored(self) -> Iterator[None]:
        """While the processes are stopped: further signals are recorded only; the handlers before, restored after."""
        try:
            yield
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """`signum` to the process group of `proc` (a session of its own), while it runs."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


def stop_group(proc: subprocess.Popen, signum: int | None, seconds: float) -> None:
    """Send `signum` (None: none) to the group of `proc`, wait up to `seconds` for it, then SIGTERM its group and
    wait 5 s, then SIGKILL it; the group's other processes (a flow run of the serve process) get the same signals."""
    for sig, wait in ((signum, seconds), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        if sig is not None:
            signal_group(proc, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of its group (children that outlived it)
    except (ProcessLookupError, PermissionError):
        pass


def stop_servers(servers: Sequence[subprocess.Popen], seconds: float) -> None:
    """SIGTERM to every server's group at once, then up to `seconds` in all for them to stop (then SIGKILL)."""
    for proc in servers:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + seconds
    for proc in servers:
        stop_group(proc, None, max(0.1, deadline - time.monotonic()))
