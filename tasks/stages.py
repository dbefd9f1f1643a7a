"""The pipeline's stages up to the policy's start as cached, retryable Prefect tasks (the data, the SFT policy and
its warm start, the reward model or ensemble, the policy's initialisation), a few lines each over the library, and
the Prefect settings every stage shares (`STAGE`); the policy stages: `tasks.policy_stages`."""

from __future__ import annotations

import pandas as pd
from prefect import task
from prefect.artifacts import create_table_artifact

from rlhf.checkpoints import write_manifest
from rlhf.config import DataConfig, RewardConfig, RuntimeConfig, SFTConfig, WarmStartConfig, flatten
from rlhf.data import prepare
from rlhf.data.lengths import LengthLimits, length_metrics
from rlhf.models.loading import load_tokenizer
from rlhf.models.reward_ensemble import member_tokenizers
from rlhf.stages import ENSEMBLE, GPU_TAG, INIT, PREPARE, REWARD, SFT, WARM_START
from rlhf.train import reward as reward_training
from rlhf.train import reward_ensemble, warm_start
from rlhf.train import sft as sft_training
from tasks.caching import content_cache_key
from tasks.faults import retry_unless_user_error
from tasks.outputs import PolicyInit, PreparedData, RewardModel, SFTModel
from tasks.progress import task_logger
from tasks.stage_runs import log_data_inputs, stage_scope
from tasks.tracking import TrackingContext

# the Prefect task settings of every stage: cached on content digests, retried unless the error is the user's
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
