"""The pipeline's stages as cached, retryable Prefect tasks: a few lines each over the library."""

from __future__ import annotations

import logging

import pandas as pd
from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.exceptions import MissingContextError

from rlhf import evaluate as evaluation
from rlhf import reward as reward_training
from rlhf import sft as sft_training
from rlhf.checkpoints import write_manifest
from rlhf.config import DataConfig, EvalConfig, PPOConfig, RewardConfig, RuntimeConfig, SFTConfig, flatten
from rlhf.data import prepare
from rlhf.data.lengths import LengthLimits, length_metrics
from rlhf.length_control import EVAL_WARNING_TAG
from rlhf.models.device import set_threads
from rlhf.models.loading import load_tokenizer
from rlhf.models.stop_tokens import same_vocabulary
from rlhf.ppo import launch
from rlhf.ppo.models import run_choices
from rlhf.ppo.trainer import train_ppo
from tasks.caching import StageOutput, TrackingContext, content_cache_key, stage_dir
from tasks.runs import (
    echo_with_progress,
    injected_failure,
    log_data_inputs,
    progress_logger,
    retry_unless_user_error,
    stage_run,
)

STAGE = dict(
    cache_key_fn=content_cache_key,
    persist_result=True,
    result_serializer="json",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_user_error,
)


def task_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect task run's logger (lines in the task's log), or this module's outside a run (`.fn` calls)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


@task(name="prepare_preferences", tags=["data"], **STAGE)
def prepare_preferences(
    data: DataConfig,
    source_digest: str,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
    lengths: LengthLimits | None = None,
) -> StageOutput:
    """Validate the preference data and write train/eval/SFT/prompt Parquet files with a manifest.

    `source_digest` (the content of the local files read) is part of the cache key only. `lengths`: the later
    stages' length limits, which the manifest's length report measures the data against (part of the key too).
    """
    key = {"data": data, "source_digest": source_digest, "lengths": lengths}
    folder = stage_dir(runtime.output_dir, "prepare_preferences", key)
    with stage_run(tracking, "prepare_preferences", folder, flatten(data, "data")) as (tracker, run_id):
        prepared = prepare.prepare_preferences(data, folder, lengths)
        manifest, drops = prepared.manifest, prepare.drop_report(prepared.manifest)
        metrics = {f"data/rows_{k}": v for k, v in manifest["rows"].items()}
        metrics |= {f"data/dropped_{d['reason']}": d["count"] for d in drops}
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
        log_data_inputs(tracker, run_id, prepared.folder, prepared.digest)
    return StageOutput(
        stage="prepare_preferences",
        path=str(folder),
        digest=prepared.digest,
        mlflow_run_id=run_id,
        extra={"manifest": prepared.manifest},
    )


@task(name="supervised_finetune", tags=["gpu"], **STAGE)
def supervised_finetune(
    sft: SFTConfig, data: StageOutput, seed: int, runtime: RuntimeConfig, tracking: TrackingContext
) -> StageOutput:
    """Bootstrap a tiny GPT-2 SFT policy from the demonstrations, fine-tune the configured model on them, or use
    the configured checkpoint as it is; a retry resumes training from its last saved state."""
    set_threads(runtime.threads)
    folder = stage_dir(runtime.output_dir, "supervised_finetune", {"sft": sft, "data": data, "seed": seed})
    with stage_run(tracking, "supervised_finetune", folder, flatten(sft, "sft"), resume=True) as (tracker, run_id):
        if sft.model is not None and not sft.finetune:
            result = sft_training.load_existing(sft, runtime)
        else:
            log_data_inputs(tracker, run_id, data.path, data.digest, "sft.parquet")
            log = tracker.metric_logger(run_id, progress_logger("sft", 100, sft.steps))
            demos, stop_after = f"{data.path}/sft.parquet", injected_failure("supervised_finetune", folder)
            if sft.model is None:
                pairs = f"{data.path}/train.parquet"
                result = sft_training.bootstrap_sft(sft, runtime, demos, pairs, folder, seed, log, stop_after)
            else:
                result = sft_training.finetune_sft(sft, runtime, demos, folder, seed, log, stop_after)
            if tracking.log_checkpoints:
                tracker.log_artifacts(run_id, folder, "sft_checkpoint")
    return StageOutput(
        stage="supervised_finetune",
        path=result.path,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics=result.metrics,
        extra={"trained": result.trained},
    )


