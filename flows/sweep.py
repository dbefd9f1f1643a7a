"""Sweeps: the pipeline once per point of a search space, as subflows, then a ranking of the variants.

    python -m flows.sweep --config conf/default.yaml --space conf/sweeps/kl_coef.yaml [key.sub=value ...]
    make sweep SWEEP=conf/sweeps/kl_coef.yaml

Stages are cached on their content, so variants that differ only in ``ppo.*`` reuse the data, SFT and reward-model
stages of the first one. The sweep has its own MLflow run ``sweep-<name>``: each variant's pipeline run is tagged
``sweep_run_id`` and nested under it, its final metrics are logged on the sweep run (step = variant index), and the
sweep run gets the ranking table (``sweep_ranking.json``) and ``reward_vs_kl.png``. The ranking is also a Prefect
table artifact. A variant that fails is ranked last with its error (its MLflow run, if it opened one, is nested
under the sweep run too); the other variants still run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.artifacts import StageProgress, artifact_key, link_mlflow_run, publish_table
from flows.pipeline import rlhf_pipeline
from flows.terminal import exit_code_of
from rlhf.config import PipelineConfig, TrackingConfig, flatten, load_config
from rlhf.errors import UserInputError, first_line
from rlhf.plots import Point, reward_vs_kl
from rlhf.preflight import preflight
from rlhf.sweep import RANK_METRICS, SweepSpace, load_space, rank_key, ranking, variant_configs
from rlhf.tracking import RUN_TYPE_TAG
from tasks.caching import code_version
from tasks.tracking import tracker_for


@task(name="open_sweep_run", cache_policy=NO_CACHE)
def open_sweep_run(base: PipelineConfig, space: SweepSpace, n_variants: int) -> str:
    """The sweep's MLflow run: the space and the base config as params."""
    tracker = tracker_for(base.tracking)
    run_id = tracker.start_run(
        f"sweep-{space.name}",
        tags={
            RUN_TYPE_TAG: "sweep",
            "sweep.name": space.name,
            "prefect.flow_run_id": str(flow_run.get_id()),
            "code_version": code_version(),
        },
    )
    params = {"sweep.method": space.method, "sweep.n_variants": n_variants, "sweep.seed": space.seed}
    params |= {
        f"sweep.space.{k}": json.dumps(v if isinstance(v, list) else v.model_dump())
        for k, v in space.parameters.items()
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


@task(name="record_failed_variant", cache_policy=NO_CACHE)
def record_failed_variant(
    tracking: TrackingConfig, sweep_run_id: str, sweep_name: str, label: str, flow_run_id: str
) -> str | None:
    """Nest a failed variant's pipeline run (if it opened one) under the sweep run; returns its id."""
    tracker = tracker_for(tracking)
    run_id = tracker.pipeline_run_of_flow_run(flow_run_id)
    if run_id is not None:
        tracker.attach_to_sweep(run_id, sweep_run_id, sweep_name, label)
    return run_id


@task(name="close_sweep_run", cache_policy=NO_CACHE)
def close_sweep_run(
    tracking: TrackingConfig, sweep_run_id: str, sweep_name: str, rows: list[dict[str, Any]], folder: str
) -> str:
    """Log the ranking table and the reward-versus-KL plot on the sweep run, and end it."""
    tracker = tracker_for(tracking)
    frame = pd.DataFrame(rows)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "ranking.csv", index=False)
    tracker.log_table(sweep_run_id, frame, "sweep_ranking.json")
    key = rank_key(frame)
    done = frame[frame["status"] == "completed"]
    points = [Point(row["variant"], row["eval/kl"], row[key]) for _, row in done.iterrows()]
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
    tracker.end_run(sweep_run_id, failed=len(done) == 0)
    return str(plot)


