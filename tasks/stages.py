"""The pipeline's stages as cached, retryable Prefect tasks: a few lines each over the library."""

from __future__ import annotations

import time

import pandas as pd
from prefect import task
from prefect.artifacts import create_table_artifact

from rlhf.checkpoints import write_manifest
from rlhf.config import (
    DataConfig,
    DPOConfig,
    EvalConfig,
    PPOConfig,
    RewardConfig,
    RuntimeConfig,
    SFTConfig,
    WarmStartConfig,
    flatten,
)
from rlhf.data import prepare
from rlhf.data.lengths import LengthLimits, length_metrics
from rlhf.eval import evaluate as evaluation
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.metrics import TIME_TRAIN
from rlhf.models.loading import load_tokenizer
from rlhf.models.reward_ensemble import member_tokenizers
from rlhf.ppo import launch
from rlhf.ppo.models import run_choices
from rlhf.ppo.run import PolicyInputs
from rlhf.stages import DPO, ENSEMBLE, EVALUATE, GPU_TAG, INIT, PPO, PREPARE, REWARD, SFT, WARM_START
from rlhf.sweeps.optuna_search import TrialRef, pruning_reporter
from rlhf.train import dpo as dpo_training
from rlhf.train import reward as reward_training
from rlhf.train import reward_ensemble, warm_start
from rlhf.train import sft as sft_training
from tasks.caching import content_cache_key, sft_side_dir
from tasks.faults import retry_unless_user_error
from tasks.outputs import DPOPolicy, Evaluation, PolicyInit, PPOPolicy, PreparedData, RewardModel, SFTModel
from tasks.progress import echo_with_progress, task_logger
from tasks.stage_runs import log_data_inputs, log_policy_checkpoint, rollout_samples, samples_every, stage_scope
from tasks.tracking import TrackingContext

# the MLflow tag of a policy stage's run (and the pipeline's) that says which algorithm trained the policy
OBJECTIVE_TAG = "rlhf.objective"  # the policy stage's objective: an advantage estimator (gae, grpo, ...) or dpo
# the MLflow tag of a PPO stage's run (and the pipeline's) whose over-optimisation alarm fired: its sentence
OVEROPTIMISATION_TAG = "rlhf.overoptimisation_alarm"
# the MLflow tag of an evaluation stage's run: "true" where the SFT policy's side was an earlier run's (not sampled)
SFT_SIDE_REUSED_TAG = "rlhf.eval_sft_side_reused"

STAGE = dict(
    cache_key_fn=content_cache_key,
    persist_result=True,
    result_serializer="json",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_user_error,
)


@task(name=PREPARE.task, tags=["data"], **STAGE)
def prepare_preferences(
    data_cfg: DataConfig,
    source_digest: str,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
    lengths: LengthLimits | None = None,
) -> PreparedData:
    """Validate the preference data and write train/eval/SFT/prompt Parquet files with a manifest.

    `source_digest` (the content of the local files read) is part of the cache key only. `lengths`: the later
    stages' length limits, which the manifest's length report measures the data against (part of the key too).
    """
    with stage_scope(tracking, runtime, flatten(data_cfg, "data")) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        written = prepare.prepare_preferences(data_cfg, folder, lengths)
        manifest, drops = written.manifest, prepare.drop_report(written.manifest)
        metrics = {f"data/rows_{k}": v for k, v in manifest["rows"].items()}
        metrics |= {f"data/dropped_{drop['reason']}": drop["count"] for drop in drops}
        metrics |= length_metrics(manifest)
        tracker.log_metrics(run_id, metrics, 0)
        table = pd.DataFrame(drops, columns=["reason", "count", "fraction", "example", "meaning"])
        tracker.log_table(run_id, table, "data/dropped.json")
        create_table_artifact(
            drops,
            key="prepare-preferences-drops",
            description=f"Rows dropped while preparing {manifest['source']} ({manifest.get('rows_in')} in).",
        )
        length_rows = prepare.length_table(manifest)
        tracker.log_table(run_id, pd.DataFrame(length_rows), "data/lengths.json")
        unit = manifest.get("lengths", {}).get("unit", "tokens")
        create_table_artifact(
            length_rows,
            key="prepare-preferences-lengths",
            description=f"Lengths ({unit}) of the prepared {manifest['source']} data against the stages' limits.",
        )
        for line in manifest.get("warnings", []):
            task_logger().warning("%s", line)
        tracker.log_artifacts(run_id, folder, "data")
        log_data_inputs(tracker, run_id, written.folder, written.digest)
    return PreparedData(
        stage=stage.name,
        path=str(folder),
        digest=written.digest,
        mlflow_run_id=run_id,
        manifest=written.manifest,
    )


