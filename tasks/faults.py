"""Failures: the fault injection of tests and drills, which failures a stage task retries, and a Prefect server
that stayed busy through all of Prefect's tries of a stage's request."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES
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


class PrefectServerBusy(RuntimeError):
    """A request Prefect made for a stage (its concurrency slot, its states) that the server answered 503 (its
    database busy) or did not answer in time, at every one of Prefect's client's tries."""


def unanswered_request(err: BaseException) -> httpx.HTTPError | None:
    """The request to the Prefect server behind `err` (or behind the error it was raised from, as Prefect's
    ConcurrencySlotAcquisitionError is) that was answered 503 Service Unavailable or not answered in time."""
    seen: BaseException | None = err
    chain: list[BaseException] = []
    while seen is not None and seen not in chain:
        if isinstance(seen, httpx.HTTPStatusError) and seen.response.status_code == 503:
            return seen
        if isinstance(seen, httpx.TimeoutException):
            return seen
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def busy_server_in_one_sentence(stage: str) -> Iterator[None]:
    """Around the call of stage task `stage`: a request of Prefect's task engine (the stage's concurrency slot, its
    states) that the Prefect server kept answering 503 Service Unavailable (its SQLite database locked, on `make
    ui`'s server) or left unanswered, once Prefect's client has retried it, is raised again as one sentence that says
    what happened and what to do. The stage's own errors are in its state, not raised here."""
    try:
        yield
    except Exception as err:
        unanswered = unanswered_request(err)
        if unanswered is None:
            raise
        what = "did not answer in time" if isinstance(unanswered, httpx.TimeoutException) else "answered 503"
        try:
            request = f"{unanswered.request.method} {unanswered.request.url}"
        except RuntimeError:  # httpx: an error raised without its request
            request = "a request"
        raise PrefectServerBusy(
            f"stage {stage} stopped because the Prefect server {what} (its database busy) to all "
            f"{PREFECT_CLIENT_MAX_RETRIES.value() + 1} tries of {request}; start the run again "
            "(the stages that finished come from the cache), with fewer runs going at once on this server"
        ) from err
