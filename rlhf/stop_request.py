"""A command's stop, seen by every thread: SIGINT and SIGTERM interrupt only the main thread, while a sweep's
variants train in worker threads. The command's signal handler calls `request_stop`; the trainers call
`raise_if_stop_requested` at every step, which raises `StopRequested` in any other thread, so a stopped sweep ends
within a step, not after its running stages."""

from __future__ import annotations

import threading

from rlhf.errors import StopRequested

_requested = threading.Event()


def request_stop() -> None:
    """The command was asked to stop (its signal handler calls this)."""
    _requested.set()


def clear_stop_request() -> None:
    """Forget a stop request (a test that asked for one)."""
    _requested.clear()


def raise_if_stop_requested(where: str) -> None:
    """Raise `StopRequested` in a thread other than the main one once a stop was requested (the main thread was
    interrupted by the signal itself). `where` names the stage and step, for the message."""
    if _requested.is_set() and threading.current_thread() is not threading.main_thread():
        raise StopRequested(f"stop requested: {where} ended in a worker thread")
