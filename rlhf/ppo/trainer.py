"""The PPO training loop (docs/objectives.md), resumable from its last saved state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from rlhf.checkpoints import atomic_dir, write_manifest
from rlhf.config import PPOConfig
from rlhf.errors import TrainingInterrupted
from rlhf.memory import reset_peak_memory
from rlhf.metrics import OBJECTIVE_KL, OBJECTIVE_SCORES
from rlhf.models import sharding
from rlhf.models.device import resolve_device, run_dtype
from rlhf.models.reward_ensemble import in_distribution_std
from rlhf.ppo import distributed, dynamic_sampling
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.models import PPOModels, load_models
from rlhf.ppo.optimise import optimize
from rlhf.ppo.periodic_eval import (
    EvalGuard,
    is_eval_step,
    load_guard,
    periodic_eval,
    restore_parameters,
    save_guard,
)
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import prompt_batch
from rlhf.ppo.records import record_rollouts
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.sharded_state import full_weights, save_sharded_state, shard_models
from rlhf.ppo.state import TrainerState, load_state, save_final, save_state, trainer_fields
from rlhf.ppo.stats import function_rollout_stats, zero_std_by_category, zero_std_counts
from rlhf.ppo.update import (
    Rollout,
    compute_advantages,
    first_epoch_order,
    generate_and_score,
    refresh_kl,
    speed_stats,
    update_stats,
)
from rlhf.rollout.generation import GenerationSettings
from rlhf.rollout.prompt_fit import fit_prompts
from rlhf.rollout.static_decode import resolve_decode
from rlhf.rollout.vllm_backend import start_vllm_sampler
from rlhf.stop_request import raise_if_stop_requested
from rlhf.tracking.metrics_writer import flush_log

PROMPT_TRUNCATION_WARN = 0.1  # warn when more of the prompts than this are cut to ppo.max_prompt_tokens
logger = logging.getLogger(__name__)


@dataclass
class PPOResult:
    policy_path: str
    value_path: str
    digest: str
    updates: int
    metrics: dict[str, float] = field(default_factory=dict)
    param_digest: str = ""  # several processes, when asked: this rank's digest of the final parameters
    alarm: str = ""  # the over-optimisation alarm's sentence where it fired (rlhf.eval.overoptimisation)


def generation_settings(cfg: PPOConfig, models: PPOModels, device: torch.device | None = None) -> GenerationSettings:
    """The sampling settings of `cfg`, its decode mode resolved for `device` (None: the policy's)."""
    device = device if device is not None else next(models.policy.parameters()).device
    decode = resolve_decode(cfg.generation.decode, device)
    return GenerationSettings(
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        cfg.top_p,
        models.stop_token_ids,
        models.tokenizer.pad_token_id,
        decode,
    )


def train_ppo(run: PolicyRun, dist: DistContext | None = None) -> PPOResult:
    """Train the policy with PPO (or a critic-free estimator) against the reward model; resumes from
    ``run.out_dir/state`` when it exists.

    Only updates after the resumed step are logged, so a resumed run's metric history has no duplicated steps.
    `run.stop_after` ends the run after that many updates, as a crash would (for resume tests).

    `dist` (from `distributed.init_distributed`, e.g. under ``torchrun``) makes this one of W data-parallel
    processes: ppo.batch_size is the global batch and each rank generates its slice of it; gradients are averaged
    across ranks, whitening uses the moments of the global batch, statistics are reduced across ranks, and rank 0
    alone calls `log` and writes rollout records, the trainer state and the final models. None: one process.
    runtime.sharding 'fsdp' shards the four models over the ranks (`rlhf.ppo.sharded_state`): every rank then
    writes its shards of the resume state, and the final models are gathered on rank 0.
    `run.param_digest` (a test aid: it hashes every parameter) returns each rank's digest of the final parameters.
    `run.reward_cfg` with a reward function (reward.function): its scores replace (`reward_path` None) or add to
    the reward model's.

    With ppo.eval_every > 0 and `run.eval_prompts`, the policy is evaluated on them before the first update (unless
    resuming past it), every eval_every updates and after the last (``rlhf.ppo.periodic_eval``): rank 0 logs
    periodic_eval/* at step = updates done, then calls ``run.on_eval(step, metrics)``, which may raise to stop training
    (e.g. `rlhf.errors.TrialPruned`). With several processes only rank 0 evaluates and calls `on_eval`: a callback
    that keeps state (a pruner) sees one process's view, so pruning is meant for single-process runs.
    """
    cfg, runtime, out_dir, log = run.cfg, run.runtime, Path(run.out_dir), run.log
    dist = dist if dist is not None else DistContext(device=resolve_device(runtime.device))
    distributed.check_world_size(cfg, dist.world_size)
    distributed.check_sharding(cfg, runtime, dist.world_size)
    sharded = runtime.sharding == "fsdp"
    reset_peak_memory(dist.device)
    models = load_models(
        cfg, runtime, run.policy_path, run.reward_path, run.value_path or run.reward_path, dist.device, run.reward_cfg,
        run.row_columns,
    )  # fmt: skip
    place_models(models, dist, sharded)
    # how every step executes: device, dtype, processes, sharding, threads, non-finite handling
    dtype = run_dtype(runtime, dist.device)
    plan = ExecutionPlan.for_models(models, dtype, dist, runtime.on_nonfinite, log, sharded)
    state = load_state(out_dir / "state", models, cfg, run.seed, dist.device, dist.rank, dist.world_size)
    settings = generation_settings(cfg, models, dist.device)
    prompt_ids, pending = truncated_prompts(models.tokenizer, run.prompts, cfg, dist)
    start_sampler(models, run, plan)  # after the resume state: the resumed policy
    total = cfg.num_updates
    stats: dict[str, float] = {}
    show = runtime.progress and dist.is_main
    bar = tqdm(range(state.step, total), desc="ppo", disable=not show, initial=state.step, total=total)

    # the over-optimisation alarm at the periodic evaluations, and what ppo.on_overoptimisation keeps
    std = in_distribution_std(models.reward)
    guard = load_guard(out_dir / "state", cfg.on_overoptimisation, std, verified=run.reward_is_gold)

    def evaluate_if_due(step: int) -> bool:
        """Whether training stops after this evaluation (the alarm, with ppo.on_overoptimisation 'stop')."""
        if not (run.eval_prompts and is_eval_step(step, cfg)):
            return False
        return periodic_eval(step, models, run, plan, settings, guard)

    pad_id = models.tokenizer.pad_token_id
    category_stats = category_zero_std(models, run.prompt_rows, cfg, dist)
    function_names = models.reward_fn.names if models.reward_fn is not None else []
    sample_rollout = rollout_sampler(models, state, prompt_ids, run, plan, settings)
    if state.step == 0:
        evaluate_if_due(0)  # the SFT policy: the reference point of the run's evaluations (and of the alarm)
    for update in bar:
        raise_if_stop_requested(f"PPO training at update {update + 1}")
        t0 = time.perf_counter()
        # steps 1-3. sample prompts (this rank's slice of the global batch), generate, score under no grad
        rollout, sampling_stats = sample_update(update, sample_rollout, cfg, pad_id, dist, category_stats)
        # steps 4-6. rewards with the KL penalty, advantages (GAE or the critic-free estimator's; whitened with the
        # global batch's moments)
        compute_advantages(rollout, cfg, state.kl_ctl.value, dist)
        # step 7. PPO epochs (gradients averaged across ranks)
        optim = optimize(models, state, rollout, cfg, plan)
        refresh_kl(rollout, cfg)  # the KL of the rows whose log-probs the optimisation's first pass computed
        if models.sampler is not None:  # the next rollout samples from the updated policy
            rollout.scored.timings["time/weight_sync"] = models.sampler.sync_weights()
        # step 8. statistics (reduced across ranks) and the KL controller (the global mean KL)
        t_stats = time.perf_counter()
        stats = update_stats(rollout, optim.stats, optim.ratio_quantiles, state.kl_ctl.value, guard.in_distribution_std)
        stats.update(function_rollout_stats(rollout.scored.function_scores, function_names))
        stats.update(sampling_stats)
        stats.update(record_rollouts(run, update, models, rollout, dist))
        stats.update(speed_stats(rollout, stats, t0, t_stats, cfg.batch_size, dist.device, dist.world_size))
        stats = distributed.reduce_stats(stats)
        state.kl_ctl.update(stats[OBJECTIVE_KL], cfg.batch_size)
        state.step = update + 1
        if dist.is_main and (state.step % cfg.log_every == 0 or state.step == total):
            log({**stats, **pending}, state.step)
            pending = {}  # the prompts' truncation share: logged once, with the first logged update
        bar.set_postfix(score=f"{stats[OBJECTIVE_SCORES]:.2f}", kl=f"{stats[OBJECTIVE_KL]:.2f}", refresh=False)
        if evaluate_if_due(state.step):
            break  # ppo.on_overoptimisation 'stop': the final policy is the last one the alarm passed
        if state.step < total and (state.step % cfg.save_every == 0 or state.step == run.stop_after):
            flush_log(log)  # every update up to a saved state is in the store
            checkpoint_state(out_dir / "state", models, state, dist, guard)
        if run.stop_after is not None and state.step == run.stop_after and state.step < total:
            raise TrainingInterrupted(f"stopped after {state.step} updates (stop_after); state saved")
    if models.sampler is not None:
        models.sampler.close()
    keep_guarded_policy(guard, models, cfg, dist)
    result = save_result(out_dir / "final", models, state, stats, plan, run.param_digest)
    result.metrics |= guard.result_metrics()
    fired = guard.alarm.fired
    result.alarm = f"{fired.sentence()}; {guard.outcome(state.step)}" if fired else ""
    return result


def start_sampler(models: PPOModels, run: PolicyRun, plan: ExecutionPlan) -> None:
    """ppo.generation.backend 'vllm': a vLLM engine samples the rollouts (`models.sampler`)."""
    if run.cfg.generation.backend == "vllm":
        models.sampler = start_vllm_sampler(
            run.cfg, run.runtime, run.policy_path, models.policy, plan.device, run.seed, plan.dtype, plan.world_size
        )


def rollout_sampler(
    models: PPOModels,
    state: TrainerState,
    prompt_ids: list[list[int]],
    run: PolicyRun,
    plan: ExecutionPlan,
    settings: GenerationSettings,
) -> Callable[[int], Rollout]:
    """A function that generates and scores the batch of prompts at a position of the run's prompt stream (this
    rank's slice of it), with the run's sampling generator."""
    pad_id, cfg, dist = models.tokenizer.pad_token_id, run.cfg, plan.dist

    def sample(position: int) -> Rollout:
        batch = prompt_batch(
            prompt_ids, position, cfg.batch_size, run.seed, pad_id, dist.rank, dist.world_size, cfg.samples_per_prompt
        )
        first_order = first_epoch_order(cfg, state.shuffle_generator, len(batch.indices))
        return generate_and_score(
            models, batch, run.prompts, cfg, settings, state.sample_generator, plan, first_order, run.prompt_rows
        )

    return sample


def category_zero_std(
    models: PPOModels, rows: list[str] | None, cfg: PPOConfig, dist: DistContext
) -> Callable[[Rollout], dict[str, float]] | None:
    """The share of groups without spread by category (`group/zero_std_fraction/<category>`) of a rollout's first
    generation round, where the reward function sorts its rows into categories (a `categories` attribute taking
    the row columns, as `rlhf.data.verifiers.ifeval_strict` has: its instruction types) of the prompts' `rows` (their
    row keys); None elsewhere, and without groups."""
    reward_fn = models.reward_fn
    if reward_fn is None or cfg.samples_per_prompt < 2 or not reward_fn.has_categories:
        return None

    def stats(rollout: Rollout) -> dict[str, float]:
        categories = reward_fn.categories(None if rows is None else [rows[i] for i in rollout.indices])
        counts = zero_std_counts(rollout.scored.scores, cfg.samples_per_prompt, categories)
        return zero_std_by_category(distributed.all_gather_object(counts) if dist.world_size > 1 else [counts])

    return stats


def sample_update(
    update: int,
    sample: Callable[[int], Rollout],
    cfg: PPOConfig,
    pad_id: int,
    dist: DistContext,
    category_stats: Callable[[Rollout], dict[str, float]] | None = None,
) -> tuple[Rollout, dict[str, float]]:
    """Steps 1-3 of an update: `sample(position)` generates and scores the prompts at that position of the prompt
    stream. With dynamic sampling (ppo.dynamic_sampling_rounds), groups without spread are replaced by groups of new
    prompts, from positions past the run's own (the k-th extra round of update u: num_updates + u * rounds + k - 1,
    so a resumed run samples the same ones); its statistics come back with the batch. `category_stats`
    (`category_zero_std`): the first round's groups without spread by category, with the statistics."""
    rollout = sample(update)
    first = category_stats(rollout) if category_stats is not None else {}
    if not cfg.dynamic_rounds:
        return rollout, first
    first_extra = cfg.num_updates + update * cfg.dynamic_rounds
    rollout, stats = dynamic_sampling.refill(rollout, lambda k: sample(first_extra + k - 1), cfg, pad_id, dist)
    return rollout, {**first, **stats}


def place_models(models: PPOModels, dist: DistContext, sharded: bool) -> None:
    """With several processes, the trained models' starting weights broadcast from rank 0 (loaded identically
    anyway: this makes the starting point certain) and, with FSDP, every model sharded over the ranks."""
    if dist.world_size > 1:
        distributed.broadcast_parameters(models.policy)
        if models.value is not None:
            distributed.broadcast_parameters(models.value_trainable())
    if sharded:  # each rank keeps its shards of the models from here on
        shard_models(models, dist)


def save_result(
    final: Path,
    models: PPOModels,
    state: TrainerState,
    stats: dict[str, float],
    plan: ExecutionPlan,
    param_digest: bool,
) -> PPOResult:
    """Write the final models (rank 0; sharded models gathered first, a collective) and describe them."""
    digest, dist = "", plan.dist
    weights = full_weights(models) if plan.sharded else None  # gathered on rank 0: a collective of every rank
    if dist.is_main:
        with atomic_dir(final) as tmp:
            save_final(tmp, models, weights)
            digest = write_manifest(tmp, stage="ppo", updates=state.step)["digest"]
    params = ""
    if dist.world_size > 1:
        digest = distributed.broadcast_object(digest)  # also waits until rank 0 has written `final`
        if param_digest:
            params = distributed.parameter_digest(models.policy, models.value_trainable())
    value_path = final / "value" / "value_head.safetensors" if models.shared_value_head else final / "value"
    value_file = "" if models.value is None else str(value_path)  # a critic-free run has no value model
    return PPOResult(str(final / "policy"), value_file, digest, state.step, stats, params)


def truncated_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], cfg: PPOConfig, dist: DistContext
) -> tuple[list[list[int]], dict[str, float]]:
    """The prompts' token ids fitted into `cfg.max_prompt_tokens` (`rlhf.rollout.prompt_fit.fit_prompts`: a chat
    prompt keeps its template's head and drops its oldest turns, a plain one keeps its last tokens, a BOS kept in
    front), and the share that was cut (a warning above PROMPT_TRUNCATION_WARN)."""
    fit = fit_prompts(tokenizer, prompts, cfg.max_prompt_tokens)
    cut = fit.truncated / max(len(prompts), 1)
    if cut > PROMPT_TRUNCATION_WARN and dist.is_main:
        how = "lose their start (cut on the left)"
        if fit.head_kept:
            how = "lose their oldest turns (the chat template's head and the last turns kept)"
        logger.warning(
            "%.0f%% of the PPO prompts are longer than ppo.max_prompt_tokens (%d) and %s; raise "
            "ppo.max_prompt_tokens to keep them whole",
            100 * cut,
            cfg.max_prompt_tokens,
            how,
        )
    return fit.ids, {"ppo/prompts_truncated_fraction": cut}


