"""Sweeps: the pipeline once per point of a search space, `max_concurrency` variants at a time, then a ranking.

    python -m flows.sweep --config conf/default.yaml --space conf/sweeps/kl_coef.yaml [key.sub=value ...]
    make sweep SWEEP=conf/sweeps/kl_coef.yaml

(the command: flows/sweep_command.py)

The stages the variants share (data, SFT, reward model) are built once, before the fan-out, as children of the
sweep's MLflow run; the variants then find them in the cache (stages are cached on their content, and a stage being
built is locked, so concurrent variants never build the same one twice). Variants run as subflows of the sweep,
each pinned to a device slot (flows/variants.py), or, with ``deployment`` in the space, as flow runs of that
pipeline deployment picked up by the workers of its work pool. ``method: optuna`` asks an Optuna study for each
trial's point and tells it the outcome; its pruner stops hopeless trials from PPO's periodic evaluations.

The sweep has its own MLflow run ``sweep-<name>`` (flows/sweep_run.py): each variant's pipeline run is tagged
``sweep_run_id`` and nested under it, its final metrics are logged on the sweep run (step = variant index), and the
sweep run gets the ranking table (``sweep_ranking.json``), ``reward_vs_kl.png``, for Optuna the study's own figures,
and, when the variants evaluate periodically (``ppo.eval_every``), ``overoptimisation.png``: gold and proxy reward
against sqrt(KL to SFT), one point per evaluation of every variant (rlhf/sweeps/overoptimisation.py). The ranking is
also a Prefect table artifact. A variant that fails is ranked last with its error (its MLflow run, if it opened one,
is nested under the sweep run too); the other variants still run.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow, get_run_logger
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import (
    StageProgress,
    artifact_key,
    link_mlflow_comparison,
    link_mlflow_run,
    publish_ranking,
    publish_table,
)
from flows.pipeline import hand_out, run_upstream, upstream_signature
from flows.pipeline_run import tracking_context
from flows.summary import sweep_note
from flows.sweep_run import close_sweep_run, open_sweep_run, record_unfinished_variant, record_variant
from flows.terminal import quiet_stop_in_served_run, served_stop_cancels
from flows.variants import (
    Outcome,
    device_limits,
    device_slots,
    pinned,
    run_deployed_variant,
    run_variant,
)
from rlhf.config import PipelineConfig
from rlhf.metrics import EVAL_POLICY_GOLD, PERIODIC_GOLD, PERIODIC_SCORE
from rlhf.models.device import device_names
from rlhf.preflight import preflight
from rlhf.sweeps.optuna_search import OptunaSearch, default_storage, study_plots
from rlhf.sweeps.ranking import RANK_METRICS, RM_METRIC, ranking
from rlhf.sweeps.space import Planned, SweepSpace, VariantList, expand
from rlhf.sweeps.study import STUDY_LEGEND, STUDY_METRICS
from tasks.tracking import tracker_for


@flow(name="rlhf-sweep", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=64))
def rlhf_sweep(base: PipelineConfig, space: SweepSpace) -> dict[str, Any]:
    """Run the pipeline for every variant of a search space, `max_concurrency` at a time; shared upstream stages are
    built once first."""
    quiet_stop_in_served_run()  # served by make ui: Ctrl-C there prints one sentence, not a traceback
    with served_stop_cancels():  # ... and the flow run ends Cancelled, not Crashed
        return run_sweep(base, space)


def run_sweep(base: PipelineConfig, space: SweepSpace) -> dict[str, Any]:
    """`rlhf_sweep`'s body."""
    logger = get_run_logger()
    search = variant_search(base, space)  # every variant (grid, random) or choice (optuna) is validated here
    for config in search.configs:
        preflight(config)
    note = sweep_note(search.configs)  # a plumbing check says so in the log, the tables and the sweep's MLflow run
    if note:
        logger.warning(note)
    if isinstance(search, OptunaSearch) and search.killed:
        logger.warning("sweep %s: trials %s of a killed start are asked again", space.name, search.killed)
    resumed = search.sweep_run_id if isinstance(search, OptunaSearch) else None
    sweep_run_id = open_sweep_run(base, space, search.total, resumed)
    if isinstance(search, OptunaSearch):
        search.remember_sweep_run(sweep_run_id)
    build_shared_stages(base, space, search, sweep_run_id)
    concurrency = space.max_concurrency or len(device_names(base.runtime.device))
    free = [] if space.deployment else device_slots(base.runtime.device, concurrency, sweep_run_id[:8])
    with device_limits(list(free)):
        logger.info(
            "sweep %s: %d variants, %d at a time %s",
            space.name,
            search.total,
            concurrency,
            f"as flow runs of {space.deployment}" if space.deployment else f"on {', '.join(s.device for s in free)}",
        )
        progress = StageProgress([f"variant {i + 1}" for i in range(max(search.total, 1))], f"sweep {space.name}")
        rows, running = search.kept(), {}  # a resumed Optuna sweep's finished trials, with their final metrics
        for row in rows:
            if row["mlflow_run_id"]:
                metrics = tracker_for(base.tracking).get_run(row["mlflow_run_id"]).data.metrics
                row |= {k: metrics.get(k) for k in RANK_METRICS}
        while True:
            start_variants(space, search, concurrency, free, running, rows)
            if not running:
                break
            future = next(as_completed(list(running)))
            planned, config, slot = running.pop(future)
            if slot is not None:
                free.append(slot)
            rows.append(finish_variant(base, space, search, sweep_run_id, planned, config, future.result()))
            progress.done(config.run_name or "")

    table = ranking(rows, (["arm"] if space.arms else []) + list(space.axes))
    folder = Path(base.runtime.output_dir) / "sweeps" / f"{space.name}-{sweep_run_id[:8]}"
    figures = study_plots(search.study, folder) if isinstance(search, OptunaSearch) else []
    arm_of = {v.label: v.arm for v in expand(space)} if space.arms else None
    closed = close_sweep_run(
        base.tracking,
        sweep_run_id,
        space.name,
        table.to_dict("records"),
        str(folder),
        [str(f) for f in figures],
        arm_of,
        rows,
        note,
    )
    publish_sweep_results(base, space, sweep_run_id, table, note, closed["study"])
    if (table["status"] == "failed").all():
        raise RuntimeError(f"every variant of sweep '{space.name}' failed; see the variants' flow runs")
    return {
        "sweep_run_id": sweep_run_id,
        "ranking": table.to_dict("records"),
        "ranking_csv": str(folder / "ranking.csv"),
        "plot": closed["plot"],
        "tracking_uri": tracker_for(base.tracking).uri,
    }


