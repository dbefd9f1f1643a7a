"""Prefect artifacts of the flows: stage progress, links to the MLflow runs, and result tables.

They show on the flow run's Artifacts tab in the Prefect UI (and, for keyed ones, on the Artifacts page across
runs). An artifact that cannot be written is a warning in the run's log, never a failed training run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd
from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.settings import get_current_settings

from flows.summary import figure_rows, stage_label, summary_notes
from rlhf.config import TrackingConfig
from rlhf.config.estimators import OBJECTIVE_LABEL_TAG
from rlhf.eval import benchmark
from rlhf.metrics import EVAL_KL, EVAL_POLICY_GOLD, EVAL_POLICY_SCORE, EVAL_WIN_RATE_GOLD, EVAL_WIN_RATE_RM
from rlhf.stages import STAGES
from rlhf.sweeps.ranking import rank_key, variant_label
from rlhf.tracking.default_view import COLUMN_METRICS, mlflow_compare_url, mlflow_experiment_url, mlflow_run_url
from tasks.progress import ProgressBar
from tasks.tracking import TrackingContext, tracker_for


def artifact_key(text: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    key = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in key.split("-") if part)


def _warn(what: str, err: Exception) -> None:
    get_run_logger().warning("could not write the %s artifact: %s", what, err)


def _number(value: Any) -> Any:
    """Tables hold plain JSON values: rounded floats, None for NaN."""
    if isinstance(value, float):
        return None if not math.isfinite(value) else round(value, 4)
    return value


class StageProgress:
    """A progress artifact of the flow run, advanced after each completed stage."""

    def __init__(self, stages: Sequence[str], description: str = "RLHF pipeline") -> None:
        self.stages = list(stages)
        self.description = description
        self.done_count = 0
        self.bar = ProgressBar(f"{description}: starting {self.stages[0]}")

    def done(self, stage: str) -> None:
        """Mark `stage` finished: progress becomes (stages done) / (all stages) in percent."""
        self.done_count += 1
        following = self.stages[self.done_count] if self.done_count < len(self.stages) else None
        text = f"{self.description}: {stage} done ({self.done_count}/{len(self.stages)})"
        text += f", next {following}" if following else ", finished"
        self.bar.set(100.0 * self.done_count / len(self.stages), text)


COMPARED_RUNS = 5  # the evaluation table's compare link: this run and the experiment's 4 previous pipeline runs


def link_mlflow_comparison(tracking: TrackingConfig | TrackingContext, run_ids: list[str], text: str, key: str) -> None:
    """A link artifact to MLflow's comparison of `run_ids` in its model-training view (`mlflow_compare_url`)."""
    try:
        tracker = tracker_for(tracking)
        create_link_artifact(
            mlflow_compare_url(tracker.experiment_id, run_ids),
            link_text=text,
            key=key,
            description=f"MLflow's comparison of {len(run_ids)} runs of experiment '{tracking.experiment}' in its "
            "model-training view (MLflow's own Compare button opens the GenAI view in a browser that has not chosen "
            "Model training in MLflow's side bar: docs/orchestration.md). The link needs the MLflow UI running: make "
            "ui starts it with the Prefect UI, make mlflow-ui alone.",
        )
    except Exception as err:
        _warn("MLflow comparison link", err)


def link_mlflow_run(tracking: TrackingConfig | TrackingContext, run_id: str, text: str, key: str | None = None) -> None:
    """A link artifact to an MLflow run in the MLflow UI (base URL from ``$MLFLOW_UI_URL``)."""
    try:
        tracker = tracker_for(tracking)
        create_link_artifact(
            mlflow_run_url(tracker.experiment_id, run_id),
            link_text=text,
            key=key,
            # no code spans (the artifact card's preview drops them), and the experiment's URL, whose '&' the UI
            # shows as a literal '&amp;' in text, behind a Markdown link
            description=f"MLflow run {run_id} of experiment '{tracking.experiment}' "
            f"([the experiment's page]({mlflow_experiment_url(tracker.experiment_id)})), tracking store {tracker.uri}. "
            "The link needs the MLflow UI running: make ui starts it with the Prefect UI, make mlflow-ui alone.",
        )
    except Exception as err:
        _warn("MLflow link", err)


