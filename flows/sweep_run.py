"""A sweep's own MLflow run, as Prefect tasks of the sweep flow (flows/sweep.py): opened with the space and the base
config as params, each finished variant's pipeline run nested under it with its final metrics (step = the variant's
index), and closed with the ranking table, the reward-versus-KL plot, a study's table and frontier (a space with arms)
and the over-optimisation plot of the variants' periodic evaluations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from rlhf.config import PipelineConfig, TrackingConfig, flatten
from rlhf.metrics import EVAL_KL
from rlhf.sweeps.overoptimisation import report as overoptimisation_report
from rlhf.sweeps.plots import Point, reward_vs_kl
from rlhf.sweeps.ranking import rank_key, variant_label
from rlhf.sweeps.space import SweepSpace
from rlhf.sweeps.study import report as study_report
from rlhf.sweeps.study import study_cells
from rlhf.tracking.client import RUN_TYPE_TAG, source_tags
from tasks.caching import code_version
from tasks.tracking import tracker_for

# MLflow's source of the sweep run and of the stages it builds (flows/pipeline_run.py): the sweep flow's file
SWEEP_SOURCE = "flows/sweep.py"


@task(name="open_sweep_run", cache_policy=NO_CACHE)
def open_sweep_run(base: PipelineConfig, space: SweepSpace, n_variants: int, resume_run_id: str | None = None) -> str:
    """The sweep's MLflow run: the space and the base config as params (a resumed Optuna sweep reopens its run)."""
    tracker = tracker_for(base.tracking)
    if resume_run_id is not None:
        tracker.reopen_run(resume_run_id)
        return resume_run_id
    run_id = tracker.start_run(
        f"sweep-{space.name}",
        tags={
            **source_tags(SWEEP_SOURCE),
            RUN_TYPE_TAG: "sweep",
            "sweep.name": space.name,
            "prefect.flow_run_id": str(flow_run.get_id()),
            "code_version": code_version(),
        },
    )
    params = {
        "sweep.method": space.method,
        "sweep.n_variants": n_variants,
        "sweep.seed": space.seed,
        "sweep.max_concurrency": space.max_concurrency,
        "sweep.deployment": space.deployment,
    }
    if space.method == "optuna":
        params |= {f"sweep.optuna.{k}": v for k, v in space.optuna.model_dump(mode="json").items()}
    params |= {
        f"sweep.space.{k}": json.dumps(v if isinstance(v, list) else v.model_dump()) for k, v in space.axes.items()
    }
    tracker.log_params(run_id, {**params, **flatten(base)})
    return run_id


@task(name="record_variant", cache_policy=NO_CACHE)
def record_variant(
    tracking: TrackingConfig, sweep_run_id: str, sweep_name: str, index: int, label: str, summary: dict[str, Any]
) -> None:
    """Nest the variant's pipeline run under the sweep run and log its final metrics there (step = index)."""
    tracker = tracker_for(tracking)
    tracker.attach_to_sweep(summary["mlflow_run_id"], sweep_run_id, sweep_name, label)
    tracker.log_metrics(sweep_run_id, {k: v for k, v in summary.items() if isinstance(v, float)}, index)


@task(name="record_unfinished_variant", cache_policy=NO_CACHE)
def record_unfinished_variant(tracking: TrackingConfig, sweep_run_id: str, sweep_name: str, label: str, run_id: str):
    """Nest a failed or pruned variant's pipeline run under the sweep run."""
    tracker_for(tracking).attach_to_sweep(run_id, sweep_run_id, sweep_name, label)


@task(name="close_sweep_run", cache_policy=NO_CACHE)
def close_sweep_run(
    tracking: TrackingConfig,
    sweep_run_id: str,
    sweep_name: str,
    rows: list[dict[str, Any]],
    folder: str,
    figures: list[str] | None = None,
    arm_of: dict[str, str] | None = None,
    study_rows: list[dict[str, Any]] | None = None,
    note: str = "",
) -> dict[str, Any]:
    """Log the ranking table, the reward-versus-KL plot and any other `figures` on the sweep run, and end it. A
    study (a space with arms, `arm_of`: variant label -> arm; `study_rows`: every variant's row with the summary
    metrics of the study) also gets its table and frontier plot. `note` (a plumbing check's 'NOTE: ...') opens the
    study's table and becomes the sweep run's description. Returns the plot's path (`plot`) and the study's table
    as the Prefect table shows it (`study`, None without arms): the flow publishes both tables on its own run."""
    tracker = tracker_for(tracking)
    if note:
        tracker.set_description(sweep_run_id, note)
    study = (
        log_study(tracker, sweep_run_id, sweep_name, study_rows or [], arm_of, Path(folder), note) if arm_of else None
    )
    for figure in figures or []:
        tracker.log_artifacts(sweep_run_id, figure)
    frame = pd.DataFrame(rows)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "ranking.csv", index=False)
    tracker.log_table(sweep_run_id, frame, "sweep_ranking.json")
    key = rank_key(frame)
    done = frame[frame["status"] == "completed"]
    points = [Point(variant_label(row), row[EVAL_KL], row[key]) for _, row in done.iterrows()]
    baseline_key = key.replace("ppo", "sft")
    baseline = float(done[baseline_key].mean()) if baseline_key in done and len(done) else None
    plot = reward_vs_kl(
        points, out / "reward_vs_kl.png", key, baseline, title=f"Sweep {sweep_name}: reward against KL(PPO || SFT)"
    )
    tracker.log_artifacts(sweep_run_id, plot)
    tracker.log_artifacts(sweep_run_id, out / "ranking.csv")
    if len(done):
        best = done.iloc[0]
        tracker.set_tags(
            sweep_run_id, {"sweep.best_variant": best["variant"], "sweep.best_run_id": best["mlflow_run_id"]}
        )
    # the variants' periodic evaluations (ppo.eval_every), if any: gold and proxy against sqrt(KL to SFT)
    try:
        overoptimisation = overoptimisation_report(tracker, sweep_run_id, out)
    except ValueError as err:  # evaluations, but none finite: said, not hidden
        get_run_logger().warning("sweep %s: no over-optimisation plot: %s", sweep_name, err)
        overoptimisation = None
    if overoptimisation is not None:
        tracker.log_artifacts(sweep_run_id, overoptimisation.figure)
        tracker.log_artifacts(sweep_run_id, overoptimisation.points)
        tracker.log_metrics(sweep_run_id, overoptimisation.summary.as_metrics(), 0)
    tracker.end_run(sweep_run_id, failed=len(done) == 0)
    return {"plot": str(plot), "study": study}


def log_study(
    tracker, sweep_run_id: str, sweep_name: str, rows: list[dict[str, Any]], arm_of, folder: Path, note: str = ""
) -> list[dict[str, str]]:
    """The study table (MLflow table and files) and the frontier plot of a sweep's arms, logged on the sweep run;
    `note` opens the table's Markdown. Returns the table's rows as the Markdown shows them (`study_cells`)."""
    title = f"Study {sweep_name}: gold reward against KL"
    study = study_report(tracker, sweep_run_id, rows, arm_of, folder, title, note)
    for path in study.files:
        tracker.log_artifacts(sweep_run_id, path)
    tracker.log_table(sweep_run_id, study.table, "study_table.json")
    get_run_logger().info("study %s:\n%s", sweep_name, study.markdown)
    return study_cells(study.table)