def publish_sweep_results(
    base: PipelineConfig,
    space: SweepSpace,
    sweep_run_id: str,
    table: pd.DataFrame,
    note: str,
    study: list[dict[str, str]] | None = None,
) -> None:
    """On the sweep's flow run: the ranking as a Prefect table (`note` opening its description), a study's table
    (`study`, a sweep with arms), a link to the sweep's MLflow run and one to MLflow's comparison of its finished
    variants."""
    publish_ranking(table.to_dict("records"), f"sweep-{space.name}", space.name, note)
    if study is not None:
        publish_table(
            study,
            key=f"sweep-{space.name}-study",
            description=(f"{note} " if note else "")
            + f"Study '{space.name}', per arm over its finished runs: {STUDY_LEGEND} The numbers: study_table.csv "
            "on the sweep's MLflow run.",
        )
    link_mlflow_run(
        base.tracking,
        sweep_run_id,
        f"MLflow run of sweep {space.name}",
        key=artifact_key(f"sweep-{space.name}-mlflow-run"),
    )
    finished = [row["mlflow_run_id"] for row in table.to_dict("records") if row.get("mlflow_run_id")]
    if finished:
        link_mlflow_comparison(
            base.tracking,
            finished,
            f"Compare the {len(finished)} variants of sweep {space.name} in MLflow",
            key=artifact_key(f"sweep-{space.name}-mlflow-compare"),
        )


def start_variants(
    space: SweepSpace, search: VariantList | OptunaSearch, concurrency: int, free: list, running: dict, rows: list
) -> None:
    """Submit the next variants until `concurrency` run (`running`: future -> (planned, config, device slot)), each
    on a free device slot; a point the config rejects is a failed row, with nothing run."""
    while len(running) < concurrency and (planned := search.next()) is not None:
        if planned.config is None:  # a point the config rejects: a failed trial, nothing to run
            search.tell(planned, "failed", None, None)
            variant = planned.variant
            rows.append({"variant": variant.label, "arm": variant.arm, **variant.overrides, "status": "failed"})
            rows[-1]["error"] = planned.error
            continue
        slot = free.pop(0) if free else None
        config = pinned(planned.config, slot, concurrency) if slot else planned.config
        get_run_logger().info("sweep %s: starting %s: %s", space.name, config.run_name, planned.variant.label)
        if space.deployment:
            future = run_deployed_variant.submit(space.deployment, config, planned.trial)
        else:
            future = run_variant.submit(config, planned.trial)
        running[future] = (planned, config, slot)


