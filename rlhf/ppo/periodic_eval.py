"""PPO's periodic evaluation (ppo.eval_every): the current policy on held-out prompts, scored by the reward model
(the proxy), the gold reward where the task has one, and the KL to the reference.

Every evaluation generates for the same prompts with the training sampling settings and a generator seeded the
same way each time, so the points of one run (and of runs with the same seed) are comparable. The KL is the
evaluation stage's ``eval/kl``: the sum over response tokens of ``logp_policy - logp_ref`` (k1), mean over prompts
(`rlhf.eval.evaluate.generate_and_score_prompts`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from rlhf.config import PPOConfig
from rlhf.errors import TrialPruned
from rlhf.eval.evaluate import generate_and_score_prompts
from rlhf.ppo import distributed
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.models import PPOModels
from rlhf.rollout.generation import GenerationSettings
from rlhf.tracking.metrics_writer import GoldFn, LogFn

EvalCallback = Callable[[int, dict[str, float]], None]
"""``on_eval(step, metrics)``: called after each periodic evaluation (rank 0); raising stops training."""

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
    models: PPOModels,
    prompts: list[str],
    cfg: PPOConfig,
    settings: GenerationSettings,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    gold_fn: GoldFn | None,
) -> dict[str, float]:
    """The ppo_eval/* metrics of the current policy on `prompts` (no value model needed: none is run)."""
    scoring = dataclasses.replace(models.scoring(), value=None)
    generator = torch.Generator(device=device).manual_seed(seed + EVAL_SEED_OFFSET)
    frame = generate_and_score_prompts(
        scoring, prompts, settings, cfg.max_prompt_tokens, cfg.batch_size, generator, dtype
    )
    kl = float(frame["kl"].mean())
    metrics = {
        "ppo_eval/score": float(frame["score"].mean()),
        "ppo_eval/kl": kl,
        "ppo_eval/sqrt_kl": sqrt_kl(kl),
        "ppo_eval/length_mean": float(frame["length"].mean()),
    }
    if gold_fn is not None:
        gold = [gold_fn(p, r) for p, r in zip(frame["prompt"], frame["response"], strict=True)]
        metrics["ppo_eval/gold"] = float(sum(gold) / len(gold))
    return metrics


def periodic_eval(
    step: int,
    models: PPOModels,
    prompts: list[str],
    cfg: PPOConfig,
    settings: GenerationSettings,
    seed: int,
    dtype: torch.dtype,
    dist: DistContext,
    log: LogFn,
    gold_fn: GoldFn | None,
    on_eval: EvalCallback | None,
) -> None:
    """Evaluate after `step` updates: rank 0 generates, logs the metrics at `step` and calls `on_eval`; the other
    ranks wait. An exception from `on_eval` propagates; with several processes the other ranks then raise
    `TrialPruned`, so that none is left waiting at the next collective."""
    error: Exception | None = None
    if dist.is_main:
        metrics = evaluate_now(models, prompts, cfg, settings, seed, dtype, dist.device, gold_fn)
        log(metrics, step)
        if on_eval is not None:
            try:
                on_eval(step, metrics)
            except Exception as err:  # noqa: BLE001 (re-raised below, after telling the other ranks)
                error = err
    if dist.world_size > 1 and distributed.broadcast_object(error is not None) and not dist.is_main:
        raise TrialPruned(f"rank 0's on_eval stopped training after {step} updates")
    if error is not None:
        raise error
