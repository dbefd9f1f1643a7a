"""Which reward compares runs (the task's gold reward when every run has one, the synthetic task's; else the
reward-model score), and a sweep's ranking table built on it. Used by sweeps (flows/sweep.py) and run comparisons
(`rlhf.sweeps.compare`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlhf.metrics import (
    EVAL_HACKING_EMPTY,
    EVAL_HACKING_LENGTH,
    EVAL_KL,
    EVAL_POLICY_EMPTY,
    EVAL_POLICY_GOLD,
    EVAL_POLICY_LENGTH,
    EVAL_POLICY_SCORE,
    EVAL_SFT_GOLD,
    EVAL_SFT_SCORE,
    EVAL_WIN_RATE_GOLD,
    EVAL_WIN_RATE_RM,
    EVAL_WIN_RATE_RM_LC,
    REWARD_BEST_EVAL_ACCURACY,
)

RM_METRIC = EVAL_POLICY_SCORE  # mean reward-model score of the same responses


def reward_metric(has_gold: Sequence[bool]) -> str:
    """`EVAL_POLICY_GOLD` when there is at least one run and every run has a gold reward (`has_gold`, one flag per
    run), else `RM_METRIC`."""
    return EVAL_POLICY_GOLD if len(has_gold) and all(has_gold) else RM_METRIC


# Metric columns of the ranking table: the PPO policy's rewards and KL, then the SFT baseline's rewards, then the
# reward-hacking checks (rlhf.eval.length_control).
RANK_METRICS = (
    EVAL_POLICY_GOLD,
    EVAL_WIN_RATE_GOLD,
    EVAL_POLICY_SCORE,
    EVAL_WIN_RATE_RM,
    EVAL_KL,
    REWARD_BEST_EVAL_ACCURACY,
    EVAL_SFT_GOLD,
    EVAL_SFT_SCORE,
    EVAL_WIN_RATE_RM_LC,
    EVAL_POLICY_LENGTH,
    EVAL_POLICY_EMPTY,
    EVAL_HACKING_LENGTH,
    EVAL_HACKING_EMPTY,
)


def rank_key(frame: pd.DataFrame) -> str:
    """The metric variants are ranked by: mean gold reward when every finished variant has it, else RM score."""
    finished = frame[frame["status"] == "completed"] if "status" in frame else frame
    return reward_metric(finished[EVAL_POLICY_GOLD].notna().tolist() if EVAL_POLICY_GOLD in finished else [])


def ranking(rows: list[dict[str, Any]], swept_keys: list[str]) -> pd.DataFrame:
    """A table of the variants, best first (failed variants last): swept values, the reward ranked by and KL, the
    other metrics, run ids."""
    frame = pd.DataFrame(rows)
    for col in (*RANK_METRICS, "status", "variant", "mlflow_run_id"):
        if col not in frame:
            frame[col] = None
    key = rank_key(frame)
    frame["_failed"] = frame["status"] != "completed"
    frame = frame.sort_values(["_failed", key], ascending=[True, False], na_position="last", kind="stable")
    frame.insert(0, "rank", range(1, len(frame) + 1))
    # the metric ranked by and the KL it cost first: a wide table (the Prefect UI's) shows them without scrolling
    first = [key, "eval/kl"]
    metrics = first + [m for m in RANK_METRICS if m not in first]
    columns = ["rank", "variant", *swept_keys, *metrics, "status", "mlflow_run_id"]
    if "error" in frame and frame["error"].notna().any():
        columns.append("error")
    return frame[columns].reset_index(drop=True)


def variant_label(row: Mapping[str, Any]) -> str:
    """A ranking row's short name on a plot: its arm and swept values ('GRPO, policy_seed=1', 'kl_coef=0.1'), read
    from the columns between 'variant' and the metrics; the variant's run name where nothing was swept."""
    keys = list(row.keys())
    end = next((i for i, k in enumerate(keys) if k in RANK_METRICS), len(keys))
    swept = keys[keys.index("variant") + 1 : end] if "variant" in keys else []
    parts = [str(row[k]) if k == "arm" else f"{k.rsplit('.', 1)[-1]}={row[k]}" for k in swept if row.get(k) is not None]
    return ", ".join(parts) or str(row.get("variant", ""))