def keep_guarded_policy(guard: EvalGuard, models: PPOModels, cfg: PPOConfig, dist: DistContext) -> None:
    """ppo.on_overoptimisation 'stop' or 'keep_best': the policy of the evaluation the guard kept becomes the final
    one (rank 0, which saves it)."""
    kept = guard.kept()
    if kept is not None and dist.is_main:
        restore_parameters(models.policy, kept[1])
        print(f"ppo.on_overoptimisation '{cfg.on_overoptimisation}': the final policy is the one of update {kept[0]}")


def checkpoint_state(
    folder: Path, models: PPOModels, state: TrainerState, dist: DistContext, guard: EvalGuard | None = None
) -> None:
    """Save the resume state: rank 0 writes it, with every rank's sampling generator state (sharded models: every
    rank writes its shards), then (rank 0) the over-optimisation guard's state beside it."""
    write_resume_state(folder, models, state, dist)
    if guard is not None and dist.is_main:
        save_guard(folder, guard)


def write_resume_state(folder: Path, models: PPOModels, state: TrainerState, dist: DistContext) -> None:
    if dist.world_size == 1:
        save_state(folder, models, state)
        return
    sample_rngs = distributed.all_gather_object(state.sample_generator.get_state())
    if sharding.is_sharded(models.policy):
        save_sharded_state(folder, models, state.policy_opt, state.value_opt, trainer_fields(state, sample_rngs), dist)
        return
    if dist.is_main:
        save_state(folder, models, state, sample_rngs)
    distributed.barrier()  # a rank that raises TrainingInterrupted next finds the state written