@task(name=SFT.task, tags=[GPU_TAG], **STAGE)
def supervised_finetune(
    sft_cfg: SFTConfig, prepared: PreparedData, seed: int, runtime: RuntimeConfig, tracking: TrackingContext
) -> SFTModel:
    """Bootstrap a tiny GPT-2 SFT policy from the demonstrations, fine-tune the configured model on them, or use
    the configured checkpoint as it is; a retry resumes training from its last saved state."""
    with stage_scope(tracking, runtime, {**flatten(sft_cfg, "sft"), "seed": seed}, resume=True) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        if sft_cfg.model is not None and not sft_cfg.finetune:
            result = sft_training.load_existing(sft_cfg, runtime)
        else:
            log_data_inputs(tracker, run_id, prepared.path, prepared.digest, "sft.parquet")
            log = stage.training_log(runtime, 100, sft_cfg.steps)
            demos, stop_after = f"{prepared.path}/sft.parquet", stage.stop_after
            if sft_cfg.model is None:
                pairs = f"{prepared.path}/train.parquet"
                result = sft_training.bootstrap_sft(sft_cfg, runtime, demos, pairs, folder, seed, log, stop_after)
            else:
                result = sft_training.finetune_sft(sft_cfg, runtime, demos, folder, seed, log, stop_after)
            if tracking.log_checkpoints:
                tracker.log_artifacts(run_id, folder, "sft_checkpoint")
    return SFTModel(
        stage=stage.name,
        path=result.path,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics=result.metrics,
        trained=result.trained,
    )


@task(name=WARM_START.task, tags=[GPU_TAG], **STAGE)
def warm_start_policy(
    warm_cfg: WarmStartConfig,
    sft_cfg: SFTConfig,
    sampling: warm_start.WarmStartSampling,
    sft_model: SFTModel,
    prepared: PreparedData,
    seed: int,
    reward_functions: list[str],
    reward_weights: list[float],
    reward_function_digest: str,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
) -> SFTModel:
    """Verified best-of-N warm start: the SFT policy's samples on the training prompts, those `reward_functions`
    (their weighted sum) pass kept, the SFT policy fine-tuned on them. A retry reads the samples written and resumes
    the fine-tuning from its last saved state; a warm start that kept nothing stops with one sentence, never retried.
    `reward_function_digest` (the function's name and source file) is in the cache key only."""
    params = {**flatten(warm_cfg, "warm_start"), **flatten(sampling, "warm_start.sampling"), "seed": seed}
    verifier = {"reward.functions": ", ".join(reward_functions), "reward.weights": str(reward_weights)}
    with stage_scope(tracking, runtime, {**params, **verifier}, resume=True) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        log_data_inputs(tracker, run_id, prepared.path, prepared.digest, "prompts.parquet")
        prompts = f"{prepared.path}/prompts.parquet"
        samples = warm_start.draw_samples(
            warm_cfg, sampling, runtime, sft_model.path, prompts, reward_functions, reward_weights, folder, seed
        )
        sampled = warm_start.sample_metrics(samples)
        tracker.log_metrics(run_id, sampled, 0)
        if samples.seconds is not None and len(samples.kept):  # drawn now (MLflow appends to a table logged again)
            tracker.log_table(run_id, samples.kept, "warm_start/kept.json")
        log = stage.training_log(runtime, 10, warm_cfg.steps)
        result = warm_start.finetune_on_kept(
            warm_cfg, sft_cfg, runtime, sft_model.path, samples, folder, seed, log, stage.stop_after
        )
        if tracking.log_checkpoints:
            tracker.log_artifacts(run_id, result.path, "warm_start_checkpoint")
    return SFTModel(
        stage=stage.name,
        path=result.path,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics={**sampled, **result.metrics},
        trained=True,
    )