def stage_rows(summary: dict[str, Any], experiment_id: str) -> list[tuple[str, str, str]]:
    """One row per stage: its label, whether it ran (continuing the stage of a crashed flow run, when it did) or came
    from the cache, and the URL of its MLflow run (for a cached stage, the run that computed the result)."""
    rows, label = [], summary.get(OBJECTIVE_LABEL_TAG, "PPO")
    for stage in STAGES:
        run_id = summary.get(f"stage.{stage.task}.run_id")
        if run_id is None:
            continue
        cached = summary.get(f"stage.{stage.task}.cached") == "true"
        resumed = summary.get(f"stage.{stage.task}.resumed_from")  # flows/resumed_runs.py
        how = "cached (an earlier run computed it)" if cached else "ran"
        how += f", resuming crashed flow run {resumed}" if resumed and not cached else ""
        rows.append((stage_label(stage.task, label), how, mlflow_run_url(experiment_id, run_id)))
    return rows


def _cell(text: str) -> str:
    """A Markdown table cell: its pipes escaped ('KL(GRPO || SFT)'), on one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def evaluation_markdown(
    summary: dict[str, Any], stages: list[tuple[str, str, str]], links: list[tuple[str, str]]
) -> str:
    """The evaluation as a person reads it: the notes, the summary's figures in words (the terminal's lines, the
    over-optimisation alarm's among them), the warnings, each stage (ran or cached) with its MLflow run, and `links`
    ((text, URL): the comparison in MLflow, every figure)."""
    notes = summary_notes(summary)
    parts = [f"**{n.split(': ', 1)[0]}:** {n.split(': ', 1)[1]}" for n in notes if n.startswith("NOTE: ")]
    rows = figure_rows(summary)
    table = ["| what | value |", "|---|---|", *(f"| {_cell(what)} | {_cell(value)} |" for what, value in rows)]
    parts.append("\n".join(table))
    label = summary.get(OBJECTIVE_LABEL_TAG, "trained")
    parts += [benchmark.markdown_table(summary, name, label) for name in benchmark.names(summary)]
    parts += [f"**WARNING:** {n.split(': ', 1)[1]}" for n in notes if n.startswith("WARNING: ")]
    if stages:
        lines = ["| stage | result | MLflow |", "|---|---|---|"]
        lines += [f"| {_cell(label)} | {_cell(how)} | [its run]({url}) |" for label, how, url in stages]
        parts.append("\n".join(lines))
    if links:
        parts.append(" · ".join(f"[{text}]({url})" for text, url in links))
    return "\n\n".join(parts)


def figures_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Every figure of the summary (the key figures first, as the MLflow view's columns), and where the outputs are:
    the full table behind the evaluation's short one."""
    figures = {k: v for k, v in summary.items() if isinstance(v, float)}
    first = [k for k in COLUMN_METRICS if k in figures]
    rows = [{"metric": k, "value": _number(figures[k])} for k in first + [k for k in figures if k not in first]]
    rows += [{"metric": k, "value": v} for k, v in summary.items() if k.endswith(("_checkpoint", "completions"))]
    return rows


def artifact_url(artifact_id: Any) -> str | None:
    """The artifact's page in the Prefect UI, where the UI's address is known (a server's API URL is set)."""
    ui = get_current_settings().ui_url
    return f"{ui.rstrip('/')}/artifacts/artifact/{artifact_id}" if ui and artifact_id else None


