"""The callables the library's trainers and evaluation take from their caller (no tracking backend here)."""

from __future__ import annotations

import time
from collections.abc import Callable

LogFn = Callable[[dict[str, float], int], None]
"""``log(metrics, step)``: record a step's statistics (the flows pass `Tracker.metric_logger`)."""

GoldFn = Callable[[str, str], float]
"""``gold(prompt, response)``: the task's gold reward of a response, where the task has one (synthetic data)."""

StepRecord = tuple[dict[str, float], int, float]
"""``(metrics, step, time)``: one logged step, with the time (``time.time()``) it was logged at."""


class BatchedLog:
    """A `LogFn` that writes the steps it is given in batches: the first step at once, then all the steps of every
    `every_s` seconds together (`write` gets them in order, each with the time it was logged at), and what is left
    on `flush()`. `also` (e.g. a progress display) sees every step as it comes.

    Writing one step at a time costs a store transaction per step (an MLflow SQLite store: ~15 ms for PPO's 70-odd
    statistics); a batch of steps costs much less per step. Nothing is dropped: the trainers flush before they save
    a resume state (`flush_log`), so every step up to a saved state is written, and the owner flushes at the end."""

    def __init__(self, write: Callable[[list[StepRecord]], None], every_s: float, also: LogFn | None = None) -> None:
        self.write, self.every_s, self.also = write, every_s, also
        self.pending: list[StepRecord] = []
        self.last_write = float("-inf")

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        self.pending.append((dict(metrics), step, time.time()))
        if time.monotonic() - self.last_write >= self.every_s:
            self.flush()
        if self.also is not None:
            self.also(metrics, step)

    def flush(self) -> None:
        self.last_write = time.monotonic()
        if self.pending:
            pending, self.pending = self.pending, []
            self.write(pending)


def flush_log(log: LogFn | None) -> None:
    """Write the steps a batching `log` still holds (a no-op for a plain function): before a resume state is saved."""
    flush = getattr(log, "flush", None)
    if flush is not None:
        flush()