@flow(name="rlhf-sweep", log_prints=True)
def rlhf_sweep(base: PipelineConfig, space: SweepSpace) -> dict[str, Any]:
    """Run the pipeline for every variant of a search space (unchanged upstream stages come from the cache)."""
    logger = get_run_logger()
    variants = variant_configs(base, space)  # every variant is validated before anything runs
    for _, config in variants:
        preflight(config)
    sweep_run_id = open_sweep_run(base, space, len(variants))
    progress = StageProgress([config.run_name or "" for _, config in variants], f"sweep {space.name}")
    rows: list[dict[str, Any]] = []
    for variant, config in variants:
        logger.info("sweep %s: variant %d/%d: %s", space.name, variant.index + 1, len(variants), variant.label)
        state = rlhf_pipeline.with_options(flow_run_name=config.run_name)(config, return_state=True)
        row: dict[str, Any] = {"variant": config.run_name, **variant.overrides}
        if state.is_completed():
            summary = state.result()
            record_variant(base.tracking, sweep_run_id, space.name, variant.index, variant.label, summary)
            row |= {k: summary.get(k) for k in RANK_METRICS}
            row |= {"status": "completed", "mlflow_run_id": summary["mlflow_run_id"]}
        else:
            logger.warning("sweep %s: variant %s failed: %s", space.name, config.run_name, state.message)
            run_id = record_failed_variant(
                base.tracking, sweep_run_id, space.name, variant.label, str(state.state_details.flow_run_id)
            )
            row |= {"status": "failed", "mlflow_run_id": run_id, "error": first_line(state.message, "failed", 200)}
        rows.append(row)
        progress.done(config.run_name or "")

    table = ranking(rows, list(space.parameters))
    folder = Path(base.runtime.output_dir) / "sweeps" / f"{space.name}-{sweep_run_id[:8]}"
    plot = close_sweep_run(base.tracking, sweep_run_id, space.name, table.to_dict("records"), str(folder))
    publish_table(
        table.to_dict("records"),
        key=f"sweep-{space.name}",
        description=f"Sweep '{space.name}': variants ranked by {rank_key(table)} (best first); KL is the mean "
        "KL(PPO || SFT) per response on held-out prompts.",
    )
    link_mlflow_run(
        base.tracking,
        sweep_run_id,
        f"MLflow run of sweep {space.name}",
        key=artifact_key(f"sweep-{space.name}-mlflow-run"),
    )
    if (table["status"] != "completed").all():
        raise RuntimeError(f"every variant of sweep '{space.name}' failed; see the variants' flow runs")
    return {
        "sweep_run_id": sweep_run_id,
        "ranking": table.to_dict("records"),
        "ranking_csv": str(folder / "ranking.csv"),
        "plot": plot,
        "tracking_uri": tracker_for(base.tracking).uri,
    }


def format_ranking(result: dict[str, Any]) -> str:
    """The ranking as text, with where the outputs are."""
    frame = pd.DataFrame(result["ranking"]).drop(columns=["mlflow_run_id"])
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        text = frame.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-")
    return "\n".join(
        [
            "",
            "== Sweep ranking (best first)",
            text,
            "",
            f"ranking table: {result['ranking_csv']}",
            f"reward vs KL:  {result['plot']}",
            f"MLflow sweep run {result['sweep_run_id']} in {result['tracking_uri']}",
            "compare the variants: python -m rlhf.compare --sweep " + result["sweep_run_id"],
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="conf/default.yaml", help="base YAML config of every variant")
    parser.add_argument("--space", required=True, help="sweep space YAML, e.g. conf/sweeps/kl_coef.yaml")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the base config")
    args = parser.parse_args(argv)
    try:
        base = load_config(args.config, args.overrides)
        space = load_space(args.space)
        variants = variant_configs(base, space)  # before anything is loaded
        for _, config in variants:
            preflight(config)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"sweep {space.name}: {len(variants)} variants ({space.method})")
    for variant, _ in variants:
        print(f"  {variant.index:02d}  {variant.label}")
    code, result = exit_code_of(lambda: rlhf_sweep(base, space))
    if result is not None:
        print(format_ranking(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
