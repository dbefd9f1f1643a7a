"""Step 7 of a PPO update (docs/objectives.md "One PPO update"): the epochs over shuffled minibatches of a rollout,
micro-batches with gradient accumulation, the policy and value losses and their statistics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from rlhf.config import PPOConfig
from rlhf.metrics import POLICY_APPROXKL, POLICY_CLIPFRAC
from rlhf.models import sharding
from rlhf.models.device import autocast, torch_threads
from rlhf.models.training import unwrap
from rlhf.nonfinite import skip_nonfinite
from rlhf.ops import (
    kl_loss,
    masked_mean,
    masked_quantiles,
    policy_loss,
)
from rlhf.ops import value_loss as value_loss_fn
from rlhf.ppo.distributed import all_reduce_mean, average_gradients
from rlhf.ppo.models import PPOModels
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.state import TrainerState
from rlhf.ppo.stats import MICRO_KEYS, MicroStats, OptimStats
from rlhf.ppo.update import Rollout
from rlhf.rollout.forwards import policy_forward, value_forward
from rlhf.rollout.row_groups import used_columns
from rlhf.rollout.sides import run_sides


@dataclass
class OptimResult:
    stats: dict[str, float]
    minibatch_stats: list[dict[str, float]]  # in order, for invariant checks
    ratio_quantiles: list[float]


class MicroBatch(NamedTuple):
    """Rows of a rollout for one forward and backward, without the columns that are padding in every one of them
    (prompt columns left of the longest prompt, response columns right of the longest response): the same values
    at every real position, less work where responses stop early or prompts differ in length."""

    query_responses: Tensor  # (m, p' + r')
    qr_mask: Tensor  # (m, p' + r')
    prompt_len: int  # p'
    mask: Tensor  # (m, r') float
    logprobs: Tensor  # (m, r') at sampling
    advantages: Tensor  # (m, r') as the loss sees them
    values: Tensor | None  # (m, r') at sampling; None without a value model
    returns: Tensor | None  # (m, r')
    ref_logprobs: Tensor  # (m, r') the reference's, for the KL term of the loss (ppo.kl_in: loss)


def micro_batch(rollout: Rollout, rows: Tensor) -> MicroBatch:
    scored = rollout.scored
    qr_mask = scored.qr_mask[rows]
    p = scored.prompt_len
    lead, r = used_columns(qr_mask, p, scored.resp.mask[rows])  # as the rollout's forward of these rows
    cols = slice(lead, p + r)
    critic = scored.values is not None
    return MicroBatch(
        scored.query_responses[rows][:, cols],
        qr_mask[:, cols],
        p - lead,
        rollout.mask[rows][:, :r],
        scored.logprobs[rows][:, :r],
        rollout.loss_advantages[rows][:, :r],
        scored.values[rows][:, :r] if critic else None,
        rollout.returns[rows][:, :r] if critic else None,
        scored.ref_logprobs[rows][:, :r],
    )


def _policy_micro(
    models: PPOModels,
    mb: MicroBatch,
    cfg: PPOConfig,
    dtype: torch.dtype,
    kl_coef: float,
    weights: HalfWeights | None = None,
    fill: Callable[[Tensor], None] | None = None,
):
    """Policy forward, clipped loss (minus the entropy bonus, plus `kl_coef` times the KL to the reference with
    ppo.kl_in 'loss') and its backward for one micro-batch; the losses aggregated as ppo.loss_aggregation says (the
    clipped loss over responses with a sequence-level ratio). `weights` scale its part of the gradient when the
    micro-batch is one of several halves (`_policy_halves`). `fill`: the micro-batch's rows were not scored by the
    policy at sampling (`rlhf.ppo.update.defers_old_logprobs`): this forward, detached, is their old log-probs, and
    `fill` writes them into the rollout."""
    w = weights or HalfWeights(1.0, 1.0, 1.0)
    with autocast(mb.mask.device, dtype):
        out = sharding.call(
            unwrap(models.policy),
            policy_forward,
            mb.query_responses,
            mb.qr_mask,
            mb.prompt_len,
            cfg.temperature,
            with_entropy=True,
            entropy_grad=cfg.entropy_coef > 0,
        )
    if fill is not None:  # the policy has not changed since sampling: the ratio is 1, its gradient the policy's
        mb = mb._replace(logprobs=out.logprobs.detach().float())
        fill(mb.logprobs)
    aggregation = dict(loss_aggregation=cfg.aggregation, norm_length=cfg.max_new_tokens)
    pl = policy_loss(
        out.logprobs, mb.logprobs, mb.advantages, mb.mask, cfg.clip_low, cliprange_high=cfg.clip_high,
        importance_sampling_level=cfg.importance_sampling_level, **aggregation,
    )  # fmt: skip
    entropy = masked_mean(out.entropy, mb.mask)
    loss = w.policy * pl.loss - w.tokens * cfg.entropy_coef * entropy
    kl = None
    if cfg.kl_placement == "loss":
        kl = kl_loss(out.logprobs, mb.ref_logprobs, mb.mask, cfg.kl_estimator_used, **aggregation)
        loss = loss + w.kl * kl_coef * kl
    (loss / cfg.gradient_accumulation_steps).backward()
    ratios = torch.exp(out.logprobs.detach() - mb.logprobs)[mb.mask.bool()]
    return pl, entropy, ratios, kl


class HalfWeights(NamedTuple):
    """A half's share of its micro-batch's aggregations: of the clipped loss's, of the KL term's and of its tokens."""

    policy: float
    kl: float
    tokens: float


# how each statistic of the two halves combines: by the halves' tokens (token means), by their sequences (means
# over responses), or by their share of the aggregated loss it belongs to; policy/ratio_var and loss/total are
# recombined from these
_TOKEN_MEANS = ("policy/entropy", POLICY_APPROXKL, "policy/policykl", POLICY_CLIPFRAC, "policy/ratio_mean")
_SEQUENCE_MEANS = ("policy/seq_clipfrac",)
_LOSS_WEIGHTS = {"policy/loss": "policy", "policy/kl_loss": "kl"}


def _shares(mode: str, tokens: list[float], sequences: list[float]) -> list[float]:
    counts = tokens if mode == "token_mean" else sequences
    return [c / sum(counts) if sum(counts) else 0.5 for c in counts]


def _filler(rollout: Rollout, rows: Tensor) -> Callable[[Tensor], None]:
    """Writes the old log-probs (m, r') of the micro-batch of `rows` into the rollout (`_policy_micro`'s `fill`)."""

    def fill(logprobs: Tensor) -> None:
        rollout.scored.logprobs[rows, : logprobs.shape[1]] = logprobs

    return fill


def _policy_halves(
    models: PPOModels,
    rollout: Rollout,
    parts: tuple[Tensor, ...],
    cfg: PPOConfig,
    dtype: torch.dtype,
    kl_coef: float,
    deferred: bool = False,
) -> tuple[dict[str, Tensor], Tensor]:
    """One micro-batch of a critic-free run on a CPU as two halves (`parts`: `ExecutionPlan.policy_parts`), forward
    and backward side by side in two threads (each op single-threaded: `split_policy_work`). Their losses are weighted
    by their share of the micro-batch's aggregation (real tokens for token_mean, sequences with tokens for the
    sequence modes; the entropy by tokens), so the gradients the autograd engine sums into the parameters (under its
    accumulation lock) are the whole micro-batch's; the statistics are recombined exactly. Returns (the
    micro-batch's statistics, its ratios)."""
    halves = [micro_batch(rollout, part) for part in parts]
    fills = [_filler(rollout, part) if deferred else None for part in parts]
    tokens = [float(mb.mask.sum()) for mb in halves]
    sequences = [float(mb.mask.bool().any(-1).sum()) for mb in halves]
    policy_mode = cfg.aggregation if cfg.importance_sampling_level == "token" else "seq_mean_token_mean"
    weights = [
        HalfWeights(*shares)
        for shares in zip(
            _shares(policy_mode, tokens, sequences),
            _shares(cfg.aggregation, tokens, sequences),
            _shares("token_mean", tokens, sequences),
            strict=True,
        )
    ]
    sides = [
        partial(_policy_micro, models, mb, cfg, dtype, kl_coef, w, fill)
        for mb, w, fill in zip(halves, weights, fills, strict=True)
    ]
    outs = run_sides(sides[0], sides[1], True)
    parts = [MicroStats.of(pl, None, entropy, cfg, kl, kl_coef).metrics() for pl, entropy, _, kl in outs]
    token_w = [w.tokens for w in weights]
    sequence_w = _shares("seq_mean_token_mean", tokens, sequences)
    metrics = {key: sum(w * part[key] for w, part in zip(token_w, parts, strict=True)) for key in _TOKEN_MEANS}
    for key in (k for k in _SEQUENCE_MEANS if k in parts[0]):
        metrics[key] = sum(w * part[key] for w, part in zip(sequence_w, parts, strict=True))
    for key, which in _LOSS_WEIGHTS.items():
        if key in parts[0]:
            metrics[key] = sum(getattr(w, which) * part[key] for w, part in zip(weights, parts, strict=True))
    # E[x^2] of each half is its variance plus its squared mean (population variances)
    second = sum(w * (p["policy/ratio_var"] + p["policy/ratio_mean"] ** 2) for w, p in zip(token_w, parts, strict=True))
    metrics["policy/ratio_var"] = second - metrics["policy/ratio_mean"] ** 2
    metrics["loss/total"] = metrics["policy/loss"] - cfg.entropy_coef * metrics["policy/entropy"]
    if "policy/kl_loss" in metrics:
        metrics["loss/total"] = metrics["loss/total"] + kl_coef * metrics["policy/kl_loss"]
    return {key: metrics[key] for key in MICRO_KEYS if key in metrics}, torch.cat([out[2] for out in outs])


