"""The pipeline's summary as the terminal shows it at the end of `make run` (`python -m flows.pipeline`)."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from typing import Any

from flows.pipeline_run import RESULTS_FROM_TAG
from rlhf.config import PipelineConfig, RuntimeConfig
from rlhf.config.estimators import OBJECTIVE_LABEL_TAG
from rlhf.config.sections import is_tracking_server
from rlhf.eval import benchmark
from rlhf.eval.length_control import EVAL_WARNING_TAG
from rlhf.eval.overoptimisation import ALARM_STEP_KEY, KEPT_STEP_KEY
from rlhf.metrics import (
    EVAL_GOLD_PREFIX,
    EVAL_HACKING_EMPTY,
    EVAL_HACKING_LENGTH,
    EVAL_KL,
    EVAL_N_LEN_MATCHED,
    EVAL_N_PROMPTS,
    EVAL_POLICY_GOLD,
    EVAL_POLICY_LENGTH,
    EVAL_SFT_GOLD,
    EVAL_TIE_RATE_GOLD,
    EVAL_WIN_RATE_GOLD,
    EVAL_WIN_RATE_GOLD_LC,
    EVAL_WIN_RATE_RM,
    EVAL_WIN_RATE_RM_LC,
    REWARD_BEST_EVAL_ACCURACY,
    REWARD_FUNCTION_PREFIX,
)
from rlhf.models.device import dtype_reason, resolve_device, run_dtype
from rlhf.stages import INIT, PPO, STAGES, stage_of
from rlhf.tracking.default_view import mlflow_experiment_url
from tasks.stage_runs import RESUMED_FROM_TAG

# A run below either budget checks the plumbing (every stage runs and hands the next one its outputs), not learning:
# too few PPO episodes to move the policy, or an SFT policy trained from scratch (sft.model: null) in too few steps to
# write a sentence. Its gold reward, win rates and completions then mean nothing (conf/smoke.yaml is one; the
# default config is far above both).
PLUMBING_PPO_EPISODES = 1024
PLUMBING_SFT_STEPS = 100
# The run's budget in the summary (ints: neither MLflow metrics nor tags; the run's params hold them already)
PPO_EPISODES, SFT_STEPS = "budget/ppo_episodes", "budget/sft_steps"
# Where the run's MLflow store came from: $MLFLOW_TRACKING_URI, the default or the config (a tag of the pipeline run)
TRACKING_URI_FROM = "rlhf.tracking_uri_from"
# What the run computed on (tags of the pipeline run, the summary's header): 'cpu bfloat16', and why that dtype
COMPUTE_TAG, COMPUTE_REASON_TAG = "rlhf.compute", "rlhf.compute_reason"


def policy_label(config: PipelineConfig) -> str:
    """'PPO', 'GRPO', 'GSPO', ..., or 'DPO': what trained the policy."""
    return "DPO" if config.algorithm == "dpo" else config.ppo.label


def stage_label(task: str, objective: str) -> str:
    """What the summary, the progress bar and the evaluation table call a stage: the online policy stage and its init
    by the objective that trains (`objective`, `policy_label`'s: 'GRPO', 'GRPO init'), the others by their label in
    rlhf/stages.py."""
    if task == PPO.task:
        return objective
    return f"{objective} init" if task == INIT.task else stage_of(task).label


def _row(label: str, value: str) -> str:
    return f"{label + ':':<39} {value}"


def _rate(summary: dict[str, Any], key: str) -> str:
    return f"{summary[key]:.1%}" if key in summary else "n/a"


def _equal_length(summary: dict[str, Any], score: str) -> str:
    """'52.0% (logistic fit); 50.0% of 40 length-matched pairs'."""
    matched = f"{_rate(summary, f'eval/win_rate_{score}_len_matched')} of {int(summary.get(EVAL_N_LEN_MATCHED, 0))}"
    return f"{_rate(summary, f'eval/win_rate_{score}_len_controlled')} (logistic fit); {matched} length-matched pairs"


def hacking_warnings(summary: dict[str, Any]) -> list[str]:
    """The evaluation's reward-hacking warnings, one per line; a generic one for a flag set without its text."""
    lines = [line for line in str(summary.get(EVAL_WARNING_TAG, "")).splitlines() if line.strip()]
    label = summary.get(OBJECTIVE_LABEL_TAG, "PPO")
    if not lines and summary.get(EVAL_HACKING_LENGTH):
        lines.append(f"{label}'s gain over SFT is mostly explained by response length (see docs/evaluation.md).")
    if not lines and summary.get(EVAL_HACKING_EMPTY):
        lines.append(f"{label} gives more empty answers than SFT and the reward model scores them highly.")
    return lines


def name_the_policy(warnings: list[str], label: str) -> list[str]:
    """The evaluation's warnings (rlhf/eval: 'the trained policy ...') with the objective that trained it named
    ('the GRPO policy ...')."""
    return [w.replace("the trained policy", f"the {label} policy") for w in warnings]


def budget(config: PipelineConfig) -> dict[str, int]:
    """The run's budget as its summary records it (`plumbing_check` reads it): PPO episodes and SFT steps where the
    policy is bootstrapped from scratch (a pretrained one learns from hundreds of episodes)."""
    scratch = config.sft.model is None
    return {
        **({PPO_EPISODES: config.ppo.total_episodes} if config.algorithm == "ppo" and scratch else {}),
        **({SFT_STEPS: config.sft.steps} if scratch else {}),
    }


def compute(runtime: RuntimeConfig) -> dict[str, str]:
    """The device type and the dtype the run's models compute in (`runtime.dtype` resolved: 'auto' by this machine's
    check on a CPU, rlhf/models/cpu_bf16.py) and why, as the summary's tags."""
    device = resolve_device(runtime.device)
    dtype = run_dtype(runtime, device)
    return {
        COMPUTE_TAG: f"{device.type} {str(dtype).removeprefix('torch.')}",
        COMPUTE_REASON_TAG: dtype_reason(runtime.dtype, device, width=runtime.model_width),
    }


def summary_notes(summary: dict[str, Any]) -> list[str]:
    """The summary's notes and warnings, one line each ('NOTE: ...', 'WARNING: ...'): what the terminal prints above
    and below the figures, and what a run started from the browser shows in its flow run's log, its evaluation
    table's description and its MLflow run's description."""
    note = plumbing_check(summary)
    return [f"NOTE: {note}"] * bool(note) + [f"WARNING: {w}" for w in hacking_warnings(summary)]


def sweep_note(configs: Iterable[PipelineConfig]) -> str:
    """'NOTE: ...' when the variants of a sweep are plumbing checks (the first such variant's reason), else ''."""
    for config in configs:
        if note := plumbing_check({**budget(config), OBJECTIVE_LABEL_TAG: policy_label(config)}):
            return f"NOTE: every variant whose budget is this small is {note}"
    return ""


def plumbing_check(summary: dict[str, Any]) -> str | None:
    """Why this run checks the plumbing rather than learning (its budget under `PLUMBING_PPO_EPISODES` episodes of
    the policy stage's objective, or under `PLUMBING_SFT_STEPS` SFT steps from scratch), else None."""
    small = []
    episodes, steps = summary.get(PPO_EPISODES), summary.get(SFT_STEPS)
    if episodes is not None and episodes < PLUMBING_PPO_EPISODES:
        small.append(f"{episodes} {summary.get(OBJECTIVE_LABEL_TAG, 'PPO')} episodes (under {PLUMBING_PPO_EPISODES})")
    if steps is not None and steps < PLUMBING_SFT_STEPS:
        small.append(f"{steps} SFT steps of a policy trained from scratch (under {PLUMBING_SFT_STEPS})")
    if not small:
        return None
    return (
        f"a plumbing check, not learning: {' and '.join(small)} are too few to learn the task. The figures below "
        "show that every stage ran, not how well: gold reward, win rates and completions are not meant to be good."
    )


def _origin_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the results came from: the stages from the cache, and the crashed run whose saved state a stage resumed."""
    rows = []
    ran = [stage for stage in STAGES if f"stage.{stage.task}.run_id" in summary]  # this pipeline's stages
    label = summary.get(OBJECTIVE_LABEL_TAG, "PPO")
    cached = [stage_label(s.task, label) for s in ran if summary.get(f"stage.{s.task}.cached") == "true"]
    if cached:
        origin = summary.get(f"{RESULTS_FROM_TAG}_name") or summary.get(RESULTS_FROM_TAG)
        said = f"{len(cached)} of {len(ran)}"
        said += f" (all: results of MLflow run {origin})" if origin else f" ({', '.join(cached)})"
        rows.append(("stages from the cache", said))
    if resumed := summary.get(f"{RESUMED_FROM_TAG}_name"):  # flows/resumed_runs.py
        rows.append(("resumed from", f"crashed flow run {resumed} (its saved state)"))
    return rows


ALARM_ROW = "over-optimisation alarm (no gold)"  # the alarm's line: what the terminal, the log and the table call it


def figure_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's figures as (what, value) pairs, in the order the terminal prints them: reward-model accuracy,
    win rates, gold reward, KL, lengths and the over-optimisation alarm's line."""
    rows = []
    label = summary.get(OBJECTIVE_LABEL_TAG, "PPO")
    if REWARD_BEST_EVAL_ACCURACY in summary:
        rows.append(("reward-model accuracy (held-out pairs)", f"{summary[REWARD_BEST_EVAL_ACCURACY]:.3f}"))
    if EVAL_WIN_RATE_GOLD in summary:
        rows.append(
            (
                f"{label} beats SFT on gold reward",
                f"{summary[EVAL_WIN_RATE_GOLD]:.1%} of {int(summary[EVAL_N_PROMPTS])} held-out prompts "
                f"(ties {summary[EVAL_TIE_RATE_GOLD]:.1%})",
            )
        )
        if EVAL_WIN_RATE_GOLD_LC in summary:
            rows.append(("  at equal length (gold, ties half)", _equal_length(summary, "gold")))
        gold = f"{summary[EVAL_POLICY_GOLD]:.3f} / {summary[EVAL_SFT_GOLD]:.3f}"
        if f"{EVAL_GOLD_PREFIX}gain" in summary:  # with the 95% intervals and the paired gain
            gold = (
                f"{summary[EVAL_POLICY_GOLD]:.3f} [{summary[f'{EVAL_GOLD_PREFIX}policy_lo']:.3f}, "
                f"{summary[f'{EVAL_GOLD_PREFIX}policy_hi']:.3f}] / {summary[EVAL_SFT_GOLD]:.3f} "
                f"[{summary[f'{EVAL_GOLD_PREFIX}sft_lo']:.3f}, {summary[f'{EVAL_GOLD_PREFIX}sft_hi']:.3f}]"
            )
        rows.append((f"mean gold reward {label} / SFT", gold))
        if f"{EVAL_GOLD_PREFIX}gain" in summary:
            gain = (summary[f"{EVAL_GOLD_PREFIX}{k}"] for k in ("gain", "gain_lo", "gain_hi"))
            rows.append(("  gain over SFT (paired 95% interval)", "{:+.3f} [{:+.3f}, {:+.3f}]".format(*gain)))
    score = "reward-model score" if REWARD_BEST_EVAL_ACCURACY in summary else "reward-function score"
    rows.append((f"{label} beats SFT on {score}", f"{summary[EVAL_WIN_RATE_RM]:.1%}"))
    if EVAL_WIN_RATE_RM_LC in summary:
        rows.append(("  at equal length (RM, ties half)", _equal_length(summary, "rm")))
    rows.append((f"mean KL({label} || SFT) per response", f"{summary[EVAL_KL]:.3f}"))
    functions = [k for k in summary if k.startswith(REWARD_FUNCTION_PREFIX) and k.endswith("/mean")]
    if functions:  # reward.functions: each one's mean over the last update's responses
        means = (f"{k.removeprefix(REWARD_FUNCTION_PREFIX).removesuffix('/mean')} {summary[k]:.3f}" for k in functions)
        rows.append(("reward functions, last update's mean", ", ".join(means)))
    if EVAL_POLICY_LENGTH in summary:
        for name in ("policy", "sft"):
            mean, p10, p50, p90 = (summary[f"eval/{name}_length_{s}"] for s in ("mean", "p10", "p50", "p90"))
            rows.append(
                (
                    f"{label if name == 'policy' else 'SFT'} response tokens",
                    f"mean {mean:.1f}, p10/p50/p90 {p10:g}/{p50:g}/{p90:g}; "
                    f"empty {summary[f'eval/{name}_empty_rate']:.1%}, "
                    f"stopped {summary[f'eval/{name}_stop_rate']:.1%}",
                )
            )
    if ALARM_STEP_KEY in summary:  # the gold-free over-optimisation alarm of the policy stage's periodic evaluations
        step, kept = int(summary[ALARM_STEP_KEY]), int(summary.get(KEPT_STEP_KEY, -1))
        said = "quiet at every periodic evaluation" if step < 0 else f"fired after update {step} (WARNING below)"
        said += f"; the final policy is update {kept}'s" if kept >= 0 else ""
        rows.append((ALARM_ROW, said))
    return rows


def _mlflow_rows(summary: dict[str, Any]) -> list[str]:
    """The MLflow store the run logged to and where it came from (MLFLOW_TRACKING_URI, the default or the config),
    and how to open the run."""
    uri, origin = summary["tracking_uri"], summary.get(TRACKING_URI_FROM, "tracking.uri")
    experiment = summary.get("mlflow_experiment_id")
    lines = ["", f"{'MLflow store':<40}{uri} ({origin})"]
    if is_tracking_server(uri):  # a tracking server is its own UI
        run = summary["mlflow_run_id"]
        lines.append(f"MLflow run {run}: {uri.rstrip('/')}/#/experiments/{experiment}/runs/{run}")
    else:
        lines += [
            f"MLflow run {summary['mlflow_run_id']}; open the UI with:",
            f"  make mlflow-ui     (or: .venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000)",
            *(
                [f"  then the experiment (the project's columns and charts): {mlflow_experiment_url(experiment)}"]
                if experiment
                else []
            ),
        ]
    return lines


def summary_block(summary: dict[str, Any]) -> str:
    """The summary's head: its title, notes, figures, warnings and where the results came from. What a terminal run
    prints first and what a flow run's log ends with (the browser user's view of the same run)."""
    lines = ["", "== RLHF pipeline summary"]
    if COMPUTE_TAG in summary:
        lines.append(_row("computed in", f"{summary[COMPUTE_TAG]} ({summary[COMPUTE_REASON_TAG]})"))
    notes = summary_notes(summary)
    for note in (n for n in notes if n.startswith("NOTE: ")):
        lines += [*textwrap.wrap(note, 116, subsequent_indent="      "), ""]
    lines += [_row(what, value) for what, value in figure_rows(summary)]
    lines += benchmark.summary_lines(summary, summary.get(OBJECTIVE_LABEL_TAG, "PPO"))  # IFEval's, IFBench's
    warnings = [n for n in notes if n.startswith("WARNING: ")]
    if warnings:
        lines += ["", *warnings, ""]
    lines += [_row(what, value) for what, value in _origin_rows(summary)]
    return "\n".join(lines)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [summary_block(summary)]
    for key in ("data", "sft_checkpoint", "reward_checkpoint", "policy_checkpoint", "value_checkpoint", "completions"):
        lines.append(f"{key.replace('_', ' '):<40}{summary[key]}")
        if key == "sft_checkpoint" and "warm_start_checkpoint" in summary:  # warm_start.enabled: the policy's start
            lines.append(f"{'warm start checkpoint':<40}{summary['warm_start_checkpoint']}")
    if "registered_policy" in summary:
        lines.append(f"{'registered policy':<40}{summary['registered_policy']}")
    lines += _mlflow_rows(summary)
    lines += [
        "Prefect UI (flow runs, task states, logs, artifacts; deployments to trigger runs from a form):",
        "  make ui            (both UIs and the deployments; or just: make prefect-ui)",
    ]
    return "\n".join(lines)