def publish_pipeline_results(summary: dict[str, Any], tracking: TrackingConfig | TrackingContext) -> None:
    """The link to the pipeline's MLflow run; the evaluation as a short Markdown table in words (`rlhf-evaluation`:
    the summary's lines, the alarm's among them, the stages and their MLflow runs, a link to MLflow's comparison with
    the previous runs) and every figure in a table of its own (`rlhf-evaluation-figures`); the summary's notes and
    warnings (`summary_notes`) open their descriptions."""
    notes = summary_notes(summary)
    label = summary.get(OBJECTIVE_LABEL_TAG, "PPO")
    link_mlflow_run(
        tracking,
        summary["mlflow_run_id"],
        "MLflow run of this pipeline (stages are its child runs)",
        key="rlhf-mlflow-run",
    )
    about = (
        f"Evaluation of the {label} policy against the SFT policy on held-out prompts (gold reward where the task "
        "has one, reward-model score, win rates at equal length, response lengths and empty answers, KL)"
    )
    figures = figures_rows(summary)
    figures_id = None
    try:
        figures_id = create_table_artifact(
            figures,
            key="rlhf-evaluation-figures",
            description=" ".join([*notes, f"{about}: every figure by its MLflow key, and where the outputs are."]),
        )
    except Exception as err:
        _warn("evaluation figures", err)
    stages, links = [], []
    try:
        tracker = tracker_for(tracking)
        stages = stage_rows(summary, tracker.experiment_id)
        # this run beside the experiment's previous pipeline runs, in MLflow's model-training view
        recent = [summary["mlflow_run_id"]] + [
            r.run_id for r in tracker.pipeline_runs(COMPARED_RUNS) if r.run_id != summary["mlflow_run_id"]
        ]
        recent = recent[:COMPARED_RUNS]
        if len(recent) > 1:
            text = f"this run beside the last {len(recent) - 1} in MLflow"
            links.append((text, mlflow_compare_url(tracker.experiment_id, recent)))
        links.append(("the MLflow run", mlflow_run_url(tracker.experiment_id, summary["mlflow_run_id"])))
    except Exception as err:  # noqa: BLE001
        _warn("evaluation table's stage links", err)
    if url := artifact_url(figures_id):
        links.append((f"all {len(figures)} figures", url))
    description = " ".join([*notes, f"{about}; each stage (ran, or cached: from an earlier run) with its MLflow run."])
    try:
        markdown = evaluation_markdown(summary, stages, links)
        create_markdown_artifact(markdown, key="rlhf-evaluation", description=description)
    except Exception as err:
        _warn("evaluation table", err)


def publish_table(rows: list[dict[str, Any]], key: str, description: str) -> Any:
    """A table artifact (e.g. a sweep's ranking), floats rounded for reading. Returns its id (None: not written)."""
    try:
        return create_table_artifact(
            [{k: _number(v) for k, v in row.items()} for row in rows], key=artifact_key(key), description=description
        )
    except Exception as err:
        _warn("table", err)
        return None


# A sweep's short ranking: each metric column in words (the full table keeps every metric by its MLflow key)
RANKING_WORDS = {
    EVAL_POLICY_GOLD: "gold reward",
    EVAL_POLICY_SCORE: "reward-model score",
    EVAL_WIN_RATE_GOLD: "beats SFT (gold)",
    EVAL_WIN_RATE_RM: "beats SFT (reward model)",
    EVAL_KL: "KL to SFT",
}


def short_ranking(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranking as a person reads it, narrow enough for a 1440-pixel screen: rank, the variant in words (its arm
    and swept values: 'GRPO, policy_seed=0'), the reward it is ranked by, its win rate over SFT on that reward, the KL
    it cost, its status (and error)."""
    if not rows:
        return []
    key = rank_key(pd.DataFrame(rows))
    win = EVAL_WIN_RATE_GOLD if key == EVAL_POLICY_GOLD else EVAL_WIN_RATE_RM
    short = []
    for row in rows:
        entry = {"rank": row.get("rank"), "variant": variant_label(row)}
        entry |= {f"{RANKING_WORDS[k]}{' (ranked by)' * (k == key)}": _number(row.get(k)) for k in (key, win, EVAL_KL)}
        entry["status"] = row.get("status")
        if isinstance(row.get("error"), str) and row["error"]:  # NaN where another variant failed
            entry["error"] = " ".join(str(row["error"]).split())[:120]
        short.append(entry)
    return short


def publish_ranking(rows: list[dict[str, Any]], key: str, sweep: str, note: str) -> None:
    """A sweep's ranking on its flow run: the short table (`short_ranking`) under `key`, `note` opening its
    description, which links to the full one (every metric by its MLflow key, the run ids: `key`-full)."""
    about = f"Sweep '{sweep}': variants ranked by {rank_key(pd.DataFrame(rows))} (best first)"
    full_id = publish_table(rows, f"{key}-full", f"{about}: every metric by its MLflow key, and the run ids.")
    full = f"[every metric of each variant]({url})" if (url := artifact_url(full_id)) else f"artifact {key}-full"
    publish_table(
        short_ranking(rows),
        key,
        (f"{note} " if note else "")
        + f"{about}; KL to SFT: the trained policy's mean KL from the SFT policy per response on held-out prompts. "
        f"The full table: {full}.",
    )
