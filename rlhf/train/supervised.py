"""The supervised training loop shared by SFT (`rlhf.train.sft`) and the reward model (`rlhf.train.reward`).

The loop owns what both trainers do the same way: the seeded shuffled batch order, resume from the saved state
(``checkpoints.load_trainer_state``), backward, gradient clipping, the non-finite check (``runtime.on_nonfinite``),
optimizer and scheduler steps, the periodic resume state and `stop_after`. The stage gives a per-step callback
(its forward pass and statistics) and, optionally, what to do after each step and what else to save.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from rlhf.checkpoints import load_trainer_state, save_trainer_state
from rlhf.errors import TrainingInterrupted
from rlhf.nonfinite import skip_nonfinite
from rlhf.stages import Stage
from rlhf.stop_request import raise_if_stop_requested
from rlhf.tracking.metrics_writer import LogFn, flush_log

MAX_GRAD_NORM = 1.0


class StepOutput(NamedTuple):
    """What a stage's step callback returns: the loss to differentiate and the step's statistics so far."""

    loss: Tensor  # scalar
    stats: dict[str, Any]  # the loop adds the gradient norm (under `LoopSettings.grad_norm_key`)


@dataclass
class StepEnd:
    """A finished step, handed to the stage's `after_step` callback."""

    step: int  # the number the step is logged under, counted from 1: the steps done, this one included
    loss: Tensor
    stats: dict[str, Any]  # the callback's statistics with the gradient norm
    skip: bool  # the optimizer step was skipped (non-finite loss or gradient norm)
    skipped: int  # steps skipped so far in this process


@dataclass
class LoopSettings:
    """What the loop needs to know of the stage."""

    stage: Stage  # rlhf.stages: its label names it in messages, its short name is the progress bar's
    prefix: str  # the namespace of its training metrics: <prefix>/loss, <prefix>/grad_norm, ... ("reward/train")
    total_steps: int
    batch_size: int
    n_rows: int  # rows of the training data; a batch is `batch_size` of their indices
    save_every: int
    on_nonfinite: str  # runtime.on_nonfinite
    progress: bool = True
    extra_fields: Callable[[], dict[str, Any]] = field(default=lambda: {})
    tensor_files: Callable[[], dict[str, dict[str, Tensor]] | None] = field(default=lambda: None)

    @property
    def checked(self) -> tuple[str, str]:
        """The statistics whose NaN or inf stops (or skips) a step: the loss and the gradient norm."""
        return f"{self.prefix}/loss", f"{self.prefix}/grad_norm"


def run_supervised(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng: random.Random,
    state_dir: str | Path,
    device: torch.device,
    settings: LoopSettings,
    step_fn: Callable[[list[int]], StepOutput],
    log: LogFn,
    after_step: Callable[[StepEnd], None] | None = None,
    on_resume: Callable[[dict[str, Any]], None] | None = None,
    stop_after: int | None = None,
) -> int:
    """Run the optimizer steps not done yet; returns how many were skipped for a non-finite value.

    The state saved in `state_dir` (weights, optimizer, scheduler, RNGs, data order, step and the stage's
    `extra_fields`) is restored first (`on_resume` gets its fields) and written atomically every
    `save_every` steps; `stop_after` ends training after that many steps, as a crash would, with
    `TrainingInterrupted`. A non-finite statistic among `checked` stops with `NonFiniteError` (after `log`ging
    the step's statistics) or, with ``on_nonfinite: skip_update``, skips that optimizer step.
    """
    state_dir = Path(state_dir)
    total = settings.total_steps
    order: list[int] = []
    first = 0
    saved = load_trainer_state(state_dir, model, optimizer, scheduler, rng, device)
    if saved is not None:  # resume: same config, continue where the last save left off
        order, first = list(saved["order"]), int(saved["step"])
        if on_resume is not None:
            on_resume(saved)
    skipped = 0
    bar = tqdm(
        range(first, total),
        desc=settings.stage.short,
        disable=not settings.progress,
        mininterval=2,
        initial=first,
        total=total,
    )
    for index in bar:
        step = index + 1  # every stage counts its steps from 1
        raise_if_stop_requested(f"{settings.stage.label} training at step {step}")
        if len(order) < settings.batch_size:
            order = list(range(settings.n_rows))
            rng.shuffle(order)
        rows = order[: settings.batch_size]
        order = order[settings.batch_size :]
        out = step_fn(rows)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        stats = {**out.stats, f"{settings.prefix}/grad_norm": float(grad_norm)}
        skip = skip_nonfinite(stats, settings.stage.label, step, settings.on_nonfinite, log, settings.checked)
        skipped += skip
        if skipped:  # from the first skipped step on: how many this process skipped
            stats[f"{settings.prefix}/skipped_nonfinite"] = float(skipped)
        if not skip:
            optimizer.step()
        scheduler.step()
        if after_step is not None:
            after_step(StepEnd(step, out.loss, stats, skip, skipped))
        if step < total and (step % settings.save_every == 0 or step == stop_after):
            fields = {"step": step, "order": order, **settings.extra_fields()}
            flush_log(log)  # every step up to a saved state is in the store
            save_trainer_state(state_dir, model, optimizer, scheduler, rng, fields, settings.tensor_files())
        if step == stop_after and step < total:
            raise TrainingInterrupted(
                f"{settings.stage.label} training stopped after {step} steps (stop_after); state saved"
            )
    return skipped
