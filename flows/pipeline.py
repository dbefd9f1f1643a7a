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
from flows.crashed_runs import check_in
from flows.pipeline_run import cache_tags, close_pipeline_run, open_pipeline_run, register_policy
from flows.resumed_runs import resume_links
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
from rlhf.data.source_checks import source_fingerprint
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
from rlhf.stages import DPO, ENSEMBLE, EVALUATE, INIT, PPO, PREPARE, REWARD, SFT, WARM_START, stage_of, stages_of
from rlhf.sweeps.optuna_search import TrialRef
from rlhf.train.warm_start import WarmStartSampling
from tasks.caching import run_stage, runtime_key
from tasks.outputs import DPOPolicy, PPOPolicy, PreparedData, RewardModel, SFTModel
from tasks.policy_stages import OVEROPTIMISATION_TAG, evaluate_policies, train_policy_dpo, train_policy_ppo
from tasks.stage_runs import stopped_by_signal
from tasks.stages import (
    combine_reward_ensemble,
    init_policy_models,
    prepare_preferences,
    supervised_finetune,
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
    said = compute(config.runtime)  # runtime.dtype resolved ('auto': by this machine's CPU check, cached), and why
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


def hand_out(config: PipelineConfig) -> dict[str, Any]:
    """The one place the config is handed out: by stage task, for the stages this config runs in their order, what
    the stage takes of it: its own section, any other section its signature names, and the shared facts it needs
    (the runtime, its seed, the digests of the files it reads). These and its upstream outputs are its cache key, so
    a section's change recomputes only the stages handed it. The reward-model stage gets one entry per ensemble
    member: its seed and what it trains from (`base_model`, of reward.ensemble_models; `trunk`, the parameters of an
    SFT stage of its own with reward.ensemble_trunks 'own_sft'; neither: the pipeline's SFT model)."""
    runtime, seed, reward, warm = config.runtime, config.seed, config.reward, config.warm_start
    policy_seed, benchmarks = config.policy_stage_seed, benchmark.files_digest(config.eval.benchmarks)
    facts = {"runtime": runtime}
    sft = {"sft_cfg": config.sft, "seed": seed, **facts}
    rewarding = {"reward_cfg": reward, "reward_function_digest": reward_function_digest(reward), **facts}

    def trunk(k: int) -> dict[str, Any]:  # member k's seed is its own (`member_seed`), and so is its own SFT's
        if reward.ensemble_models:  # no SFT checkpoint in its key: changing one model retrains that member only
            return {"sft_model": None, "base_model": reward.ensemble_models[k]}
        own = reward.ensemble_trunks == "own_sft" and k > 0
        return {"trunk": {**sft, "seed": member_seed(seed, k)}} if own else {}

    handed = {
        PREPARE.task: {
            "data_cfg": config.data,
            "source_digest": source_fingerprint(config.data),
            "lengths": LengthLimits.from_config(config),  # the report's limits: a change re-prepares (same digest)
            **facts,
        },
        SFT.task: sft,
        REWARD.task: [
            {"reward_cfg": reward.member_config(), "seed": member_seed(seed, k), **trunk(k), **facts}
            for k in range(reward.ensemble_size)
        ],
        ENSEMBLE.task: {"reward_cfg": reward, **facts},
        INIT.task: {"critic": not config.ppo.critic_free, **facts},
        PPO.task: {"ppo_cfg": config.ppo, "seed": policy_seed, "processes": runtime.ppo_processes, **rewarding},
        DPO.task: {"dpo_cfg": config.dpo, "seed": policy_seed, **facts},
        EVALUATE.task: {"eval_cfg": config.eval, "ppo_cfg": config.ppo, "benchmark_digest": benchmarks, **rewarding},
    }
    if warm.enabled:  # the SFT stage's fine-tuning settings, its share of ppo's sampling, the verifier (the config
        # refuses warm_start.enabled without a function) and its digest
        handed[WARM_START.task] = {
            "warm_cfg": warm,
            "sft_cfg": config.sft,
            "sampling": WarmStartSampling.of(warm, config.ppo),
            "seed": seed,
            "reward_functions": reward.function_specs,
            "reward_weights": reward.function_weights,
            "reward_function_digest": function_digest(reward.function_specs, reward.function_weights),
            **facts,
        }
    stages = stages_of(config.algorithm, reward.source, reward.is_ensemble, warm.enabled)
    return {stage.task: handed[stage.task] for stage in stages}


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


def run_upstream(handed: dict[str, Any], tracking: TrackingContext, progress: StageProgress | None = None) -> Upstream:
    """Preferences, SFT, the warm start and reward model (from the cache when they were built before), each with what
    `hand_out` gave it (`handed`)."""

    def run(task, **inputs: Any) -> Any:
        return run_stage(task, **inputs, tracking=tracking)

    def done(output: Any) -> None:
        if progress:
            progress.done(stage_of(output.stage).label)

    prepared = run(prepare_preferences, **handed[PREPARE.task])
    done(prepared)
    sft_model = run(supervised_finetune, **handed[SFT.task], prepared=prepared)
    done(sft_model)
    warm = None
    if WARM_START.task in handed:  # the SFT policy fine-tuned on its own verified samples (rlhf/train/warm_start.py)
        warm = run(warm_start_policy, **handed[WARM_START.task], sft_model=sft_model, prepared=prepared)
        done(warm)
    if REWARD.task not in handed:  # a reward function scores: no reward model to train
        return Upstream(prepared, sft_model, None, warm)
    # member k of an ensemble trains with its own seed, from what `hand_out` says (own SFT stages first); member 0 is
    # the single reward model of the same config (but with reward.ensemble_models, whose first model it trains from)
    members = [dict(member) for member in handed[REWARD.task]]
    trunks = [
        run(supervised_finetune, **m.pop("trunk"), prepared=prepared) if "trunk" in m else sft_model for m in members
    ]
    members = [
        run(train_reward_model, **{"sft_model": t, **m}, prepared=prepared)
        for t, m in zip(trunks, members, strict=True)
    ]
    done(members[0])
    if ENSEMBLE.task not in handed:
        return Upstream(prepared, sft_model, members[0], warm)
    ensemble = run(combine_reward_ensemble, **handed[ENSEMBLE.task], members=members, prepared=prepared)
    done(ensemble)
    return Upstream(prepared, sft_model, ensemble, warm)


MEMBER_SEED_STRIDE = 7919  # member k's seed is the run's seed plus k times this (seed s's members are not s + 1's)


def member_seed(seed: int, member: int) -> int:
    """The seed of reward-ensemble member `member` (member 0: the run's seed, as a single reward model has)."""
    return seed + MEMBER_SEED_STRIDE * member


def _run_stages(config: PipelineConfig, tracking: TrackingContext, trial: TrialRef | None = None) -> dict[str, Any]:
    """The stages in order; each result (paths and digests) feeds the next stage's cache key."""
    handed = hand_out(config)  # what each stage takes of the config

    def run(task, **inputs: Any) -> Any:
        return run_stage(task, **handed[task.name], **inputs, tracking=tracking)

    objective = policy_label(config)  # what trains the policy: 'PPO', 'GRPO', ..., 'DPO'
    progress = StageProgress([stage_label(task, objective) for task in handed])  # a progress artifact in Prefect
    upstream = run_upstream(handed, tracking, progress)
    prepared, sft_model, reward_model, warm = upstream
    policy_start = upstream.policy_start  # the policy stage's policy and reference: warm-started, else SFT
    ppo_init = None
    policy: PPOPolicy | DPOPolicy
    if PPO.task in handed:
        ppo_init = run(init_policy_models, sft_model=policy_start, reward_model=reward_model)
        progress.done(stage_label(ppo_init.stage, objective))
        policy = run(train_policy_ppo, ppo_init=ppo_init, prepared=prepared, trial=trial)
    else:
        policy = run(train_policy_dpo, sft_model=policy_start, prepared=prepared)
    progress.done(stage_label(policy.stage, objective))
    # the original SFT policy is evaluated against: a warm start's gain is part of the reported one
    evaluation = run(
        evaluate_policies, policy=policy, sft_model=sft_model, reward_model=reward_model, prepared=prepared
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
        **compute(config.runtime),  # the device type and the dtype the stages computed in, and why ('auto' resolved)
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
