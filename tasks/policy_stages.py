"""The pipeline's policy stages as cached, retryable Prefect tasks: the policy optimised (PPO's estimators, or DPO)
and evaluated against the SFT policy, a few lines each over the library (the stages before them: `tasks.stages`)."""

from __future__ import annotations

import time

import pandas as pd
from prefect import task

from rlhf.config import DPOConfig, EvalConfig, PPOConfig, RewardConfig, RuntimeConfig, flatten
from rlhf.data import prepare
from rlhf.eval import evaluate as evaluation
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.metrics import TIME_TRAIN
from rlhf.ppo import launch
from rlhf.ppo.models import run_choices
from rlhf.ppo.run import PolicyInputs
from rlhf.stages import DPO, EVALUATE, GPU_TAG, PPO
from rlhf.sweeps.optuna_search import TrialRef, pruning_reporter
from rlhf.train import dpo as dpo_training
from tasks.caching import sft_side_dir
from tasks.outputs import DPOPolicy, Evaluation, PolicyInit, PPOPolicy, PreparedData, RewardModel, SFTModel
from tasks.progress import echo_with_progress, task_logger
from tasks.stage_runs import log_data_inputs, log_policy_checkpoint, rollout_samples, samples_every, stage_scope
from tasks.stages import STAGE
from tasks.tracking import TrackingContext

# the MLflow tag of a policy stage's run (and the pipeline's) that says which algorithm trained the policy
OBJECTIVE_TAG = "rlhf.objective"  # the policy stage's objective: an advantage estimator (gae, grpo, ...) or dpo
# the MLflow tag of a PPO stage's run (and the pipeline's) whose over-optimisation alarm fired: its sentence
OVEROPTIMISATION_TAG = "rlhf.overoptimisation_alarm"
# the MLflow tag of an evaluation stage's run: "true" where the SFT policy's side was an earlier run's (not sampled)
SFT_SIDE_REUSED_TAG = "rlhf.eval_sft_side_reused"


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
