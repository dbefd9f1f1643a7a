"""PPO's periodic evaluation (ppo.eval_every): the current policy on held-out prompts, scored by the reward model
(the proxy), the gold reward where the task has one, and the KL to the reference.

Every evaluation generates for the same prompts with the training sampling settings and a generator seeded the
same way each time, so the points of one run (and of runs with the same seed) are comparable. The KL is the
evaluation stage's ``eval/kl``: the sum over response tokens of ``logp_policy - logp_ref`` (k1), mean over prompts
(`rlhf.eval.responses.generate_and_score_prompts`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.checkpoints import atomic_file
from rlhf.config import PPOConfig
from rlhf.errors import TrialPruned
from rlhf.eval.overoptimisation import (
    ALARM_STEP_KEY,
    KEPT_STEP_KEY,
    OveroptimisationAlarm,
    ensemble_stats,
    response_stats,
    surprisal_stats,
)
from rlhf.eval.responses import generate_and_score_prompts
from rlhf.metrics import PERIODIC_EVAL, PERIODIC_GOLD, PERIODIC_KL, PERIODIC_SCORE, REWARD_FUNCTION_PREFIX
from rlhf.models.reward_ensemble import in_distribution_std
from rlhf.ppo import distributed
from rlhf.ppo.models import PPOModels
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.run import PolicyRun
from rlhf.rollout.generation import GenerationSettings

EVAL_SEED_OFFSET = 7919  # the evaluation generator's seed is the run's seed plus this (not the rollouts' stream)


def is_eval_step(step: int, cfg: PPOConfig) -> bool:
    """Whether the periodic evaluation runs after `step` updates: before the first, every `eval_every`, after the
    last."""
    return cfg.eval_every > 0 and (step == 0 or step % cfg.eval_every == 0 or step == cfg.num_updates)


def sqrt_kl(kl: float) -> float:
    """The square root of a KL estimate; a negative estimate (sampling noise next to the reference) counts as 0,
    and NaN stays NaN."""
    if kl > 0:
        return math.sqrt(kl)
    return 0.0 if kl <= 0 else kl


def evaluate_now(
    models: PPOModels, run: PolicyRun, plan: ExecutionPlan, settings: GenerationSettings
) -> dict[str, float]:
    """The periodic_eval/* metrics of the current policy on the run's held-out prompts (no value model needed: none
    is run)."""
    assert run.eval_prompts is not None
    gold_fn, cfg = run.gold_fn, run.cfg
    scoring = dataclasses.replace(models.scoring(), value=None)
    generator = torch.Generator(device=plan.device).manual_seed(run.seed + EVAL_SEED_OFFSET)
    frame = generate_and_score_prompts(
        scoring, run.eval_prompts, settings, cfg.max_prompt_tokens, cfg.batch_size, generator, plan.dtype,
        rows=run.eval_rows,
    )  # fmt: skip
    kl = float(frame["kl"].mean())
    metrics = {
        PERIODIC_SCORE: float(frame["score"].mean()),
        "periodic_eval/score_std": float(frame["score"].std(ddof=0)),
        PERIODIC_KL: kl,
        "periodic_eval/sqrt_kl": sqrt_kl(kl),
        "periodic_eval/length_mean": float(frame["length"].mean()),
    }
    signs = {**response_stats(frame["response"].tolist()), **surprisal_stats(frame)}
    signs |= ensemble_stats(frame, in_distribution_std(models.reward))
    metrics |= {f"{PERIODIC_EVAL}{key}": value for key, value in signs.items()}
    functions = (c for c in frame.columns if c.startswith(REWARD_FUNCTION_PREFIX))
    for column in functions:  # each reward function's own scores
        metrics[f"{PERIODIC_EVAL}{column}/mean"] = float(frame[column].mean())
        metrics[f"{PERIODIC_EVAL}{column}/std"] = float(frame[column].std(ddof=0))
    if gold_fn is not None:
        gold = [gold_fn(*row) for row in zip(frame["prompt"], frame["response"], frame["row"], strict=True)]
        metrics[PERIODIC_GOLD] = float(sum(gold) / len(gold))
    return metrics


ALARM_KEY = "periodic_eval/overoptimisation_alarm"  # 1 at the evaluation where the alarm fired, else 0
SIGN_KEY = "periodic_eval/overoptimisation_sign"  # 1 where the evaluation is not quiet (its policy is never kept)


def alarm_stats(metrics: dict[str, float]) -> dict[str, float]:
    """The alarm's inputs among an evaluation's periodic_eval/* metrics, without the prefix."""
    return {key.removeprefix(PERIODIC_EVAL): value for key, value in metrics.items() if key.startswith(PERIODIC_EVAL)}


@dataclass
class EvalGuard:
    """The over-optimisation alarm at the periodic evaluations, and what ppo.on_overoptimisation keeps: with 'stop'
    and 'keep_best' a copy (on the CPU) of the trained policy parameters at the last evaluation that shows no sign
    of the alarm, and with 'keep_best' the one with the best conservative score (the ensemble's minimum, the score
    without one). An evaluation shows a sign where the alarm's rule holds (fired or not yet confirmed), or where the
    SFT model's surprisal at the responses shows its evidence (`OveroptimisationAlarm.evidence`): a policy whose gold
    falls fast is often there one evaluation before the rule holds (docs/overoptimisation.md)."""

    mode: str  # ppo.on_overoptimisation
    alarm: OveroptimisationAlarm
    last_quiet: dict[str, torch.Tensor] | None = None  # the policy at the last evaluation the alarm passed
    best: dict[str, torch.Tensor] | None = None
    best_score: float = float("-inf")
    best_step: int = -1
    last_quiet_step: int = -1

    def observe(self, step: int, metrics: dict[str, float], policy: torch.nn.Module, last: bool = False) -> bool:
        """Check the evaluation after `step` updates (`last`: the run's last); whether training stops here ('stop'
        and the alarm fired)."""
        stats = alarm_stats(metrics)
        fired = self.alarm.check(step, stats, last)
        metrics[ALARM_KEY] = float(fired is not None)
        metrics[SIGN_KEY] = float(not self.alarm.quiet[-1])
        if fired is not None:
            print(f"WARNING: {fired.sentence()}", flush=True)
            return self.mode == "stop"
        if self.mode == "warn" or self.alarm.fired is not None or not self.alarm.quiet[-1]:
            return False
        self.last_quiet, self.last_quiet_step = trained_parameters(policy), step
        score = stats.get("ensemble_min", stats["score"])
        if self.mode == "keep_best" and score > self.best_score:
            self.best, self.best_score, self.best_step = self.last_quiet, score, step
        return False

    @property
    def in_distribution_std(self) -> float:
        return self.alarm.in_distribution_std

    def kept(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The step and parameters the final policy takes instead of the last ones (None: the last ones)."""
        if self.mode == "stop" and self.alarm.fired is not None and self.last_quiet is not None:
            return self.last_quiet_step, self.last_quiet
        if self.mode == "keep_best" and self.best is not None:
            return self.best_step, self.best
        return None

    def outcome(self, last_step: int) -> str:
        """After the alarm fired: which policy is the final one, and the setting that gives the other (the end of
        the summary's WARNING)."""
        kept = self.kept()
        if kept is None:
            said = f"the final policy is the last update's ({last_step}; ppo.on_overoptimisation: {self.mode})"
            other = (
                "; to keep the policy of the last evaluation before the alarm, rerun with ppo.on_overoptimisation=stop "
                "(the stages before the policy stage come from the cache)"
            )
            return said + other * (self.mode == "warn")
        which = f"the {'last' if self.mode == 'stop' else 'best'} evaluation before the alarm or its first sign"
        stopped = "training stopped there and " if self.mode == "stop" else ""
        return (
            f"{stopped}the final policy is update {kept[0]}'s, {which} (ppo.on_overoptimisation: {self.mode}); to "
            "keep the last update's instead, rerun with ppo.on_overoptimisation=warn"
        )

    def result_metrics(self) -> dict[str, float]:
        """overoptimisation/*: the update the alarm fired after (-1: it did not) and the update of the kept policy."""
        kept = self.kept()
        return {
            ALARM_STEP_KEY: float(self.alarm.fired.step if self.alarm.fired else -1),
            KEPT_STEP_KEY: float(kept[0] if kept else -1),
        }


def trained_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of `model`'s trainable parameters (with LoRA: the adapters)."""
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters() if p.requires_grad}


def restore_parameters(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Put `trained_parameters`' copy back into `model`."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in saved.items():
            params[name].copy_(value)


GUARD_FILE = "overoptimisation.pt"  # the guard's state, in the trainer's resume-state folder


def save_guard(folder: Path, guard: EvalGuard) -> None:
    """Keep the guard (the alarm's baseline and state, the kept policy parameters) beside the resume state, written
    atomically: a run killed mid-write resumes from the previous guard, or from none."""
    with atomic_file(folder / GUARD_FILE, "wb") as f:
        torch.save(guard, f)


def load_guard(folder: Path, mode: str, in_distribution_std: float, verified: bool = False) -> EvalGuard:
    """The guard a resumed run saved in `folder`, or a new one (`mode`: ppo.on_overoptimisation; `verified`: the
    reward is a verifier, a reward function with no reward model, whose alarm says so)."""
    file = folder / GUARD_FILE
    if file.is_file():
        guard = torch.load(file, weights_only=False)  # our own file, written by save_guard
        guard.mode = mode
        return guard
    return EvalGuard(mode, OveroptimisationAlarm(in_distribution_std, verified=verified))


def periodic_eval(
    step: int, models: PPOModels, run: PolicyRun, plan: ExecutionPlan, settings: GenerationSettings, guard: EvalGuard
) -> bool:
    """Evaluate after `step` updates: rank 0 generates, checks the over-optimisation alarm (`guard`), logs the
    metrics at `step` and calls `on_eval`; the other ranks wait. Returns whether training stops here (the alarm
    with ppo.on_overoptimisation 'stop'), on every rank. An exception from `on_eval` propagates; with several
    processes the other ranks then raise `TrialPruned`, so that none is left waiting at the next collective."""
    error: Exception | None = None
    stop = False
    dist = plan.dist
    if dist.is_main:
        metrics = evaluate_now(models, run, plan, settings)
        stop = guard.observe(step, metrics, models.policy, last=step == run.cfg.num_updates)
        run.log(metrics, step)
        if run.on_eval is not None:
            try:
                run.on_eval(step, metrics)
            except Exception as err:  # noqa: BLE001 (re-raised below, after telling the other ranks)
                error = err
    if dist.world_size > 1:
        error_seen, stop = distributed.broadcast_object((error is not None, stop))
        if error_seen and not dist.is_main:
            raise TrialPruned(f"rank 0's on_eval stopped training after {step} updates")
    if error is not None:
        raise error
    return stop
