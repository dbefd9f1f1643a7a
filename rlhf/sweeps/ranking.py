"""Which reward compares runs: the task's gold reward when every run has one (the synthetic task), else the
reward-model score. Used by sweep rankings (`rlhf.sweeps.space`) and run comparisons (`rlhf.sweeps.compare`)."""

from __future__ import annotations

from collections.abc import Sequence

GOLD_METRIC = "eval/ppo_gold"  # mean gold reward of the PPO policy's evaluation responses
RM_METRIC = "eval/ppo_score"  # mean reward-model score of the same responses


def reward_metric(has_gold: Sequence[bool]) -> str:
    """`GOLD_METRIC` when there is at least one run and every run has a gold reward (`has_gold`, one flag per
    run), else `RM_METRIC`."""
    return GOLD_METRIC if len(has_gold) and all(has_gold) else RM_METRIC