@task(name=REWARD.task, tags=[GPU_TAG], **STAGE)
def train_reward_model(
    reward_cfg: RewardConfig,
    sft_model: SFTModel | None,
    prepared: PreparedData,
    seed: int,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
    base_model: str | None = None,
) -> RewardModel:
    """Train a scalar-head reward model, initialised from the SFT checkpoint `sft_model` or from `base_model` (an
    ensemble member's own model of reward.ensemble_models, with its own tokenizer; `sft_model` None), on the
    preference pairs."""
    init_path = base_model if base_model is not None else sft_model.path
    params = {**flatten(reward_cfg, "reward"), "seed": seed, "reward.init": init_path}
    with stage_scope(tracking, runtime, params, resume=True) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        log_data_inputs(tracker, run_id, prepared.path, prepared.digest, "train.parquet", "eval.parquet")
        steps = reward_training.total_steps(reward_cfg, prepared.manifest["rows"]["train"])
        log = stage.training_log(runtime, 50, steps)
        result = reward_training.train_reward_model(
            reward_cfg,
            runtime,
            init_path,
            f"{prepared.path}/train.parquet",
            f"{prepared.path}/eval.parquet",
            folder,
            seed,
            log,
            stop_after=stage.stop_after,
        )
        if tracking.log_checkpoints:
            tracker.log_artifacts(run_id, folder, "reward_model")
    return RewardModel(
        stage=stage.name, path=result.path, digest=result.digest, mlflow_run_id=run_id, metrics=result.metrics
    )


@task(name=ENSEMBLE.task, tags=[GPU_TAG], **STAGE)
def combine_reward_ensemble(
    reward_cfg: RewardConfig,
    members: list[RewardModel],
    prepared: PreparedData,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
) -> RewardModel:
    """Make one reward-model ensemble of the trained members: their held-out accuracies, agreement and
    disagreement, each member's offset (reward.ensemble_size > 1)."""
    params = {
        "reward.ensemble_size": len(members),
        "reward.ensemble_objective": reward_cfg.ensemble_objective,
        "reward.ensemble_trunks": reward_cfg.ensemble_trunks,
    }
    with stage_scope(tracking, runtime, params) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        paths = [member.path for member in members]
        tracker.log_params(run_id, {f"member_{k}": path for k, path in enumerate(paths)})
        result = reward_ensemble.build_ensemble(
            reward_cfg, runtime, paths, f"{prepared.path}/eval.parquet", folder, tracker.metric_logger(run_id)
        )
    return RewardModel(
        stage=stage.name,
        path=result.path,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics=result.metrics,
        members=paths,
    )


@task(name=INIT.task, tags=[GPU_TAG], **STAGE)
def init_policy_models(
    sft_model: SFTModel,
    reward_model: RewardModel | None,
    critic: bool,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
) -> PolicyInit:
    """Record which checkpoints the PPO models start from (policy and frozen reference: `sft_model`, the SFT model or
    the warm-started one; value model and reward model: the reward model) and whether the policy and the reward model
    share a tokenizer. Without a value model (`critic` false: a critic-free estimator) `value_init` is empty; without
    a reward model (reward.source: function) `reward_model` is empty and gae's value model starts from `sft_model`."""
    reward_path = reward_model.path if reward_model is not None else ""
    value_from = reward_model.members[0] if reward_model is not None and reward_model.members else reward_path
    init = {
        "policy_init": sft_model.path,
        "reference_init": sft_model.path,
        "value_init": (value_from or sft_model.path) if critic else "",
        "reward_model": reward_path,
    }
    trust = runtime.trust_remote_code
    with stage_scope(tracking, runtime, init) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        # every scoring model reads the policy's token ids as they are (an ensemble's members may differ)
        policy_tokenizer = load_tokenizer(sft_model.path, trust_remote_code=trust) if reward_path else None
        same = not reward_path or all(
            tokenizer is None for tokenizer in member_tokenizers(reward_path, policy_tokenizer, trust)
        )
        tracker.log_params(run_id, {"reward_retokenizes": not same})
        folder.mkdir(parents=True, exist_ok=True)
        write_manifest(folder, stage="init", **init, same_tokenizer=same)
    return PolicyInit(
        stage=stage.name,
        path=sft_model.path,
        digest=f"{sft_model.digest}:{reward_model.digest if reward_model is not None else 'function'}:{critic}",
        mlflow_run_id=run_id,
        **init,
        same_tokenizer=same,
    )


