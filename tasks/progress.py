"""What a running task shows in Prefect: progress artifacts (bars in the UI) and lines in the task run's log."""

from __future__ import annotations

import logging
import re
import time

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.exceptions import MissingContextError

from rlhf.metrics import OBJECTIVE_GOLD, OBJECTIVE_KL, OBJECTIVE_KL_COEF, OBJECTIVE_RLHF_REWARD, OBJECTIVE_SCORES


def task_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect task run's logger (lines in the task's log), or this module's outside a run."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


class ProgressBar:
    """A progress artifact (a bar in the Prefect UI) of the current flow or task run. Writing it never fails the
    run: an API error is a warning in the run's log and the bar stops moving."""

    def __init__(self, description: str) -> None:
        self.artifact_id = None
        try:
            self.artifact_id = create_progress_artifact(0.0, description=description)
        except Exception as err:  # noqa: BLE001
            get_run_logger().warning("could not write the progress artifact '%s': %s", description, err)

    def set(self, percent: float, description: str) -> None:
        if self.artifact_id is None:
            return
        try:
            update_progress_artifact(self.artifact_id, percent, description=description)
        except Exception as err:  # noqa: BLE001
            get_run_logger().warning("could not update the progress artifact '%s': %s", description, err)


# The numbers a user watches while a training stage runs, per stage: (metric key, label), in the order shown. A value
# is the last one logged (the reward model's held-out accuracy is measured every `reward.eval_every` steps only).
WATCHED = {
    "ppo": (
        (OBJECTIVE_SCORES, "score"),
        (OBJECTIVE_KL, "KL"),
        (OBJECTIVE_KL_COEF, "KL coef"),
        (OBJECTIVE_GOLD, "gold"),
        (OBJECTIVE_RLHF_REWARD, "RLHF reward"),
    ),
    "reward": (
        ("reward/train/loss", "loss"),
        ("reward/eval/accuracy", "held-out acc"),
        ("reward/train/accuracy", "train acc"),
    ),
    "sft": (("sft/loss", "loss"), ("sft/lr", "lr")),
}


def watched_text(stage: str, values: dict[str, float]) -> str:
    """'score 0.41, KL 1.2, KL coef 0.05, gold 0.33': the stage's watched numbers that are known, in order."""
    shown = [f"{label} {values[key]:.4g}" for key, label in WATCHED.get(stage, ()) if key in values]
    return ", ".join(shown)


class StepProgress:
    """The progress bar of a training task, advanced as steps are logged: at most one update every
    `min_interval` seconds, plus the last step. Its text, '<name>: step 20 of 30; ...' (`name`: what ran, 'GRPO' for
    the policy stage of a GRPO run; the stage's short name by default), carries the stage's watched numbers
    (`WATCHED`).

    Each update is a request to the Prefect API that the training thread waits for (and work for the server
    process, which shares the machine): hence the interval, not one request per step."""

    def __init__(self, stage: str, total: int, min_interval: float = 10.0, name: str | None = None) -> None:
        self.stage, self.total, self.min_interval = stage, max(1, total), min_interval
        self.name = name or stage
        self.last_update = 0.0
        self.values: dict[str, float] = {}
        self.bar = ProgressBar(f"{self.name}: step 0 of {self.total}")

    def update(self, step: int, metrics: dict[str, float] | None = None) -> None:
        self.values |= {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}
        now = time.monotonic()
        if now - self.last_update < self.min_interval and step < self.total:
            return
        self.last_update = now
        done = min(step, self.total)
        numbers = watched_text(self.stage, self.values)
        text = f"{self.name}: step {done} of {self.total}" + (f"; {numbers}" if numbers else "")
        self.bar.set(100.0 * done / self.total, text)


def progress_logger(stage: str, every: int, total: int | None = None, name: str | None = None):
    """Echo the stage's watched numbers (`WATCHED`: PPO's score, KL, KL coefficient and gold score; the reward
    model's loss and held-out accuracy; SFT's loss) to the Prefect run's log every `every` steps, as last known; with
    `total`, also advance a progress artifact of the task that shows them. The lines read '<name> step 20 of 30: ...'
    (`name`: what ran, the objective's label for the policy stage; the stage's short name by default)."""
    logger = get_run_logger()
    name = name or stage
    progress = StepProgress(stage, total, name=name) if total else None
    known: dict[str, float] = {}
    shown_steps: set[int] = set()

    def log(metrics: dict[str, float], step: int) -> None:
        known.update({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        due = step % every == 0 or (total is not None and step >= total)
        if due and step not in shown_steps:  # a trainer's final metrics come at its last step again: one line
            shown_steps.add(step)
            shown = watched_text(stage, known) or ", ".join(f"{k}={v:.4g}" for k, v in list(metrics.items())[:6])
            logger.info("%s step %d%s: %s", name, step, f" of {total}" if total else "", shown)
        if progress is not None:
            progress.update(step, metrics)

    return log


STAT = re.compile(r"([\w/.]+)=([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))")


def line_stats(line: str) -> dict[str, float]:
    """The ``key=value`` numbers of a printed line: 'ppo update 3: objective/kl=0.12, ...' -> {'objective/kl': 0.12}."""
    return {key: float(value) for key, value in STAT.findall(line)}


def echo_with_progress(stage: str, total: int, pattern: str, name: str | None = None):
    """For a child command's output (data-parallel PPO): each line goes to the task's log, and lines matching
    `pattern` advance a progress artifact to the step they name, with the ``key=value`` numbers they print (the
    stage's watched numbers, as in a single process)."""
    logger, progress, step_line = get_run_logger(), StepProgress(stage, total, name=name), re.compile(pattern)

    def echo(line: str) -> None:
        logger.info("%s", line)
        if match := step_line.match(line):
            progress.update(int(match.group(1)), line_stats(line[match.end() :]))

    return echo