def _value_micro(models: PPOModels, mb: MicroBatch, cfg: PPOConfig, dtype: torch.dtype):
    """Value forward, clipped value loss and its backward for one micro-batch."""
    with autocast(mb.mask.device, dtype):
        new_values = sharding.call(models.value, value_forward, mb.query_responses, mb.qr_mask, mb.prompt_len)
        new_values = new_values.float()
    vl = value_loss_fn(new_values, mb.values, mb.returns, mb.mask, cfg.cliprange_value)
    (cfg.vf_coef * vl.loss / cfg.gradient_accumulation_steps).backward()
    return vl


# the statistics whose NaN or inf stops (or skips) an optimizer step
_CHECKED = ("policy/loss", "value/loss", "policy/grad_norm", "value/grad_norm")
_CHECKED_POLICY = ("policy/loss", "policy/grad_norm")  # without a value model


class MinibatchResult(NamedTuple):
    stats: dict[str, float]  # means over the micro-batches, with the gradient norms
    ratios: Tensor  # (n,) the probability ratios at the minibatch's real response tokens
    skipped: bool  # its optimizer steps were skipped (a non-finite statistic, on_nonfinite 'skip_update')


def minibatch_step(
    models: PPOModels,
    state: TrainerState,
    rollout: Rollout,
    rows: Tensor,
    cfg: PPOConfig,
    plan: ExecutionPlan,
    deferred: bool = False,
) -> MinibatchResult:
    """One optimizer step of the policy and of the value model on the minibatch `rows` of `rollout` (`deferred`: rows
    whose old log-probs its forward computes, `_policy_micro`).

    The gradients of its micro-batches (ppo.gradient_accumulation_steps) accumulate, the policy's and the value
    model's side by side in two threads with `plan.second_thread` (their backward passes, gradient clipping and
    optimizer steps touch disjoint tensors), a critic-free micro-batch as two halves with `plan.split_policy`; with
    W > 1 processes they are averaged across ranks before clipping (FSDP averages sharded models' gradients in
    backward). A non-finite loss or gradient norm stops the update (`NonFiniteError`, after reporting the statistics
    to `plan.log`) or, with `plan.on_nonfinite` 'skip_update', skips the optimizer steps on every rank.
    """
    device, dtype, world_size = rollout.scored.query_responses.device, plan.dtype, plan.world_size
    second_thread, on_nonfinite = plan.second_thread, plan.on_nonfinite
    critic = models.value is not None
    kl_coef = state.kl_ctl.value
    stats, ratios = OptimStats(), []
    for micro in plan.micro_batches(rows, cfg):
        micro = micro.to(device)
        parts = plan.policy_parts(micro, critic)
        if len(parts) > 1:  # two halves in two threads
            metrics, mb_ratios = _policy_halves(models, rollout, parts, cfg, dtype, kl_coef, deferred)
            ratios.append(mb_ratios)
            stats.add(metrics)
            continue
        mb = micro_batch(rollout, micro)
        fill = _filler(rollout, micro) if deferred else None
        policy_side = partial(_policy_micro, models, mb, cfg, dtype, kl_coef, None, fill)
        if critic:
            (pl, entropy, mb_ratios, kl), vl = run_sides(
                policy_side, partial(_value_micro, models, mb, cfg, dtype), second_thread
            )
        else:
            (pl, entropy, mb_ratios, kl), vl = policy_side(), None
        ratios.append(mb_ratios)
        stats.add(MicroStats.of(pl, vl, entropy, cfg, kl, kl_coef).metrics())
    if world_size > 1 and not sharding.is_sharded(unwrap(models.policy)):  # the summed gradients, averaged
        average_gradients(state.policy_params)
        if critic:
            average_gradients(state.value_params)
    if critic:
        policy_norm, value_norm = run_sides(
            partial(sharding.clip_grad_norm, state.policy_params, cfg.max_grad_norm),
            partial(sharding.clip_grad_norm, state.value_params, cfg.max_grad_norm),
            second_thread,
        )
        stats.add({"policy/grad_norm": policy_norm, "value/grad_norm": value_norm})
    else:
        stats.add({"policy/grad_norm": sharding.clip_grad_norm(state.policy_params, cfg.max_grad_norm)})
    means = stats.means()
    checked = _CHECKED if critic else _CHECKED_POLICY
    skip = skip_nonfinite(means, "PPO", state.step + 1, on_nonfinite, plan.log, checked)
    if on_nonfinite == "skip_update" and world_size > 1:  # one rank's NaN skips the step on every rank
        skip = float(all_reduce_mean(torch.tensor([float(skip)], device=device))) > 0
    if not skip:
        if state.policy_held(cfg):  # the critic's warmup: the value model alone learns
            state.value_opt.step()
        elif critic:
            run_sides(state.policy_opt.step, state.value_opt.step, second_thread)
        else:
            state.policy_opt.step()
    state.policy_opt.zero_grad(set_to_none=True)
    if critic:
        state.value_opt.zero_grad(set_to_none=True)
    return MinibatchResult(means, torch.cat(ratios), skip)


