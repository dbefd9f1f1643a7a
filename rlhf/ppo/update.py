"""One PPO update, step by step (docs/algorithm.md "One PPO update"); each step is one call into ``rlhf.ops``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from rlhf.config import PPOConfig
from rlhf.models import sharding
from rlhf.models.device import autocast
from rlhf.models.training import unwrap
from rlhf.nonfinite import skip_nonfinite
from rlhf.ops import gae, masked_mean, masked_quantiles, masked_whiten, per_token_rewards, policy_loss, shape_scores
from rlhf.ops import value_loss as value_loss_fn
from rlhf.ppo.distributed import DistContext, all_reduce_mean, average_gradients, masked_mean_var
from rlhf.ppo.models import PPOModels
from rlhf.ppo.state import TrainerState
from rlhf.ppo.stats import OptimStats
from rlhf.rollout import scoring
from rlhf.rollout.generation import GenerationSettings, Responses
from rlhf.rollout.scoring import policy_forward, value_forward
from rlhf.tracking.metrics_writer import LogFn


@dataclass
class Rollout:
    """One rollout batch: everything the optimisation pass and the statistics need."""

    indices: list[int]  # rows of the prompt list
    query_responses: Tensor  # (b, p + r)
    qr_mask: Tensor  # (b, p + r)
    prompt_len: int
    resp: Responses  # tokens, mask (b, r), contains_stop (b,)
    logprobs: Tensor  # (b, r) policy log-probs at sampling temperature
    ref_logprobs: Tensor  # (b, r)
    values: Tensor  # (b, r)
    scores: Tensor  # (b,) reward-model scores
    timings: dict[str, float] = field(default_factory=dict)
    # filled by compute_advantages
    shaped_scores: Tensor | None = None
    kl: Tensor | None = None
    non_score_rewards: Tensor | None = None
    advantages: Tensor | None = None  # raw GAE advantages
    loss_advantages: Tensor | None = None  # whitened when configured: what the loss sees
    returns: Tensor | None = None

    @property
    def mask(self) -> Tensor:
        return self.resp.mask.float()


def generate_and_score(
    models: PPOModels,
    query: Tensor,
    query_mask: Tensor,
    indices: list[int],
    prompts: list[str] | None,
    cfg: PPOConfig,
    settings: GenerationSettings,
    generator: torch.Generator,
    dtype: torch.dtype,
    world_size: int = 1,
) -> Rollout:
    """Steps 1-3: sample responses, then (no grad) policy and reference log-probs, values and scores.

    `indices` are the rows of `prompts` in the batch; `dtype` is the autocast dtype on CUDA
    (`compute_dtype` of runtime.dtype); float32 turns it off. Shape: query, query_mask (b, p).
    """
    texts = [prompts[i] for i in indices] if prompts is not None else None
    scored = scoring.generate_and_score(
        models.scoring(), query, query_mask, texts, settings, generator, dtype, cfg.forward_batch_size,
        two_streams=streams_apply(query.device, models, world_size),
    )  # fmt: skip
    assert scored.values is not None  # PPO has a value model
    return Rollout(
        indices,
        scored.query_responses,
        scored.qr_mask,
        scored.prompt_len,
        scored.resp,
        scored.logprobs,
        scored.ref_logprobs,
        scored.values,
        scored.scores,
        timings=scored.timings,
    )


def compute_advantages(rollout: Rollout, cfg: PPOConfig, kl_coef: float, dist: DistContext | None = None) -> Rollout:
    """Steps 4-6: shape scores, per-token rewards (KL penalty + score at the last token), GAE, whitening.

    With several processes (`dist`), the whitening moments are those of the global batch (every rank's shard),
    so W processes whiten as one process with the same global batch would.
    """
    t0 = time.perf_counter()
    mask = rollout.mask
    several = dist is not None and dist.world_size > 1

    def whiten(x: Tensor, restore_mean: bool) -> Tensor:
        moments = masked_mean_var(x, mask) if several else None
        return masked_whiten(x, mask, restore_mean=restore_mean, moments=moments)

    shaped = shape_scores(
        rollout.scores,
        rollout.resp.mask.sum(1),
        rollout.resp.contains_stop,
        clip=cfg.score_clip,
        missing_stop_penalty=cfg.missing_eos_penalty,
        missing_stop_mode=cfg.missing_eos_mode,
        min_length=cfg.min_response_length,
        min_length_penalty=cfg.min_length_penalty,
        min_length_mode=cfg.missing_eos_mode,
    )
    token_rewards = per_token_rewards(
        shaped.scores, rollout.logprobs, rollout.ref_logprobs, mask, kl_coef, cfg.kl_estimator
    )
    rewards = (
        whiten(token_rewards.rewards, cfg.whiten_rewards_keep_mean) if cfg.whiten_rewards else token_rewards.rewards
    )
    adv = gae(rewards, rollout.values, mask, cfg.gamma, cfg.lam)
    rollout.shaped_scores, rollout.kl, rollout.non_score_rewards = (
        shaped.scores,
        token_rewards.kl,
        token_rewards.non_score_rewards,
    )
    rollout.advantages, rollout.returns = adv.advantages, adv.returns
    rollout.loss_advantages = whiten(adv.advantages, False) if cfg.whiten_advantages else adv.advantages
    rollout.timings["time/advantages"] = time.perf_counter() - t0
    return rollout


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
    values: Tensor  # (m, r') at sampling
    returns: Tensor  # (m, r')


def micro_batch(rollout: Rollout, rows: Tensor) -> MicroBatch:
    qr_mask = rollout.qr_mask[rows]
    p = rollout.prompt_len
    used_prompt = qr_mask[:, :p].any(0)
    lead = int(used_prompt.int().argmax()) if bool(used_prompt.any()) else 0
    r = max(1, int(rollout.resp.mask[rows].sum(1).max()))
    cols = slice(lead, p + r)
    return MicroBatch(
        rollout.query_responses[rows][:, cols],
        qr_mask[:, cols],
        p - lead,
        rollout.mask[rows][:, :r],
        rollout.logprobs[rows][:, :r],
        rollout.loss_advantages[rows][:, :r],
        rollout.values[rows][:, :r],
        rollout.returns[rows][:, :r],
    )


def _policy_micro(models: PPOModels, mb: MicroBatch, cfg: PPOConfig, dtype: torch.dtype):
    """Policy forward, clipped loss (minus the entropy bonus) and its backward for one micro-batch."""
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
    pl = policy_loss(out.logprobs, mb.logprobs, mb.advantages, mb.mask, cfg.cliprange)
    entropy = masked_mean(out.entropy, mb.mask)
    ((pl.loss - cfg.entropy_coef * entropy) / cfg.gradient_accumulation_steps).backward()
    ratios = torch.exp(out.logprobs.detach() - mb.logprobs)[mb.mask.bool()]
    return pl, entropy, ratios


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


def _paired(concurrent: bool, policy_side, value_side) -> tuple:
    """`policy_side()` and `value_side()`: the value side in the second stream's thread when `concurrent` (the
    gradient clipping and the optimizer steps of the two models touch disjoint tensors), else one after the other."""
    if not concurrent:
        return policy_side(), value_side()
    future = scoring.value_stream().submit(value_side)
    first = policy_side()
    return first, future.result()


def matmul_weights(model: torch.nn.Module) -> int:
    """Entries of a model's matrix-multiply weights (linear and GPT-2 Conv1D layers, LM head included; not the
    embeddings, which are looked up): what one token's forward and backward cost, up to a factor."""
    return sum(
        module.weight.numel()
        for module in unwrap(model).modules()
        if not isinstance(module, torch.nn.Embedding)
        and getattr(module, "weight", None) is not None
        and module.weight.dim() == 2
    )


