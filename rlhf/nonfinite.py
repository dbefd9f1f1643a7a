"""The trainers' guard against NaN and infinite losses or gradient norms (runtime.on_nonfinite)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import Tensor

from rlhf.errors import NonFiniteError
from rlhf.tracking.metrics_writer import LogFn


def skip_nonfinite(
    stats: Mapping[str, Tensor | float],
    stage: str,
    step: int,
    mode: str,
    log: LogFn | None = None,
    keys: tuple[str, ...] | None = None,
) -> bool:
    """Whether to skip this optimizer step: False when the statistics named in `keys` (all when None) are finite.

    Otherwise, with `mode` "stop", log `stats` as they are (NaN included) through `log` and raise NonFiniteError
    in one sentence naming the stage, the step and the statistic, before the optimizer steps: the last saved state
    stays the resumable one. With "skip_update", return True: the caller drops the gradients and counts the skip.
    """
    values = {k: float(v.detach()) if isinstance(v, Tensor) else float(v) for k, v in stats.items()}
    bad = [k for k in keys or values if not math.isfinite(values[k])]
    if not bad:
        return False
    if mode == "skip_update":
        return True
    if log is not None:
        log(values, step)
    raise NonFiniteError(
        f"{stage} stopped at step {step}: {bad[0]} is {values[bad[0]]} (non-finite); the last saved state is kept and "
        "a rerun resumes from it (lower the learning rate, or set runtime.on_nonfinite: skip_update to skip such steps)"
    )
