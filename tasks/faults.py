"""Failures: the fault injection of tests and drills, and which failures a stage task retries."""

from __future__ import annotations

import os
from pathlib import Path

from prefect.states import State

from rlhf.errors import CheckpointWriteError, NonFiniteError, TrialPruned, UserInputError


def injected_failure(stage: str, folder: Path) -> int | None:
    """Fault injection for tests and drills: ``RLHF_INJECT_FAILURE=train_policy_ppo:2`` makes the first attempt
    of that stage stop (raise) after 2 updates, once; the retry then resumes from the saved state."""
    name, _, after = os.environ.get("RLHF_INJECT_FAILURE", "").partition(":")
    marker = folder / ".failure_injected"
    if name != stage or not after or marker.exists():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(after)
    return int(after)


def retry_unless_user_error(task, task_run, state: State) -> bool:
    """Retry crashes and lost resources; never a bad config or bad data, a NaN loss (the same steps would give it
    again), a full disk (it stays full for the next seconds) or a pruned trial (`rlhf.errors.TrialPruned`, stopped
    on purpose): a rerun after a change resumes from the last saved state."""
    try:
        state.result()
    except (UserInputError, NonFiniteError, CheckpointWriteError, TrialPruned):
        return False
    except Exception:
        return True
    return True