@task(name="train_reward_model", tags=["gpu"], **STAGE)
def train_reward_model(
    reward: RewardConfig,
    sft: StageOutput,
    data: StageOutput,
    seed: int,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
) -> StageOutput:
    """Train a scalar-head reward model, initialised from the SFT checkpoint, on the preference pairs."""
    set_threads(runtime.threads)
    folder = stage_dir(
        runtime.output_dir, "train_reward_model", {"reward": reward, "sft": sft, "data": data, "seed": seed}
    )
    with stage_run(tracking, "train_reward_model", folder, flatten(reward, "reward"), resume=True) as (tracker, run_id):
        log_data_inputs(tracker, run_id, data.path, data.digest, "train.parquet", "eval.parquet")
        steps = reward_training.total_steps(reward, data.extra["manifest"]["rows"]["train"])
        log = tracker.metric_logger(run_id, progress_logger("reward", 50, steps))
        result = reward_training.train_reward_model(
            reward,
            runtime,
            sft.path,
            f"{data.path}/train.parquet",
            f"{data.path}/eval.parquet",
            folder,
            seed,
            log,
            stop_after=injected_failure("train_reward_model", folder),
        )
        if tracking.log_checkpoints:
            tracker.log_artifacts(run_id, folder, "reward_model")
    return StageOutput(
        stage="train_reward_model", path=result.path, digest=result.digest, mlflow_run_id=run_id, metrics=result.metrics
    )


@task(name="init_policy_and_value", tags=["gpu"], **STAGE)
def init_policy_and_value(
    sft: StageOutput, reward: StageOutput, runtime: RuntimeConfig, tracking: TrackingContext
) -> StageOutput:
    """Policy and frozen reference from the SFT checkpoint; value model from the reward model."""
    folder = stage_dir(runtime.output_dir, "init_policy_and_value", {"sft": sft, "reward": reward})
    plan = {"policy_init": sft.path, "reference_init": sft.path, "value_init": reward.path, "reward_model": reward.path}
    with stage_run(tracking, "init_policy_and_value", folder, plan) as (tracker, run_id):
        same = same_vocabulary(
            load_tokenizer(sft.path, trust_remote_code=runtime.trust_remote_code),
            load_tokenizer(reward.path, trust_remote_code=runtime.trust_remote_code),
        )
        tracker.log_params(run_id, {"reward_retokenizes": not same})
        folder.mkdir(parents=True, exist_ok=True)
        write_manifest(folder, stage="init", **plan, same_tokenizer=same)
    return StageOutput(
        stage="init_policy_and_value",
        path=sft.path,
        digest=f"{sft.digest}:{reward.digest}",
        mlflow_run_id=run_id,
        extra={**plan, "same_tokenizer": same},
    )


