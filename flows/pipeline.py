"""The RLHF pipeline flow: preferences -> SFT -> (warm start) -> reward model -> init -> PPO (or DPO) -> evaluation.

`algorithm: ppo` runs the RL stage with ppo.advantage_estimator (PPO's GAE or a critic-free estimator),
`algorithm: dpo` the DPO stage instead of init and PPO; `reward.source: function` skips the reward-model stage;
`warm_start.enabled` fine-tunes the SFT policy on its own verified samples, and the policy stage starts from that.

Run it with ``make run``, ``rlhf run`` or ``python -m flows.pipeline --config conf/default.yaml key.sub=value ...``
(the command: flows/pipeline_command.py). Its MLflow run is flows/pipeline_run.py, the summary it prints
flows/summary.py, the stages rlhf/stages.py.
"""

from __future__ import annotations

import json
import runpy
from typing import Any, NamedTuple

from prefect import flow, get_run_logger
from prefect.states import Completed

from flows.artifacts import StageProgress, publish_pipeline_results
from flows.crashed_runs import check_in, resume_links
from flows.pipeline_run import cache_tags, close_pipeline_run, open_pipeline_run, register_policy
from flows.summary import (
    COMPUTE_REASON_TAG,
    COMPUTE_TAG,
    TRACKING_URI_FROM,
    budget,
    compute,
    name_the_policy,
    policy_label,
    stage_label,
    summary_block,
    summary_notes,
)
from flows.terminal import BROWSER_ONLY, cancel_served_run, quiet_stop_in_served_run
from rlhf.config import PipelineConfig, RewardConfig
from rlhf.config.estimators import OBJECTIVE_LABEL_TAG
from rlhf.config.sections import tracking_uri_origin
from rlhf.data.lengths import LengthLimits
from rlhf.data.prepare import source_fingerprint
from rlhf.errors import TrialPruned
from rlhf.eval import benchmark
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.eval.overoptimisation import ALARM_STEP_KEY, KEPT_STEP_KEY
from rlhf.metrics import (
    PEAK_MEMORY,
    REWARD_BEST_EVAL_ACCURACY,
    REWARD_FUNCTION_PREFIX,
    TIME_POLICY_TRAIN,
    TIME_TRAIN,
)
from rlhf.preflight import preflight
from rlhf.rollout.reward_function import function_digest
from rlhf.stages import REWARD, SFT, WARM_START, stage_of, stages_of
from rlhf.sweeps.optuna_search import TrialRef
from rlhf.train.warm_start import WarmStartSampling
from tasks.caching import run_stage, runtime_key
from tasks.outputs import DPOPolicy, PPOPolicy, PreparedData, RewardModel, SFTModel
from tasks.stage_runs import stopped_by_signal
from tasks.stages import (
    OVEROPTIMISATION_TAG,
    combine_reward_ensemble,
    evaluate_policies,
    init_policy_models,
    prepare_preferences,
    supervised_finetune,
    train_policy_dpo,
    train_policy_ppo,
    train_reward_model,
    warm_start_policy,
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
    check_in()  # labels this run with its process; runs of killed processes become Crashed (flows/crashed_runs.py)
    quiet_stop_in_served_run()  # served by make ui: Ctrl-C there prints one sentence, not the stage's traceback
    estimates = preflight(config)
    said = compute(config)  # runtime.dtype resolved ('auto': by this machine's CPU check, cached), and why
    get_run_logger().info("computing in %s (%s)", said[COMPUTE_TAG], said[COMPUTE_REASON_TAG])
    tracking = open_pipeline_run(config, trial)
    try:
        summary = _run_stages(config, tracking, trial)
    except TrialPruned as pruned:
        close_pipeline_run(tracking, {}, pruned=True)
        return Completed(name=PRUNED_STATE, message=str(pruned))
    except BaseException as err:  # Ctrl-C or SIGTERM (in a served run too): KILLED, as the CLI ends it
        close_pipeline_run(tracking, {}, failed=True, killed=stopped_by_signal(err))
        cancel_served_run(err)  # Ctrl-C on make ui: the flow run Cancelled, not Crashed
        raise
    # the memory each stage was estimated to need, beside what it measured (memory/<stage>_peak_mb)
    summary |= {f"memory/{estimate.stage}_estimate_mb": estimate.total / 2**20 for estimate in estimates}

    # the notes and warnings the terminal prints, where a run started from the browser is looked at: the flow run's
    # log, the MLflow run's description and the evaluation table's description
    notes = summary_notes(summary)
    for line in notes:
        get_run_logger().warning(line)
    # ... and the summary's figures, the alarm's line among them: the end of the flow run's log (the command prints them
    # on the terminal itself)
    get_run_logger().info("%s", summary_block(summary).strip("\n"), extra={BROWSER_ONLY: True})
    close_pipeline_run(tracking, summary, description="\n\n".join(notes))
    publish_pipeline_results(summary, config.tracking)  # MLflow link and evaluation table
    return summary


class Upstream(NamedTuple):
    """The stages before the policy stage, which sweep variants that only change ppo.*, dpo.* or eval.* share."""

    prepared: PreparedData
    sft_model: SFTModel
    reward_model: RewardModel | None  # None with reward.source: function
    warm_started: SFTModel | None = None  # the warm start's checkpoint (warm_start.enabled), else None

    @property
    def policy_start(self) -> SFTModel:
        """What the policy stage's policy and reference start from: the warm-started model, else the SFT model."""
        return self.warm_started or self.sft_model


def reward_function_digest(reward: RewardConfig) -> str | None:
    """The digest of the reward function the policy and evaluation stages score with (None: none is used)."""
    return function_digest(reward.function_specs, reward.function_weights) if reward.uses_function else None


def warm_start_inputs(config: PipelineConfig) -> dict[str, Any]:
    """The parameters of the warm-start stage that come from the config: its section, the SFT stage's fine-tuning
    settings, what it takes of the policy stage's sampling, the seed, the verifier and its digest."""
    reward = config.reward  # the config refuses warm_start.enabled without a function
    return {
        "warm_cfg": config.warm_start,
        "sft_cfg": config.sft,
        "sampling": WarmStartSampling.of(config.warm_start, config.ppo),
        "seed": config.seed,
        "reward_functions": reward.function_specs,
        "reward_weights": reward.function_weights,
        "reward_function_digest": function_digest(reward.function_specs, reward.function_weights),
    }


def upstream_signature(config: PipelineConfig) -> str:
    """Equal for two configs whose data, SFT, warm-start and reward-model stages are the same (a sweep builds those
    once): a warm start's sampling settings of ppo.* are in it, the rest of ppo.* is not."""
    keys = {
        "data": config.data.model_dump(mode="json"),
        "sft": config.sft.model_dump(mode="json"),
        "reward": config.reward.model_dump(mode="json"),
        "seed": config.seed,
        "lengths": LengthLimits.from_config(config).model_dump(mode="json"),
        "output_dir": config.runtime.output_dir,
        "runtime": {stage: runtime_key(stage, config.runtime) for stage in (SFT.task, REWARD.task)},
    }
    if config.warm_start.enabled:  # absent otherwise: the signatures of configs without a warm start are as they were
        keys["warm_start"] = config.warm_start.model_dump(mode="json")
        keys["warm_start_sampling"] = WarmStartSampling.of(config.warm_start, config.ppo).model_dump(mode="json")
        keys["runtime"][WARM_START.task] = runtime_key(WARM_START.task, config.runtime)
    return json.dumps(keys, sort_keys=True, default=str)


def run_upstream(config: PipelineConfig, tracking: TrackingContext, progress: StageProgress | None = None) -> Upstream:
    """Preferences, SFT, the warm start (warm_start.enabled) and reward model (from the cache when they were built
    before)."""
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
    warm = None
    if config.warm_start.enabled:  # the SFT policy fine-tuned on its own verified samples (rlhf/train/warm_start.py)
        inputs = warm_start_inputs(config)
        warm = run_stage(warm_start_policy, sft_model=sft_model, prepared=prepared, **inputs, **common)
        if progress:
            progress.done(stage_of(warm.stage).label)
    if config.reward.source == "function":  # a reward function scores: no reward model to train
        return Upstream(prepared, sft_model, None, warm)
    # member k of an ensemble trains with its own seed, from what `member_inits` says; member 0 is the single reward
    # model of the same config (but with reward.ensemble_models, whose first model it trains from)
    members = [
        run_stage(
            train_reward_model,
            reward_cfg=config.reward.member_config(),
            prepared=prepared,
            seed=member_seed(config.seed, k),
            **init,
            **common,
        )
        for k, init in enumerate(member_inits(config, sft_model, prepared, tracking))
    ]
    if progress:
        progress.done(stage_of(members[0].stage).label)
    if not config.reward.is_ensemble:
        return Upstream(prepared, sft_model, members[0], warm)
    ensemble = run_stage(
        combine_reward_ensemble, reward_cfg=config.reward, members=members, prepared=prepared, **common
    )
    if progress:
        progress.done(stage_of(ensemble.stage).label)
    return Upstream(prepared, sft_model, ensemble, warm)


def member_inits(
    config: PipelineConfig, sft_model: SFTModel, prepared: PreparedData, tracking: TrackingContext
) -> list[dict[str, Any]]:
    """What each reward-model member trains from, as `train_reward_model`'s `sft_model` and `base_model` (in its
    cache key): the pipeline's SFT checkpoint (reward.ensemble_trunks 'shared'); with 'own_sft', member k > 0 from a
    `supervised_finetune` stage of its own, run here with the member's seed; with reward.ensemble_models, member k
    from the k-th model listed (no SFT checkpoint in its key: changing one model retrains that member only)."""
    reward = config.reward
    if reward.ensemble_models:
        return [{"sft_model": None, "base_model": model} for model in reward.ensemble_models]
    if reward.ensemble_trunks == "shared":
        return [{"sft_model": sft_model}] * reward.ensemble_size
    own = [
        run_stage(
            supervised_finetune,
            sft_cfg=config.sft,
            prepared=prepared,
            seed=member_seed(config.seed, k),
            runtime=config.runtime,
            tracking=tracking,
        )
        for k in range(1, reward.ensemble_size)
    ]
    return [{"sft_model": trunk} for trunk in (sft_model, *own)]


MEMBER_SEED_STRIDE = 7919  # member k's seed is the run's seed plus k times this (seed s's members are not s + 1's)


def member_seed(seed: int, member: int) -> int:
    """The seed of reward-ensemble member `member` (member 0: the run's seed, as a single reward model has)."""
    return seed + MEMBER_SEED_STRIDE * member


def _run_stages(config: PipelineConfig, tracking: TrackingContext, trial: TrialRef | None = None) -> dict[str, Any]:
    """The stages in order; each result (paths and digests) feeds the next stage's cache key."""
    common = {"runtime": config.runtime, "tracking": tracking}
    stages = stages_of(config.algorithm, config.reward.source, config.reward.is_ensemble, config.warm_start.enabled)
    objective = policy_label(config)  # what trains the policy: 'PPO', 'GRPO', ..., 'DPO'
    progress = StageProgress([stage_label(stage.task, objective) for stage in stages])  # a progress artifact in Prefect
    upstream = run_upstream(config, tracking, progress)
    prepared, sft_model, reward_model, warm = upstream
    policy_start = upstream.policy_start  # the policy stage's policy and reference: warm-started, else SFT
    # the reward function, where one scores: its name and source file are in the cache keys of the stages using it
    rewarding = {"reward_cfg": config.reward, "reward_function_digest": reward_function_digest(config.reward)}
    ppo_init = None
    policy: PPOPolicy | DPOPolicy
    if config.algorithm == "ppo":
        critic = not config.ppo.critic_free
        ppo_init = run_stage(
            init_policy_models, sft_model=policy_start, reward_model=reward_model, critic=critic, **common
        )
        progress.done(stage_label(ppo_init.stage, objective))
        policy = run_stage(
            train_policy_ppo,
            ppo_cfg=config.ppo,
            ppo_init=ppo_init,
            prepared=prepared,
            seed=config.policy_stage_seed,
            processes=config.runtime.ppo_processes,
            trial=trial,
            **rewarding,
            **common,
        )
    else:
        policy = run_stage(
            train_policy_dpo,
            dpo_cfg=config.dpo,
            sft_model=policy_start,
            prepared=prepared,
            seed=config.policy_stage_seed,
            **common,
        )
    progress.done(stage_label(policy.stage, objective))
    evaluation = run_stage(
        evaluate_policies,
        eval_cfg=config.eval,
        ppo_cfg=config.ppo,
        policy=policy,
        sft_model=sft_model,  # the original SFT policy: a warm start's gain is part of the reported one
        reward_model=reward_model,
        prepared=prepared,
        benchmark_digest=benchmark.files_digest(config.eval.benchmarks),
        **rewarding,
        **common,
    )
    progress.done(stage_label(evaluation.stage, objective))
    outputs = (prepared, sft_model, warm, reward_model, ppo_init, policy, evaluation)
    outputs = tuple(o for o in outputs if o is not None)
    summary: dict[str, Any] = {
        **({REWARD_BEST_EVAL_ACCURACY: reward_model.metrics[REWARD_BEST_EVAL_ACCURACY]} if reward_model else {}),
        **evaluation.metrics,
        **{k: v for k, v in policy.metrics.items() if k in (ALARM_STEP_KEY, KEPT_STEP_KEY)},
        # each reward function's mean and std over the last update's responses (reward.functions)
        **{k: v for k, v in policy.metrics.items() if k.startswith(REWARD_FUNCTION_PREFIX)},
        OBJECTIVE_LABEL_TAG: objective,
        "data": prepared.path,
        "data_digest": prepared.digest,
        "sft_checkpoint": sft_model.path,
        **({"warm_start_checkpoint": warm.path} if warm else {}),
        # the warm start's samples: how many it kept (warm_start/kept_fraction ...), beside the evaluation's figures
        **({k: v for k, v in warm.metrics.items() if k.startswith("warm_start/")} if warm else {}),
        "reward_checkpoint": reward_model.path
        if reward_model
        else f"none (reward functions {', '.join(config.reward.function_specs)})",
        "policy_checkpoint": policy.path,
        "value_checkpoint": getattr(policy, "value_path", "") or "none (no value model)",
        "completions": f"{evaluation.path}/completions.parquet",
        "mlflow_run_id": tracking.parent_run_id,
        "mlflow_experiment_id": tracker_for(tracking).experiment_id,
        "tracking_uri": tracking.uri,
        TRACKING_URI_FROM: tracking_uri_origin(config.tracking.uri),  # $MLFLOW_TRACKING_URI, the default or the config
        # the run's budget, by which the summary tells a plumbing check from learning (flows/summary.py)
        **budget(config),
        **compute(config),  # the device type and the dtype the stages computed in, and why ('auto' resolved)
        # the measured peak memory of the training stages (logged beside the preflight estimate)
        **{
            f"memory/{name}_peak_mb": output.metrics[PEAK_MEMORY]
            for name, output in (
                ("sft", sft_model),
                ("warm_start", warm),
                ("reward", reward_model),
                (stage_of(policy.stage).short, policy),
            )
            if output is not None and PEAK_MEMORY in output.metrics
        },
        # the policy stage's wall time (the attempt that finished it; a cached stage keeps the time that computed it)
        **({TIME_POLICY_TRAIN: policy.metrics[TIME_TRAIN]} if TIME_TRAIN in policy.metrics else {}),
        # the MLflow run of every stage, also of cached ones (the run that computed the result)
        **{f"stage.{output.stage}.run_id": output.mlflow_run_id for output in outputs},
    }
    summary |= cache_tags(tracking, outputs)
    summary |= resume_links(tracking)  # the killed run whose stage this one continued
    alarm = getattr(policy, "alarm", "")  # the PPO stage's over-optimisation alarm, at a periodic evaluation
    if alarm:
        summary[OVEROPTIMISATION_TAG] = alarm
    said = name_the_policy(evaluation.warnings, objective)  # 'the GRPO policy wins ...'
    warnings = [f"{objective}'s periodic evaluation: {alarm}"] * bool(alarm) + said
    if warnings:  # a tag of the pipeline run, a line of the summary and the Prefect table
        summary[EVAL_WARNING_TAG] = "\n".join(warnings)
    if tracking.registered_model:
        summary["registered_policy"] = register_policy(tracking, summary)
    return summary


# `python -m flows.pipeline`: the command of flows/pipeline_command.py (which imports this flow), by name
if __name__ == "__main__":
    runpy.run_module("flows.pipeline_command", run_name="__main__", alter_sys=True)
