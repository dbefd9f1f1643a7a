"""The RLHF pipeline flow: preferences -> SFT -> reward model -> init -> PPO -> evaluation.

Run it with ``make run`` or ``python -m flows.pipeline --config conf/default.yaml key.sub=value ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from prefect.states import Completed

from flows.artifacts import PIPELINE_STAGES, StageProgress, mlflow_experiment_url, publish_pipeline_results
from flows.terminal import exit_code_of
from rlhf.checkpoints import stage_lock
from rlhf.config import PipelineConfig, flatten, load_config
from rlhf.data.lengths import LengthLimits
from rlhf.data.prepare import source_fingerprint
from rlhf.errors import TrialPruned, UserInputError
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.preflight import preflight
from rlhf.sweeps.optuna_search import TrialRef
from rlhf.tracking.default_view import copy_ppo_curves
from tasks.caching import code_version, run_stage
from tasks.outputs import PreparedData, RewardModel, SFTModel, StageOutput
from tasks.stage_runs import log_data_inputs
from tasks.stages import (
    evaluate_policies,
    plan_ppo_models,
    prepare_preferences,
    supervised_finetune,
    train_policy_ppo,
    train_reward_model,
)
from tasks.tracking import TrackingContext, tracker_for


@task(name="open_pipeline_run")
def open_pipeline_run(config: PipelineConfig, trial: TrialRef | None = None) -> TrackingContext:
    """The parent MLflow run of this pipeline run, with the whole config as params (and the sweep trial it is)."""
    tracker = tracker_for(config.tracking)
    flow_run_id = flow_run.get_id()
    # runs of a pipeline process killed earlier (SIGKILL, power loss) would stay RUNNING for ever; a killed stage's
    # run is reopened by the stage when it resumes
    for killed in tracker.end_orphaned_runs():
        get_run_logger().warning("MLflow run %s of a process that is gone: marked KILLED", killed)
    run_name = config.run_name or f"pipeline-{flow_run.get_name() or 'local'}"
    run_id = tracker.start_run(
        run_name,
        tags={
            "prefect.flow_run_id": str(flow_run_id),
            "code_version": code_version(),
            **({"sweep.trial": str(trial.number), "sweep.study": trial.study} if trial else {}),
        },
    )
    tracker.log_params(run_id, flatten(config))
    return tracking_context(config, run_id, run_name)


def tracking_context(config: PipelineConfig, parent_run_id: str, run_name: str) -> TrackingContext:
    """What the stage tasks log under: their runs are children of `parent_run_id` (a pipeline or a sweep run)."""
    return TrackingContext(
        uri=tracker_for(config.tracking).uri,
        experiment=config.tracking.experiment,
        artifact_location=config.tracking.artifact_location,
        parent_run_id=parent_run_id,
        run_name=run_name,
        flow_run_id=flow_run.get_id(),
        log_checkpoints=config.tracking.log_checkpoints,
        registered_model=config.tracking.registered_model,
    )


@task(name="register_policy")
def register_policy(tracking: TrackingContext, summary: dict[str, Any]) -> str:
    """The PPO policy as a version of the registered model, tagged with the evaluation summary."""
    tracker = tracker_for(tracking)
    assert tracking.registered_model is not None
    metrics = {k: f"{v:.6g}" for k, v in summary.items() if isinstance(v, float) and k.startswith(("eval/", "reward/"))}
    version = tracker.register_model_version(
        tracking.registered_model,
        summary["stage.train_policy_ppo.run_id"],
        "ppo_checkpoint/policy",
        tags={
            **metrics,
            **{k: v for k, v in summary.items() if k == EVAL_WARNING_TAG},
            "pipeline_run_id": tracking.parent_run_id,
            "code_version": code_version(),
        },
        description=f"PPO policy of pipeline run {tracking.parent_run_id}",
    )
    return f"models:/{tracking.registered_model}/{version}"


@task(name="close_pipeline_run")
def close_pipeline_run(
    tracking: TrackingContext, summary: dict[str, Any], failed: bool = False, pruned: bool = False
) -> None:
    """Log the pipeline summary and the prepared data (as dataset inputs) on the parent run and end it (KILLED, with
    the tag ``sweep.pruned``, when its sweep's pruner stopped it)."""
    tracker = tracker_for(tracking)
    if "data" in summary:
        log_data_inputs(tracker, tracking.parent_run_id, summary["data"], summary["data_digest"])
    tracker.log_metrics(tracking.parent_run_id, {k: v for k, v in summary.items() if isinstance(v, float)}, 0)
    copy_ppo_curves(tracker, summary.get("stage.train_policy_ppo.run_id"), tracking.parent_run_id)  # for its charts
    tracker.set_tags(tracking.parent_run_id, {k: v for k, v in summary.items() if isinstance(v, str)})
    if pruned:
        tracker.set_tags(tracking.parent_run_id, {PRUNED_TAG: "true"})
    tracker.end_run(tracking.parent_run_id, failed=failed, killed=pruned)


PRUNED_TAG, PRUNED_STATE = "sweep.pruned", "Pruned"


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
        progress.done(prepared.stage)
    sft_model = run_stage(supervised_finetune, sft_cfg=config.sft, prepared=prepared, seed=config.seed, **common)
    if progress:
        progress.done(sft_model.stage)
    reward_model = run_stage(
        train_reward_model,
        reward_cfg=config.reward,
        sft_model=sft_model,
        prepared=prepared,
        seed=config.seed,
        **common,
    )
    if progress:
        progress.done(reward_model.stage)
    return Upstream(prepared, sft_model, reward_model)


def _run_stages(config: PipelineConfig, tracking: TrackingContext, trial: TrialRef | None = None) -> dict[str, Any]:
    """The stages in order; each result (paths and digests) feeds the next stage's cache key."""
    common = {"runtime": config.runtime, "tracking": tracking}
    progress = StageProgress(PIPELINE_STAGES)  # a progress artifact in the Prefect UI
    prepared, sft_model, reward_model = run_upstream(config, tracking, progress)
    ppo_init = run_stage(plan_ppo_models, sft_model=sft_model, reward_model=reward_model, **common)
    progress.done(ppo_init.stage)
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
    progress.done(policy.stage)
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
    progress.done(evaluation.stage)
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


CACHED_TAG, RESULTS_FROM_TAG = "rlhf.cached", "rlhf.results_from_run"


def cache_tags(tracking: TrackingContext, outputs: tuple[StageOutput, ...]) -> dict[str, str]:
    """Tags of the pipeline run saying which stages came from the cache: `stage.<stage>.cached` per stage, and
    `rlhf.cached` ("true": every stage, "partial", "false"); when every stage was cached, `rlhf.results_from_run`
    names the pipeline run that computed the evaluation (and `rlhf.results_from_run_name` its name)."""
    tags = {f"stage.{output.stage}.cached": str(output.cached).lower() for output in outputs}
    cached = [output.cached for output in outputs]
    tags[CACHED_TAG] = "true" if all(cached) else "partial" if any(cached) else "false"
    evaluation = outputs[-1]
    if all(cached) and evaluation.mlflow_run_id:
        tracker = tracker_for(tracking)
        origin = tracker.get_run(evaluation.mlflow_run_id).data.tags.get("mlflow.parentRunId")
        if origin:
            tags[RESULTS_FROM_TAG] = origin
            tags[f"{RESULTS_FROM_TAG}_name"] = tracker.get_run(origin).info.run_name or origin
    return tags


def _row(label: str, value: str) -> str:
    return f"{label + ':':<40}{value}"


def _rate(summary: dict[str, Any], key: str) -> str:
    return f"{summary[key]:.1%}" if key in summary else "n/a"


def _equal_length(summary: dict[str, Any], score: str) -> str:
    """'52.0% (logistic fit); 50.0% of 40 length-matched pairs'."""
    matched = f"{_rate(summary, f'eval/win_rate_{score}_len_matched')} of {int(summary.get('eval/n_len_matched', 0))}"
    return f"{_rate(summary, f'eval/win_rate_{score}_len_controlled')} (logistic fit); {matched} length-matched pairs"


def hacking_warnings(summary: dict[str, Any]) -> list[str]:
    """The evaluation's reward-hacking warnings, one per line; a generic one for a flag set without its text."""
    lines = [line for line in str(summary.get(EVAL_WARNING_TAG, "")).splitlines() if line.strip()]
    if not lines and summary.get("eval/hacking_flag_length"):
        lines.append("PPO's gain over SFT is mostly explained by response length (see docs/evaluation.md).")
    if not lines and summary.get("eval/hacking_flag_empty"):
        lines.append("PPO gives more empty answers than SFT and the reward model scores them highly.")
    return lines


def format_summary(summary: dict[str, Any]) -> str:
    lines = ["", "== RLHF pipeline summary"]
    lines.append(_row("reward-model accuracy (held-out pairs)", f"{summary['reward/eval_accuracy']:.3f}"))
    if "eval/win_rate_gold" in summary:
        lines.append(
            _row(
                "PPO beats SFT on gold reward",
                f"{summary['eval/win_rate_gold']:.1%} of {int(summary['eval/n_prompts'])} held-out prompts "
                f"(ties {summary['eval/tie_rate_gold']:.1%})",
            )
        )
        if "eval/win_rate_gold_len_controlled" in summary:
            lines.append(_row("  at equal length (gold, ties half)", _equal_length(summary, "gold")))
        lines.append(
            _row("mean gold reward PPO / SFT", f"{summary['eval/ppo_gold']:.3f} / {summary['eval/sft_gold']:.3f}")
        )
    lines.append(_row("PPO beats SFT on reward-model score", f"{summary['eval/win_rate_rm']:.1%}"))
    if "eval/win_rate_rm_len_controlled" in summary:
        lines.append(_row("  at equal length (RM, ties half)", _equal_length(summary, "rm")))
    lines.append(_row("mean KL(PPO || SFT) per response", f"{summary['eval/kl']:.3f}"))
    if "eval/ppo_length_mean" in summary:
        for name in ("ppo", "sft"):
            mean, p10, p50, p90 = (summary[f"eval/{name}_length_{s}"] for s in ("mean", "p10", "p50", "p90"))
            lines.append(
                _row(
                    f"{name.upper()} response tokens",
                    f"mean {mean:.1f}, p10/p50/p90 {p10:g}/{p50:g}/{p90:g}; "
                    f"empty {summary[f'eval/{name}_empty_rate']:.1%}, "
                    f"stopped {summary[f'eval/{name}_stop_rate']:.1%}",
                )
            )
    warnings = hacking_warnings(summary)
    if warnings:
        lines += ["", *(f"WARNING: {w}" for w in warnings), ""]
    cached = [stage for stage in PIPELINE_STAGES if summary.get(f"stage.{stage}.cached") == "true"]
    if cached:
        origin = summary.get(f"{RESULTS_FROM_TAG}_name") or summary.get(RESULTS_FROM_TAG)
        lines.append(
            _row("stages from the cache", f"{len(cached)} of {len(PIPELINE_STAGES)}")
            + (f" (all: results of MLflow run {origin})" if origin else f" ({', '.join(cached)})")
        )
    for key in ("data", "sft_checkpoint", "reward_checkpoint", "policy_checkpoint", "value_checkpoint", "completions"):
        lines.append(f"{key.replace('_', ' '):<40}{summary[key]}")
    if "registered_policy" in summary:
        lines.append(f"{'registered policy':<40}{summary['registered_policy']}")
    lines += [
        "",
        f"MLflow run {summary['mlflow_run_id']}; open the UI with:",
        "  make mlflow-ui     (or: .venv/bin/mlflow ui --backend-store-uri "
        f"{summary['tracking_uri']} --host 127.0.0.1 --port 5000)",
        *(
            [f"  then the experiment (the project's columns and charts): {mlflow_experiment_url(experiment)}"]
            if (experiment := summary.get("mlflow_experiment_id"))
            else []
        ),
        "Prefect UI (flow runs, task states, logs, artifacts; deployments to trigger runs from a form):",
        "  make ui            (both UIs and the deployments; or just: make prefect-ui)",
    ]
    return "\n".join(lines)


def prepare_prefect_database() -> None:
    """Without a Prefect server (PREFECT_API_URL unset) every pipeline process starts a temporary one, which migrates
    the database in PREFECT_HOME: two pipelines started together would run the same migrations at once (SQLite:
    'index ... already exists'). Run them here first, one process at a time; the servers then find them done."""
    import asyncio

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    if PREFECT_API_URL.value():
        return
    from prefect.server.database import provide_database_interface

    home = Path(PREFECT_HOME.value())
    home.mkdir(parents=True, exist_ok=True)
    with stage_lock(home / "database"):
        asyncio.run(provide_database_interface().create_db())


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
    code, summary = exit_code_of(lambda: rlhf_pipeline(config))
    if summary is not None:
        print(format_summary(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