@task(name="train_policy_ppo", tags=["gpu"], **STAGE)
def train_policy_ppo(
    ppo: PPOConfig,
    init: StageOutput,
    data: StageOutput,
    seed: int,
    processes: int,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
) -> StageOutput:
    """PPO against the reward model (in `processes` data-parallel processes when > 1); a retry resumes from the
    last saved trainer state and continues the same MLflow run."""
    set_threads(runtime.threads)
    key = {"ppo": ppo, "init": init, "data": data, "seed": seed, "processes": processes}
    folder = stage_dir(runtime.output_dir, "train_policy_ppo", key)
    params = {
        **flatten(ppo, "ppo"),
        "ppo_processes": processes,
        "reward_retokenizes": not init.extra["same_tokenizer"],
        "value_init": init.extra["value_init"],
        **run_choices(ppo, runtime, init.extra["policy_init"]),  # resolved stop tokens (and LoRA targets)
    }
    with stage_run(tracking, "train_policy_ppo", folder, params, resume=True) as (tracker, run_id):
        log_data_inputs(tracker, run_id, data.path, data.digest, "prompts.parquet")
        models = (init.extra["policy_init"], init.extra["reward_model"])
        stop_after = injected_failure("train_policy_ppo", folder)
        if processes > 1:
            result = launch.run_data_parallel(
                processes,
                ppo,
                runtime,
                seed,
                *models,
                init.extra["value_init"],
                f"{data.path}/prompts.parquet",
                folder,
                tracking_uri=tracking.uri,
                run_id=run_id,
                data_manifest=f"{data.path}/manifest.json",
                stop_after=stop_after,
                echo=echo_with_progress("ppo", ppo.num_updates, launch.UPDATE_LINE_PATTERN),
            )
        else:
            result = train_ppo(
                ppo,
                runtime,
                *models,
                pd.read_parquet(f"{data.path}/prompts.parquet")["prompt"].tolist(),
                folder,
                seed,
                tracker.metric_logger(run_id, progress_logger("ppo", 10, ppo.num_updates)),
                value_path=init.extra["value_init"],
                gold_fn=prepare.gold_scorer(data.extra["manifest"]),
                stop_after=stop_after,
            )
        if ppo.record_rollouts:
            tracker.log_artifacts(run_id, folder / "rollouts", "rollouts")
        if tracking.log_checkpoints:
            tracker.log_artifacts(run_id, folder / "final", "ppo_checkpoint")
    return StageOutput(
        stage="train_policy_ppo",
        path=result.policy_path,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics=result.metrics,
        extra={"value_path": result.value_path, "updates": result.updates},
    )


@task(name="evaluate_policies", tags=["gpu"], **STAGE)
def evaluate_policies(
    evaluation_cfg: EvalConfig,
    ppo: PPOConfig,
    policy: StageOutput,
    sft: StageOutput,
    reward: StageOutput,
    data: StageOutput,
    runtime: RuntimeConfig,
    tracking: TrackingContext,
) -> StageOutput:
    """Generate with the PPO and SFT policies on held-out prompts; scores, KL, win rates (also at equal length),
    response lengths and empty answers, reward-hacking flags, completions table."""
    set_threads(runtime.threads)
    folder = stage_dir(
        runtime.output_dir,
        "evaluate_policies",
        {"evaluation_cfg": evaluation_cfg, "ppo": ppo, "policy": policy, "sft": sft, "reward": reward, "data": data},
    )
    with stage_run(tracking, "evaluate_policies", folder, flatten(evaluation_cfg, "eval")) as (tracker, run_id):
        log_data_inputs(tracker, run_id, data.path, data.digest, "eval.parquet")
        result = evaluation.evaluate_policies(
            evaluation_cfg,
            ppo,
            runtime,
            policy.path,
            sft.path,
            reward.path,
            f"{data.path}/eval.parquet",
            folder,
            prepare.gold_scorer(data.extra["manifest"]),
            tracker.metric_logger(run_id),
        )
        completions = pd.read_parquet(result.completions)
        tracker.log_table(run_id, completions, "completions.json")
        tracker.log_artifacts(run_id, result.completions, "evaluation")
        if result.warnings:
            tracker.set_tags(run_id, {EVAL_WARNING_TAG: "\n".join(result.warnings)})
    return StageOutput(
        stage="evaluate_policies",
        path=result.folder,
        digest=result.digest,
        mlflow_run_id=run_id,
        metrics=result.summary,
        extra={"warnings": result.warnings},
    )
