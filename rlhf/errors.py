"""Errors a user can cause (config, data, paths): raised early as one sentence, never retried."""


class UserInputError(ValueError):
    """Base class: retrying cannot fix these."""


class ConfigError(UserInputError):
    """A configuration that cannot be used; the message names the key."""


class DataError(UserInputError):
    """Preference data that cannot be used; the message names the file, column or row."""


class WarmStartError(UserInputError):
    """A warm start (warm_start.enabled) that kept none of its sampled responses; the message says how many it
    sampled and which keys to change. Its samples stay written in the stage's folder."""


class TrainingInterrupted(RuntimeError):
    """A trainer stopped on purpose after `stop_after` steps (resume tests and drills) with its state saved; a
    restart continues from it. Not a user error: a retry is what should happen next."""


class StopRequested(KeyboardInterrupt):
    """Ctrl-C or SIGTERM reached the command while this thread trained (a sweep's variants train in worker threads,
    which the signal does not interrupt): raised at the next step, so the thread unwinds as the main thread does,
    keeping the state saved so far (`rlhf.stop_request`)."""


class TrialPruned(Exception):
    """A PPO run stopped by its `on_eval` callback (e.g. an Optuna pruner after a periodic evaluation): neither a
    user error nor a failure to retry."""


def first_line(message: str | None, fallback: str, limit: int | None = None) -> str:
    """The first line of an error message (library errors can be pages long), `fallback` when it is empty; with
    `limit`, at most that many characters ('...' marks a cut)."""
    lines = (message or "").strip().splitlines()
    line = lines[0] if lines else fallback
    return line if limit is None or len(line) <= limit else line[: limit - 3] + "..."


class NonFiniteError(RuntimeError):
    """A trainer's loss or gradient norm became NaN or infinite (runtime.on_nonfinite: stop). The last saved state
    is kept, so a rerun resumes from it; an automatic retry would only repeat the same steps, so none is made."""


class CheckpointWriteError(OSError):
    """A checkpoint or stage output could not be written for lack of disk space; the previous one is intact."""