@task(name=PPO.task, tags=[GPU_TAG], **STAGE)
def train_policy_ppo(
    ppo_cfg: PPOConfig,
    ppo_init: PolicyInit,
    prepared: PreparedData,
    seed: int,
    processes: int,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
    reward_cfg: RewardConfig | None = None,
    reward_function_digest: str | None = None,
    trial: TrialRef | None = None,
) -> PPOPolicy:
    """The RL stage: ppo.advantage_estimator's policy optimisation against the reward model or reward function (in
    `processes` data-parallel processes when > 1); a retry resumes from the last saved trainer state and continues
    the same MLflow run. `reward_function_digest` (the function's name and source file) is in the cache key only.
    `trial`: the Optuna trial (of a sweep) its periodic evaluations are reported to; its pruner may stop the stage
    (`TrialPruned`)."""
    params = {
        **flatten(ppo_cfg, "ppo"),
        **ppo_cfg.resolved(),  # what the unset settings resolve to for this estimator
        "seed": seed,
        "ppo_processes": processes,
        "reward_retokenizes": not ppo_init.same_tokenizer,
        "value_init": ppo_init.value_init,
        **run_choices(ppo_cfg, runtime, ppo_init.policy_init),  # resolved stop tokens (and LoRA targets)
    }
    started = time.perf_counter()
    with stage_scope(tracking, runtime, params, resume=True) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        tracker.set_tags(run_id, {OBJECTIVE_TAG: ppo_cfg.advantage_estimator})
        log_data_inputs(tracker, run_id, prepared.path, prepared.digest, "prompts.parquet")
        stop_after, updates, several = stage.stop_after, ppo_cfg.num_updates, processes > 1
        inputs = PolicyInputs.prepared(
            ppo_cfg, runtime, seed, prepared.path,
            policy_path=ppo_init.policy_init, reward_path=ppo_init.reward_model or None, out_dir=str(folder),
            value_path=ppo_init.value_init or None, reward=reward_cfg, stop_after=stop_after,
        )  # fmt: skip
        result = launch.train_policy(
            inputs,
            processes=processes,
            # one process logs here; several log from their rank 0 and print progress lines
            log=None if several else stage.training_log(runtime, 10, updates, ppo_cfg.label),
            echo=(
                echo_with_progress(PPO.short, updates, launch.UPDATE_LINE_PATTERN, ppo_cfg.label) if several else print
            ),
            tracking_uri=tracking.uri,
            run_id=run_id,
            on_eval=pruning_reporter(trial) if trial is not None else None,
        )
        if result.alarm:  # the over-optimisation alarm fired at a periodic evaluation
            tracker.set_tags(run_id, {OVEROPTIMISATION_TAG: result.alarm})
        if ppo_cfg.record_rollouts:
            tracker.log_artifacts(run_id, folder / "rollouts", "rollouts")
            # a sample of the rollouts every few updates, as an MLflow table (the run's artifacts, and Evaluation)
            samples = rollout_samples(folder / "rollouts", samples_every(result.updates))
            if samples is not None:
                tracker.log_table(run_id, samples, "rollout_samples.json")
        if tracking.log_checkpoints:
            log_policy_checkpoint(tracker, run_id, folder / "final", result.policy_path, "ppo")
    return PPOPolicy(
        stage=stage.name,
        path=result.policy_path,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics={**result.metrics, TIME_TRAIN: time.perf_counter() - started},
        value_path=result.value_path,
        updates=result.updates,
        alarm=result.alarm,
    )


