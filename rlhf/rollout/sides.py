"""Two sides of a step side by side on a CPU: the policy's in the calling thread, the value (or reward) model's, or a
second half of the policy's work, on one worker thread (`run_sides`); the scoring phase (`rlhf.rollout.scoring`)
and the optimisation phase (`rlhf.ppo.optimise`) share that worker."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

P = TypeVar("P")
V = TypeVar("V")

_VALUE_THREAD: ThreadPoolExecutor | None = None


def value_thread() -> ThreadPoolExecutor:
    """The one worker of the CPU's second thread, created on first use."""
    global _VALUE_THREAD
    if _VALUE_THREAD is None:
        _VALUE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhf-value")
    return _VALUE_THREAD


def run_sides(policy_side: Callable[[], P], value_side: Callable[[], V], second_thread: bool) -> tuple[P, V]:
    """`policy_side()` and `value_side()`: with `second_thread`, the value side on `value_thread()` while the policy
    side runs in this thread (the two touch disjoint models and tensors); else one after the other, policy first."""
    if not second_thread:
        return policy_side(), value_side()
    future = value_thread().submit(value_side)
    first = policy_side()
    return first, future.result()