# the policy's per-token work (its LM head included) may be at most this multiple of the value model's for the two
# to share the cores as two single-threaded streams; past it the policy's stream would leave the other core idle
_BALANCED_STREAMS = 2.0


def streams_apply(device: torch.device, models: PPOModels, world_size: int = 1) -> bool:
    """Whether `two_streams` runs the policy's and the value model's work in two single-threaded streams."""
    return (
        device.type == "cpu"
        and not models.shared_value_head
        and torch.get_num_threads() > 1
        and world_size == 1
        and matmul_weights(models.policy) <= _BALANCED_STREAMS * matmul_weights(models.value)
    )


@contextlib.contextmanager
def two_streams(device: torch.device, models: PPOModels, world_size: int = 1) -> Iterator[bool]:
    """On a multi-threaded CPU with a separate value model of about the policy's cost, run policy-side and
    value-side work in two threads, each op single-threaded (no oversubscription); yields whether to. Small models'
    matmuls do not keep two cores busy on their own: this measured about 7% faster on the `cpu` bench shape with
    2 cores. Not where the policy's LM head makes its side much heavier (a 32k vocabulary on a small model: the
    `cpu-long` shape's optimisation took 18.0 s in two streams against 12.3 s with both threads on each op), and not
    with several processes: they already share the cores."""
    threads = torch.get_num_threads()
    concurrent = streams_apply(device, models, world_size)
    if concurrent:
        torch.set_num_threads(1)
    try:
        yield concurrent
    finally:
        torch.set_num_threads(threads)


def _global_approxkl(running: OptimStats, world_size: int, device: torch.device) -> float:
    """The early-stop test's approximate KL: averaged across ranks, so that every rank stops at the same epoch."""
    approxkl = running.means()["policy/approxkl"]
    if world_size == 1:
        return approxkl
    return float(all_reduce_mean(torch.tensor([approxkl], dtype=torch.float64, device=device)))


