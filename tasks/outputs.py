"""What each stage hands the next one: where its files are and their content digest (never models), typed per stage.

They are the stages' Prefect results, persisted as JSON: Prefect's JSON serializer records each model's class, so a
cached result is read back as the same subclass.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class StageOutput(BaseModel):
    """The fields every stage output has; the cache key of a downstream stage takes its `digest`."""

    stage: str
    path: str
    digest: str
    mlflow_run_id: str | None = None
    metrics: dict[str, float] = {}
    # set by run_stage when Prefect served this result from its cache (computed by an earlier run); never persisted
    # as true
    cached: bool = False


class PreparedData(StageOutput):
    """`prepare_preferences`: the folder of train/eval/sft/prompts Parquet files, and their manifest."""

    manifest: dict[str, Any]


class SFTModel(StageOutput):
    """`supervised_finetune`: the SFT checkpoint; `trained` is false when a configured checkpoint is used as it is."""

    trained: bool


class RewardModel(StageOutput):
    """`train_reward_model`: the reward-model checkpoint (best held-out accuracy); `combine_reward_ensemble`: the
    ensemble's folder, with its `members`' checkpoints (empty for one reward model)."""

    members: list[str] = []


class PolicyInit(StageOutput):
    """`init_policy_models`: the checkpoints the four PPO models start from, and whether the policy and the reward
    model share a tokenizer (if not, the reward model re-tokenizes the responses)."""

    policy_init: str
    reference_init: str
    value_init: str
    reward_model: str
    same_tokenizer: bool


class PPOPolicy(StageOutput):
    """`train_policy_ppo`: the trained policy (`path`) and value model ('' with a critic-free estimator), and the
    number of PPO updates."""

    value_path: str
    updates: int
    alarm: str = ""  # the over-optimisation alarm's sentence where it fired at a periodic evaluation


class DPOPolicy(StageOutput):
    """`train_policy_dpo`: the policy trained with DPO on the preference pairs (`path`), and its optimizer steps."""

    steps: int


class Evaluation(StageOutput):
    """`evaluate_policies`: the folder with completions.parquet, the summary (`metrics`) and reward-hacking warnings."""

    warnings: list[str] = []