@task(name=DPO.task, tags=[GPU_TAG], **STAGE)
def train_policy_dpo(
    dpo_cfg: DPOConfig,
    sft_model: SFTModel,
    prepared: PreparedData,
    seed: int,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
) -> DPOPolicy:
    """DPO of the SFT policy `sft_model` (the warm-started one where warm_start.enabled) on the preference pairs
    against its frozen self (`algorithm: dpo`); a retry resumes from the last saved state and continues the same
    MLflow run."""
    started = time.perf_counter()
    params = {**flatten(dpo_cfg, "dpo"), "seed": seed}
    with stage_scope(tracking, runtime, params, resume=True) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        tracker.set_tags(run_id, {OBJECTIVE_TAG: "dpo"})
        log_data_inputs(tracker, run_id, prepared.path, prepared.digest, "train.parquet", "eval.parquet")
        steps = dpo_training.total_steps(dpo_cfg, prepared.manifest["rows"]["train"])
        log = stage.training_log(runtime, 10, steps)
        result = dpo_training.train_dpo(
            dpo_cfg,
            runtime,
            sft_model.path,
            f"{prepared.path}/train.parquet",
            f"{prepared.path}/eval.parquet",
            folder,
            seed,
            log,
            stop_after=stage.stop_after,
        )
        if tracking.log_checkpoints:
            log_policy_checkpoint(tracker, run_id, folder / "final", result.path, "dpo")
    return DPOPolicy(
        stage=stage.name,
        path=result.path,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics={**result.metrics, TIME_TRAIN: time.perf_counter() - started},
        steps=result.steps,
    )


@task(name=EVALUATE.task, tags=[GPU_TAG], **STAGE)
def evaluate_policies(
    eval_cfg: EvalConfig,
    ppo_cfg: PPOConfig,
    policy: PPOPolicy | DPOPolicy,
    sft_model: SFTModel,
    reward_model: RewardModel | None,
    prepared: PreparedData,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
    reward_cfg: RewardConfig | None = None,
    reward_function_digest: str | None = None,
    benchmark_digest: str | None = None,
) -> Evaluation:
    """Generate with the trained (PPO's estimator or DPO) and SFT policies on held-out prompts; scores (the reward
    model's, or the reward function's), KL, win rates (also at equal length), response lengths and empty answers,
    reward-hacking flags, completions table; the eval.benchmarks' figures (`benchmark_digest`, their files' content,
    is in the cache key only)."""
    # the SFT policy's side: shared with every run of the same SFT policy, scorer, prompts and sampling settings
    sft_side = sft_side_dir(
        eval_cfg, ppo_cfg, runtime, sft_model=sft_model, reward_model=reward_model, prepared=prepared,
        reward_cfg=reward_cfg, reward_function_digest=reward_function_digest, benchmark_digest=benchmark_digest,
    )  # fmt: skip
    with stage_scope(tracking, runtime, {**flatten(eval_cfg, "eval"), "eval.sft_side": str(sft_side)}) as stage:
        tracker, run_id, folder = stage.tracker, stage.run_id, stage.folder
        log_data_inputs(tracker, run_id, prepared.path, prepared.digest, "eval.parquet")
        result = evaluation.evaluate_policies(
            eval_cfg,
            ppo_cfg,
            runtime,
            policy.path,
            sft_model.path,
            reward_model.path if reward_model is not None else None,
            f"{prepared.path}/eval.parquet",
            folder,
            prepare.gold_scorer(prepared.manifest, prepared.path),
            tracker.metric_logger(run_id),
            reward_cfg,
            reward_is_gold=reward_cfg is not None and reward_cfg.is_the_gold(prepared.manifest.get("gold_reward")),
            sft_side=sft_side,
        )
        tracker.set_tags(run_id, {SFT_SIDE_REUSED_TAG: str(result.sft_reused).lower()})
        if result.sft_reused:
            task_logger().info("the SFT policy's responses were read from %s (an earlier run's, same inputs)", sft_side)
        completions = pd.read_parquet(result.completions)
        tracker.log_table(run_id, completions, "completions.json")
        tracker.log_artifacts(run_id, result.completions, "evaluation")
        for path in result.benchmark_files:  # each benchmark's report (.md) and per-instruction verdicts (.parquet)
            tracker.log_artifacts(run_id, path, "evaluation")
        if result.warnings:
            tracker.set_tags(run_id, {EVAL_WARNING_TAG: "\n".join(result.warnings)})
    return Evaluation(
        stage=stage.name,
        path=result.folder,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics=result.summary,
        warnings=result.warnings,
    )