def _global_approxkl(running: OptimStats, world_size: int, device: torch.device) -> float:
    """The early-stop test's approximate KL: averaged across ranks, so that every rank stops at the same epoch."""
    approxkl = running.means()[POLICY_APPROXKL]
    if world_size == 1:
        return approxkl
    return float(all_reduce_mean(torch.tensor([approxkl], dtype=torch.float64, device=device)))


def optimize(
    models: PPOModels,
    state: TrainerState,
    rollout: Rollout,
    cfg: PPOConfig,
    plan: ExecutionPlan,
) -> OptimResult:
    """Step 7: PPO epochs over shuffled minibatches (with gradient accumulation), optional early stop; how it
    executes (processes, dtype, CPU threads, non-finite statistics) is `plan`'s.

    Policy and value losses have disjoint parameters, so their backward passes are independent: with a separate
    value model on the CPU (`plan.second_thread`), the value model's forward and backward run in a second thread
    beside the policy's (each op single-threaded), which keeps both cores busy where one model's small matmuls would
    not.

    With `plan.dist` over W > 1 processes, `rollout` is this rank's shard (ppo.batch_size / W episodes) and each
    minibatch is ppo.mini_batch_size / W of them; the gradients are averaged across ranks before clipping, so every rank
    takes the same optimizer step: all-reduced here for replicated models, reduce-scattered into each rank's shard
    by FSDP in backward for sharded ones (runtime.sharding 'fsdp'; each rank then steps its own shards). The
    shuffle generator is the same on all ranks (a permutation of local rows).

    A NaN or infinite loss or gradient norm in a minibatch stops the update with NonFiniteError (after logging the
    minibatch's statistics through `plan.log`) or, with `plan.on_nonfinite` 'skip_update', skips that minibatch's
    optimizer steps and counts it in ``ppo/skipped_nonfinite``.
    """
    t0 = time.perf_counter()
    device, world_size = rollout.scored.query_responses.device, plan.world_size
    n, mini_size = len(rollout.indices), cfg.mini_batch_size // world_size
    running, per_minibatch, ratios = OptimStats(), [], []
    stopped_early, skipped = 0.0, 0
    # step 1. train mode: dropout is disabled, it only switches on gradient checkpointing
    models.policy.train()
    if models.value is not None:
        models.value.train()
    with torch_threads(plan.optimise_threads):  # two threads: each op single-threaded
        for epoch in range(cfg.num_ppo_epochs):
            # step 2. a shuffled pass over the rollout: one optimizer step of each model per minibatch (the first
            # epoch's order drawn before sampling, whose forwards' rows the rollout's log-probs were computed on)
            first = epoch == 0 and rollout.first_order is not None
            perm = rollout.first_order if first else torch.randperm(n, generator=state.shuffle_generator)
            for start in range(0, n, mini_size):
                deferred = first and start == 0 and rollout.scored.deferred is not None
                step = minibatch_step(models, state, rollout, perm[start : start + mini_size], cfg, plan, deferred)
                per_minibatch.append(step.stats)
                running.add(step.stats)
                ratios.append(step.ratios)
                skipped += step.skipped
            # step 3. early stop once the epoch's approximate KL (the mean over every rank) passes ppo.target_kl
            if cfg.early_stop_kl is not None and _global_approxkl(running, world_size, device) > cfg.early_stop_kl:
                stopped_early = 1.0
                break
    # step 4. eval mode; one learning-rate scheduler step per update
    models.policy.eval()
    held = state.policy_held(cfg)
    if not held:
        state.policy_sched.step()
    if models.value is not None:
        models.value.eval()
        state.value_sched.step()
    # step 5. statistics: means over every minibatch of every epoch, and the quantiles of the ratios
    stats = running.means()
    stats.update(
        {
            "policy/early_stopped": stopped_early,
            "policy/held": float(held),
            "policy/lr": state.policy_sched.get_last_lr()[0],
            "time/optimize": time.perf_counter() - t0,
        }
    )
    if models.value is not None:
        stats["value/lr"] = state.value_sched.get_last_lr()[0]
    if plan.on_nonfinite == "skip_update":
        stats["ppo/skipped_nonfinite"] = float(skipped)
    all_ratios = torch.cat(ratios).float()
    quantiles = masked_quantiles(all_ratios, torch.ones_like(all_ratios))
    return OptimResult(stats, per_minibatch, quantiles)
