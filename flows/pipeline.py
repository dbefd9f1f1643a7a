"""The RLHF pipeline flow: preferences -> SFT -> reward model -> init -> PPO -> evaluation.

Run it with ``make run`` or ``python -m flows.pipeline --config conf/default.yaml key.sub=value ...``. Its MLflow run
is flows/pipeline_run.py, the summary it prints flows/summary.py, the stages tasks/stage_table.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NamedTuple

from prefect import flow
from prefect.states import Completed

from flows.artifacts import StageProgress, publish_pipeline_results
from flows.pipeline_run import cache_tags, close_pipeline_run, open_pipeline_run, register_policy
from flows.prefect_home import prepare_prefect_database
from flows.summary import PPO_EPISODES, SFT_STEPS, format_summary
from flows.terminal import exit_code_of, stop_on_signals
from rlhf.config import PipelineConfig, load_config
from rlhf.data.lengths import LengthLimits
from rlhf.data.prepare import source_fingerprint
from rlhf.errors import TrialPruned, UserInputError
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.preflight import preflight
from rlhf.sweeps.optuna_search import TrialRef
from tasks.caching import run_stage
from tasks.outputs import PreparedData, RewardModel, SFTModel
from tasks.stage_table import STAGES, stage_of
from tasks.stages import (
    evaluate_policies,
    init_policy_models,
    prepare_preferences,
    supervised_finetune,
    train_policy_ppo,
    train_reward_model,
)
from tasks.tracking import TrackingContext, tracker_for

PRUNED_STATE = "Pruned"  # the final state of a pipeline run that its sweep's pruner stopped


@flow(name="rlhf-pipeline", log_prints=True)
def rlhf_pipeline(
    config: PipelineConfig = PipelineConfig(),  # noqa: B008 (Prefect form default)
    trial: TrialRef | None = None,
) -> dict[str, Any]:
    """Run the whole RLHF-with-PPO recipe; every stage is cached on its content and retried on failure.

    `trial` (set by Optuna sweeps, leave it empty): the study trial PPO's periodic evaluations are reported to; when
    its pruner stops the trial, the run ends in the state 'Pruned' and its MLflow run KILLED, tagged sweep.pruned."""
    estimates = preflight(config)
    tracking = open_pipeline_run(config, trial)
    try:
        summary = _run_stages(config, tracking, trial)
    except TrialPruned as pruned:
        close_pipeline_run(tracking, {}, pruned=True)
        return Completed(name=PRUNED_STATE, message=str(pruned))
    except BaseException:
        close_pipeline_run(tracking, {}, failed=True)
        raise
    # the memory each stage was estimated to need, beside what it measured (memory/<stage>_peak_mb)
    summary |= {f"memory/{estimate.stage}_estimate_mb": estimate.total / 2**20 for estimate in estimates}

    close_pipeline_run(tracking, summary)
    publish_pipeline_results(summary, config.tracking)  # MLflow link and evaluation table
    return summary


class Upstream(NamedTuple):
    """The stages before PPO, which sweep variants that only change ppo.* or eval.* share."""

    prepared: PreparedData
    sft_model: SFTModel
    reward_model: RewardModel


def upstream_signature(config: PipelineConfig) -> str:
    """Equal for two configs whose data, SFT and reward-model stages are the same (a sweep builds those once)."""
    keys = {
        "data": config.data.model_dump(mode="json"),
        "sft": config.sft.model_dump(mode="json"),
        "reward": config.reward.model_dump(mode="json"),
        "seed": config.seed,
        "lengths": LengthLimits.from_config(config).model_dump(mode="json"),
        "output_dir": config.runtime.output_dir,
    }
    return json.dumps(keys, sort_keys=True, default=str)


def run_upstream(config: PipelineConfig, tracking: TrackingContext, progress: StageProgress | None = None) -> Upstream:
    """Preferences, SFT and reward model (from the cache when they were built before)."""
    common = {"runtime": config.runtime, "tracking": tracking}
    prepared = run_stage(
        prepare_preferences,
        data_cfg=config.data,
        source_digest=source_fingerprint(config.data),
        lengths=LengthLimits.from_config(config),  # the report's limits: a change re-prepares (same digest)
        **common,
    )
    if progress:
        progress.done(stage_of(prepared.stage).label)
    sft_model = run_stage(supervised_finetune, sft_cfg=config.sft, prepared=prepared, seed=config.seed, **common)
    if progress:
        progress.done(stage_of(sft_model.stage).label)
    reward_model = run_stage(
        train_reward_model,
        reward_cfg=config.reward,
        sft_model=sft_model,
        prepared=prepared,
        seed=config.seed,
        **common,
    )
    if progress:
        progress.done(stage_of(reward_model.stage).label)
    return Upstream(prepared, sft_model, reward_model)


def _run_stages(config: PipelineConfig, tracking: TrackingContext, trial: TrialRef | None = None) -> dict[str, Any]:
    """The stages in order; each result (paths and digests) feeds the next stage's cache key."""
    common = {"runtime": config.runtime, "tracking": tracking}
    progress = StageProgress([stage.label for stage in STAGES])  # a progress artifact in the Prefect UI
    prepared, sft_model, reward_model = run_upstream(config, tracking, progress)
    ppo_init = run_stage(init_policy_models, sft_model=sft_model, reward_model=reward_model, **common)
    progress.done(stage_of(ppo_init.stage).label)
    policy = run_stage(
        train_policy_ppo,
        ppo_cfg=config.ppo,
        ppo_init=ppo_init,
        prepared=prepared,
        seed=config.seed,
        processes=config.runtime.ppo_processes,
        trial=trial,
        **common,
    )
    progress.done(stage_of(policy.stage).label)
    evaluation = run_stage(
        evaluate_policies,
        eval_cfg=config.eval,
        ppo_cfg=config.ppo,
        policy=policy,
        sft_model=sft_model,
        reward_model=reward_model,
        prepared=prepared,
        **common,
    )
    progress.done(stage_of(evaluation.stage).label)
    summary: dict[str, Any] = {
        "reward/eval_accuracy": reward_model.metrics["reward/eval_accuracy"],
        **evaluation.metrics,
        "data": prepared.path,
        "data_digest": prepared.digest,
        "sft_checkpoint": sft_model.path,
        "reward_checkpoint": reward_model.path,
        "policy_checkpoint": policy.path,
        "value_checkpoint": policy.value_path,
        "completions": f"{evaluation.path}/completions.parquet",
        "mlflow_run_id": tracking.parent_run_id,
        "mlflow_experiment_id": tracker_for(tracking).experiment_id,
        "tracking_uri": tracking.uri,
        # the run's budget, by which the printed summary tells a plumbing check from learning (flows/summary.py)
        PPO_EPISODES: config.ppo.total_episodes,
        **({SFT_STEPS: config.sft.steps} if config.sft.model is None else {}),
        # the measured peak memory of the training stages (logged beside the preflight estimate)
        **{
            f"memory/{name}_peak_mb": output.metrics["memory/peak_mb"]
            for name, output in (("sft", sft_model), ("reward", reward_model), ("ppo", policy))
            if "memory/peak_mb" in output.metrics
        },
        # the MLflow run of every stage, also of cached ones (the run that computed the result)
        **{
            f"stage.{output.stage}.run_id": output.mlflow_run_id
            for output in (prepared, sft_model, reward_model, ppo_init, policy, evaluation)
        },
    }
    summary |= cache_tags(tracking, (prepared, sft_model, reward_model, ppo_init, policy, evaluation))
    if evaluation.warnings:  # a tag of the pipeline run, a line of the summary and the Prefect table
        summary[EVAL_WARNING_TAG] = "\n".join(evaluation.warnings)
    if tracking.registered_model:
        summary["registered_policy"] = register_policy(tracking, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="conf/default.yaml", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. ppo.kl_coef=0.1")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        preflight(config)  # before anything is loaded
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prepare_prefect_database()
    stop_on_signals(config.tracking)  # Ctrl-C and SIGTERM: state kept, runs KILLED, no server left
    code, summary = exit_code_of(lambda: rlhf_pipeline(config))
    if summary is not None:
        print(format_summary(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