def optimize(
    models: PPOModels,
    state: TrainerState,
    rollout: Rollout,
    cfg: PPOConfig,
    dtype: torch.dtype,
    dist: DistContext | None = None,
    on_nonfinite: str = "stop",
    log: LogFn | None = None,
) -> OptimResult:
    """Step 7: PPO epochs over shuffled minibatches (with gradient accumulation), optional early stop.

    Policy and value losses have disjoint parameters, so their backward passes are independent: with a separate
    value model on the CPU, the value model's forward and backward run in a second thread beside the policy's
    (each op single-threaded), which keeps both cores busy where one model's small matmuls would not.

    With `dist` over W > 1 processes, `rollout` is this rank's shard (ppo.batch_size / W episodes) and each minibatch
    is ppo.mini_batch_size / W of them; the gradients are averaged across ranks before clipping, so every rank
    takes the same optimizer step: all-reduced here for replicated models, reduce-scattered into each rank's shard
    by FSDP in backward for sharded ones (runtime.sharding 'fsdp'; each rank then steps its own shards). The
    shuffle generator is the same on all ranks (a permutation of local rows).

    A NaN or infinite loss or gradient norm in a minibatch stops the update with NonFiniteError (after logging the
    minibatch's statistics through `log`) or, with `on_nonfinite="skip_update"`, skips that minibatch's optimizer
    steps and counts it in ``ppo/skipped_nonfinite``.
    """
    t0 = time.perf_counter()
    device = rollout.query_responses.device
    world_size = dist.world_size if dist is not None else 1
    sharded = sharding.is_sharded(unwrap(models.policy))  # FSDP averages the gradients itself
    running, per_minibatch, ratios = OptimStats(), [], []
    mini_size = cfg.mini_batch_size // world_size
    micro_size = mini_size // cfg.gradient_accumulation_steps
    stopped_early = 0.0
    skipped = 0
    models.policy.train()  # dropout is disabled; train mode only switches on gradient checkpointing
    models.value.train()
    with two_streams(device, models, world_size) as concurrent:
        for _epoch in range(cfg.num_ppo_epochs):
            perm = torch.randperm(len(rollout.indices), generator=state.shuffle_generator)
            for start in range(0, len(rollout.indices), mini_size):
                mb_stats = OptimStats()
                for micro in perm[start : start + mini_size].split(micro_size):
                    mb = micro_batch(rollout, micro.to(device))
                    if concurrent:
                        value_future = scoring.value_stream().submit(_value_micro, models, mb, cfg, dtype)
                        pl, entropy, mb_ratios = _policy_micro(models, mb, cfg, dtype)
                        vl = value_future.result()
                    else:
                        pl, entropy, mb_ratios = _policy_micro(models, mb, cfg, dtype)
                        vl = _value_micro(models, mb, cfg, dtype)
                    ratios.append(mb_ratios)
                    mb_stats.add(
                        {
                            "policy/loss": pl.loss,
                            "value/loss": vl.loss,
                            "loss/total": pl.loss + cfg.vf_coef * vl.loss - cfg.entropy_coef * entropy,
                            "policy/entropy": entropy,
                            "policy/approxkl": pl.approx_kl,
                            "policy/policykl": pl.policy_kl,
                            "policy/clipfrac": pl.clipfrac,
                            "policy/ratio_mean": pl.ratio_mean,
                            "policy/ratio_var": pl.ratio_var,
                            "value/clipfrac": vl.clipfrac,
                            "value/error": vl.value_error,
                        }
                    )
                if world_size > 1 and not sharded:  # after both backward passes: the summed gradients, averaged
                    average_gradients(state.policy_params)
                    average_gradients(state.value_params)
                policy_norm, value_norm = _paired(
                    concurrent,
                    lambda: sharding.clip_grad_norm(state.policy_params, cfg.max_grad_norm),
                    lambda: sharding.clip_grad_norm(state.value_params, cfg.max_grad_norm),
                )
                mb_stats.add({"policy/grad_norm": policy_norm, "value/grad_norm": value_norm})
                mb_means = mb_stats.means()
                skip = skip_nonfinite(mb_means, "PPO", state.step + 1, on_nonfinite, log, _CHECKED)
                if on_nonfinite == "skip_update" and world_size > 1:  # one rank's NaN skips the step on every rank
                    skip = float(all_reduce_mean(torch.tensor([float(skip)], device=device))) > 0
                skipped += skip
                if not skip:
                    _paired(concurrent, state.policy_opt.step, state.value_opt.step)
                state.policy_opt.zero_grad(set_to_none=True)
                state.value_opt.zero_grad(set_to_none=True)
                per_minibatch.append(mb_means)
                running.add(per_minibatch[-1])
            if cfg.target_kl is not None and _global_approxkl(running, world_size, device) > cfg.target_kl:
                stopped_early = 1.0
                break
    models.policy.eval()
    models.value.eval()
    state.policy_sched.step()
    state.value_sched.step()
    all_ratios = torch.cat(ratios).float()
    stats = running.means()
    stats.update(
        {
            "policy/early_stopped": stopped_early,
            "policy/lr": state.policy_sched.get_last_lr()[0],
            "value/lr": state.value_sched.get_last_lr()[0],
            "time/optimize": time.perf_counter() - t0,
        }
    )
    if on_nonfinite == "skip_update":
        stats["ppo/skipped_nonfinite"] = float(skipped)
    quantiles = masked_quantiles(all_ratios, torch.ones_like(all_ratios))
    return OptimResult(stats, per_minibatch, quantiles)