def variant_search(base: PipelineConfig, space: SweepSpace) -> VariantList | OptunaSearch:
    """Grid and random sweeps: their variants, fixed in advance. Optuna: a study whose pruner reads PPO's periodic
    evaluations (the gold reward where the data has one, else the reward-model score)."""
    if space.method != "optuna":
        return VariantList(base, space)
    storage = space.optuna.storage or default_storage(base.tracking.uri, base.runtime.output_dir)
    gold = base.data.source == "synthetic"  # the built-in task is the one with a gold reward
    objective, metric = (EVAL_POLICY_GOLD, PERIODIC_GOLD) if gold else (RM_METRIC, PERIODIC_SCORE)
    return OptunaSearch(base, space, storage, objective, metric)


def build_shared_stages(base: PipelineConfig, space: SweepSpace, search, sweep_run_id: str) -> None:
    """Data, SFT and reward model once per distinct upstream config, before the fan-out (their MLflow runs are
    children of the sweep run); the variants then take them from the cache."""
    configs = search.configs if space.method != "optuna" else [base]
    seen: set[str] = set()
    for config in configs:
        signature = upstream_signature(config)
        if signature not in seen:
            seen.add(signature)
            run_upstream(hand_out(config), tracking_context(config, sweep_run_id, f"sweep-{space.name}"))


def finish_variant(
    base: PipelineConfig, space: SweepSpace, search, sweep_run_id: str, planned: Planned, config, outcome: Outcome
) -> dict[str, Any]:
    """Record a finished variant (MLflow, the study) and return its ranking row."""
    variant = planned.variant
    row: dict[str, Any] = {"variant": config.run_name, "label": variant.label, "arm": variant.arm}
    row |= {**variant.overrides, "status": outcome.status}
    if planned.trial is not None:
        row["trial"] = variant.index
    row["mlflow_run_id"] = outcome.mlflow_run_id
    value = None
    if outcome.status == "completed":
        record_variant(base.tracking, sweep_run_id, space.name, variant.index, variant.label, outcome.summary)
        row |= {k: outcome.summary.get(k) for k in (*RANK_METRICS, *STUDY_METRICS)}
        value = outcome.summary.get(getattr(search, "objective", EVAL_POLICY_GOLD))
    else:
        get_run_logger().warning(
            "sweep %s: variant %s %s: %s", space.name, config.run_name, outcome.status, outcome.error or ""
        )
        if outcome.mlflow_run_id:
            record_unfinished_variant(base.tracking, sweep_run_id, space.name, variant.label, outcome.mlflow_run_id)
        if outcome.error:
            row["error"] = outcome.error
    search.tell(planned, outcome.status, value, outcome.mlflow_run_id)
    return row


def format_ranking(result: dict[str, Any]) -> str:
    """The ranking as text, with where the outputs are."""
    frame = pd.DataFrame(result["ranking"]).drop(columns=["mlflow_run_id"])
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        text = frame.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-")
    study = Path(result["ranking_csv"]).with_name("study_table.md")
    if study.exists():  # a sweep with arms: the per-arm table (rlhf.sweeps.study)
        text += f"\n\n== Study: per arm, mean and 95% interval over its runs\n{study.read_text().strip()}"
        text += f"\nfrontier (gold against sqrt(KL), one colour per arm): {study.with_name('frontier.png')}"
    return "\n".join(
        [
            "",
            "== Sweep ranking (best first)",
            text,
            "",
            f"ranking table: {result['ranking_csv']}",
            f"reward vs KL:  {result['plot']}",
            f"MLflow sweep run {result['sweep_run_id']} in {result['tracking_uri']}",
            "compare the variants: python -m rlhf.sweeps.compare --sweep " + result["sweep_run_id"],
        ]
    )


# `python -m flows.sweep`: the command of flows/sweep_command.py (which imports this flow), by name
if __name__ == "__main__":
    runpy.run_module("flows.sweep_command", run_name="__main__", alter_sys=True)
