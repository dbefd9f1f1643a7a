"""The callables the library's trainers and evaluation take from their caller (no tracking backend here)."""

from __future__ import annotations

from collections.abc import Callable

LogFn = Callable[[dict[str, float], int], None]
"""``log(metrics, step)``: record a step's statistics (the flows pass `Tracker.metric_logger`)."""

GoldFn = Callable[[str, str], float]
"""``gold(prompt, response)``: the task's gold reward of a response, where the task has one (synthetic data)."""
