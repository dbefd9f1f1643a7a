"""The callables the library's trainers and evaluation take from their caller (no tracking backend here)."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

LogFn = Callable[[dict[str, float], int], None]
"""``log(metrics, step)``: record a step's statistics (the flows pass `Tracker.metric_logger`)."""

GoldFn = Callable[[str, str, str | None], float]
"""``gold(prompt, response, row)``: the task's gold reward of a response, where the task has one (synthetic data, or
data.gold_reward, which reads the row's columns by its key `row`: ``rlhf.rollout.rows``)."""

StepRecord = tuple[dict[str, float], int, float]
"""``(metrics, step, time)``: one logged step, with the time (``time.time()``) it was logged at."""

logger = logging.getLogger(__name__)
WRITER_THREAD = "metrics-writer"  # the name of `BatchedLog`'s writer threads


class BatchedLog:
    """A `LogFn` that writes the steps it is given in batches: the first step at once, then all the steps of every
    `every_s` seconds together (`write` gets them in order, each with the time it was logged at), and what is left
    on `flush()`. `also` (e.g. a progress display) sees every step as it comes.

    With `background`, a writer thread of its own does the writing: the caller's `log(metrics, step)` only queues
    the step, and the writer wakes every `every_s` seconds. A failed background write keeps its steps and stops
    the writer; the caller's next `log` or `flush()` writes them again itself, and raises the error if it fails
    again (a write of the caller's own thread raises at once).

    Writing one step at a time costs a store transaction per step (an MLflow SQLite store: ~15 ms for PPO's 70-odd
    statistics); a batch of steps costs much less per step. Nothing is dropped: the trainers flush before they save
    a resume state (`flush_log`), so every step up to a saved state is written, the owner flushes (`close()`) at
    the end, and the process flushes the loggers still open when it exits normally. Not MLflow's own asynchronous
    logging (``synchronous=False``, MLflow 3.17): it drops a batch whose write failed, where this one keeps it."""

    def __init__(
        self,
        write: Callable[[list[StepRecord]], None],
        every_s: float,
        also: LogFn | None = None,
        background: bool = False,
    ) -> None:
        self.write, self.every_s, self.also, self.background = write, every_s, also, background
        self.pending: list[StepRecord] = []
        self.last_write = float("-inf")
        self.error: BaseException | None = None  # a background write's, raised by the next log or flush
        self._lock = threading.Lock()  # `pending` and `error`
        self._writing = threading.Lock()  # one write at a time: batches are written in order
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        if self.error is not None:  # a background write failed: written again here, or its error raised here
            self.flush()
        with self._lock:
            self.pending.append((dict(metrics), step, time.time()))
        if self.background:
            self._start_writer()
        elif time.monotonic() - self.last_write >= self.every_s:
            self.flush()
        if self.also is not None:
            self.also(metrics, step)

    def flush(self) -> None:
        """Write every step logged so far, in the caller's thread (after the write the writer thread is doing, if
        any). A failed background write's steps are written again here; if they cannot be, the error is raised."""
        try:
            self._write_pending()
        except BaseException:
            with self._lock:
                self.error = None  # raised here; the steps are kept for the next try
            raise
        with self._lock:
            error, self.error = self.error, None
        if error is not None:
            logger.warning("a background metrics write failed (%s); its steps were written again", error)

    def close(self) -> None:
        """Flush, and stop the writer thread (a later step starts it again)."""
        self._closed = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._closed, self._thread = False, None
        self._wake.clear()
        self.flush()

    def _write_pending(self) -> None:
        with self._writing:
            with self._lock:
                pending, self.pending = self.pending, []
            self.last_write = time.monotonic()
            if not pending:
                return
            try:
                self.write(pending)
            except BaseException:
                with self._lock:
                    self.pending[:0] = pending  # kept, in order, for the next try
                raise

    def _start_writer(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run_writer, name=WRITER_THREAD, daemon=True)
            _OPEN.add(self)
            self._thread.start()

    def _run_writer(self) -> None:
        while True:
            try:
                self._write_pending()
            except BaseException as err:  # noqa: BLE001 (handed to the caller's thread: its next log or flush)
                with self._lock:
                    self.error = err
                return  # written again by the caller's next flush, or a new writer after its next step
            if self._closed or self._wake.wait(self.every_s) and self._closed:
                return


_OPEN: weakref.WeakSet[BatchedLog] = weakref.WeakSet()  # background loggers: flushed when the process exits


@atexit.register
def _flush_open_loggers() -> None:
    for log in list(_OPEN):
        try:
            log.close()
        except Exception:  # noqa: BLE001, S110 (exiting: the owner that should have closed it is gone)
            pass


def flush_log(log: LogFn | None) -> None:
    """Write the steps a batching `log` still holds (a no-op for a plain function): before a resume state is saved."""
    flush = getattr(log, "flush", None)
    if flush is not None:
        flush()
