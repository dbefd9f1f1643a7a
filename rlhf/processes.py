"""Servers started as children of a command (`rlhf ui`, `rlhf serve`): each in a session of its own, stopped in
order on Ctrl-C or SIGTERM, with nothing left running; `rlhf serve`'s started again where one dies."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


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


# A server that died is started again after the first of these delays, after the next one if it dies again before it
# stayed up STABLE_S, and so on; after the last, its command gives up (a server that cannot stay up needs a person).
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)
STABLE_S = 120.0


@dataclass
class SupervisedServer:
    """A server that its command keeps up (`rlhf serve`): started in a session of its own, its output in `log`;
    where it dies, what is left of its processes is killed and it is started again, alone, after a back-off."""

    name: str  # as a sentence names it: "the MLflow server"
    cmd: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    deaths: int = 0  # in a row: since it last stayed up STABLE_S
    restart_at: float | None = None  # when a dead server is started again
    backoff_s: tuple[float, ...] = RESTART_BACKOFF_S

    def start(self, append: bool = False) -> subprocess.Popen:
        with open(self.log, "a" if append else "w") as out:
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started_at = time.monotonic()
        return self.proc

    def keep_up(self, say: Callable[[str], None]) -> str | None:
        """Once a second: note a death and schedule the restart, or restart it when its back-off is over, saying
        what happened through `say`. Returns the sentence that gives up after repeated deaths, else None."""
        assert self.proc is not None, "start() first"
        now = time.monotonic()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self.start(append=True)
                say(f"{self.name} started again (pid {self.proc.pid})")
            return None
        code = self.proc.poll()
        if code is None:
            if now - self.started_at >= STABLE_S:
                self.deaths = 0
            return None
        stop_group(self.proc, None, 0.0)  # its processes that outlived it (uvicorn's workers would keep the port)
        if self.deaths >= len(self.backoff_s):
            return (
                f"{self.name} stopped {self.deaths + 1} times in a row, the last with exit code {code}: see {self.log}"
            )
        delay = self.backoff_s[self.deaths]
        self.deaths += 1
        self.restart_at = now + delay
        say(
            f"{self.name} stopped with exit code {code} (see {self.log}); starting it again in {delay:.0f} s "
            f"(restart {self.deaths} of {len(self.backoff_s)} in a row)"
        )
        return None
