"""The length report of prepared data: for each stage's length limit, the share of prompts or pairs over it.

Lengths are measured in the validation pass (validate.py: prompt, chosen and rejected tokenized separately, without
special tokens, as the stages encode them; or counted in characters when there is no tokenizer) and summarised
here over what was written:

- ``ppo.max_prompt_tokens``: the PPO prompts (``prompts.parquet``) longer than it; PPO keeps their last tokens (a
  chat prompt its template's head and its last turns: ``rlhf.rollout.prompt_fit``);
- ``reward.max_length``: the pairs (``train.parquet`` and ``eval.parquet``) whose prompt + longer response + EOS
  is longer; the reward stage drops or truncates them (``reward.truncation``); not measured where no reward model
  trains (``reward.source: function``);
- ``sft.max_length`` (``sft.bootstrap.n_positions`` for the bootstrapped model): the demonstrations
  (``sft.parquet``) whose prompt + response + EOS is longer; fine-tuning cuts their prompts on the left.

With characters (no ``data.tokenizer``: the bootstrapped model trains its tokenizer in the SFT stage) the shares
are not measured (null); the reward, SFT and PPO stages measure their own truncation in tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from rlhf.stages import REWARD, stages_of

if TYPE_CHECKING:
    from rlhf.config import PipelineConfig

PERCENTILES = (50, 90, 99)


class LengthLimits(BaseModel):
    """The token limits of the later stages that prepared data is measured against (None: not applied)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_tokens: int | None = None  # ppo.max_prompt_tokens
    pair_tokens: int | None = None  # reward.max_length; None: no reward model trains (a reward function scores)
    sft_tokens: int | None = None  # sft.max_length (or the bootstrap model's positions); None: no SFT training
    sft_key: str = "sft.max_length"

    @classmethod
    def from_config(cls, config: PipelineConfig) -> LengthLimits:
        sft = config.sft
        if sft.model is None:
            sft_tokens, sft_key = sft.bootstrap.n_positions, "sft.bootstrap.n_positions"
        else:
            sft_tokens, sft_key = (sft.max_length if sft.finetune else None), "sft.max_length"
        trains_reward_model = REWARD in stages_of(config.algorithm, config.reward.source)
        return cls(
            prompt_tokens=config.ppo.max_prompt_tokens,
            pair_tokens=config.reward.max_length if trains_reward_model else None,
            sft_tokens=sft_tokens,
            sft_key=sft_key,
        )


def percentiles(values: np.ndarray) -> dict[str, float | None]:
    if not len(values):
        return {f"p{q}": None for q in PERCENTILES} | {"max": None}
    found = np.percentile(values, PERCENTILES)
    return {f"p{q}": round(float(v), 1) for q, v in zip(PERCENTILES, found, strict=True)} | {"max": int(values.max())}


def _over(
    name: str, what: str, limit: int | None, lengths: np.ndarray, tokens: bool, consequence: str
) -> dict[str, Any]:
    n_over = int((lengths > limit).sum()) if tokens and limit is not None else None
    return {
        "name": name,
        "limit": limit,
        "measured": what,
        "of": int(len(lengths)),
        "over": n_over,
        "fraction": round(n_over / len(lengths), 6) if n_over is not None and len(lengths) else None,
        "consequence": consequence,
        **percentiles(lengths),
    }


def length_report(
    prompt: np.ndarray,
    chosen: np.ndarray,
    rejected: np.ndarray,
    demos: np.ndarray,
    ppo_prompts: np.ndarray,
    limits: LengthLimits,
    unit: str,
    warn_fraction: float,
) -> tuple[dict[str, Any], list[str]]:
    """The manifest's ``lengths`` section and its warnings.

    `prompt`, `chosen`, `rejected`: lengths of the written pairs (train and eval); `demos`: prompt + response
    lengths of the SFT demonstrations; `ppo_prompts`: lengths of the PPO prompts; `unit`: 'tokens' or 'characters'
    (then no share is measured).
    """
    tokens = unit == "tokens"
    pair = prompt + np.maximum(chosen, rejected) + 1  # + EOS, as the reward stage encodes them
    demo = demos + 1
    over = {
        "ppo.max_prompt_tokens": _over(
            "PPO prompts",
            "PPO prompts (prompts.parquet)",
            limits.prompt_tokens,
            ppo_prompts,
            tokens,
            "PPO keeps their last tokens (a chat prompt: its template's head and its last turns)",
        ),
        "reward.max_length": _over(
            "preference pairs",
            "pairs: prompt + the longer response + EOS (train.parquet, eval.parquet)",
            limits.pair_tokens,
            pair,
            tokens,
            "the reward stage drops them, or truncates them (reward.truncation)",
        ),
    }
    if limits.sft_tokens is not None:
        over[limits.sft_key] = _over(
            "SFT demonstrations",
            "SFT demonstrations: prompt + response + EOS (sft.parquet)",
            limits.sft_tokens,
            demo,
            tokens,
            "SFT cuts their prompts on the left",
        )
    section: dict[str, Any] = {
        "unit": unit,
        "over_limit": over,
        "prompt": percentiles(prompt),
        "response": percentiles(np.concatenate([chosen, rejected])),
    }
    if not tokens:
        section["note"] = (
            "no data.tokenizer (the bootstrapped model trains its tokenizer in the SFT stage): lengths are in "
            "characters and the shares over the token limits are not measured here; the reward, SFT and PPO stages "
            "measure and log their own truncation in tokens"
        )
    warnings = [
        f"{item['fraction']:.0%} of the {item['name']} ({item['over']} of "
        f"{item['of']}) are longer than {key} ({item['limit']} tokens): {item['consequence']}"
        for key, item in over.items()
        if item["fraction"] is not None and item["fraction"] > warn_fraction
    ]
    return section, warnings


def length_table(manifest: dict) -> list[dict[str, Any]]:
    """One row per limit (share over it and percentiles of what it limits), then the prompts' and responses'
    length percentiles: the Prefect table artifact and MLflow table of the prepare stage."""
    section = manifest.get("lengths") or {}
    unit = section.get("unit", "")
    rows = [
        {"length": item["measured"], "limit": f"{key} = {item['limit']}", "unit": unit}
        | {k: item[k] for k in ("over", "of", "fraction", "p50", "p90", "p99", "max")}
        for key, item in section.get("over_limit", {}).items()
    ]
    for name in ("prompt", "response"):
        if name in section:
            rows.append(
                {"length": f"{name}s", "limit": "", "unit": unit, "over": None, "of": None, "fraction": None}
                | section[name]
            )
    return rows


def length_metrics(manifest: dict) -> dict[str, float]:
    """MLflow metrics of the length report: data/over_<limit>_fraction and the length percentiles."""
    section = manifest.get("lengths") or {}
    unit = section.get("unit", "tokens")
    metrics = {
        f"data/over_{key.replace('.', '_')}_fraction": item["fraction"]
        for key, item in section.get("over_limit", {}).items()
        if item["fraction"] is not None
    }
    for name in ("prompt", "response"):
        for stat, value in (section.get(name) or {}).items():
            if value is not None:
                metrics[f"data/{name}_{unit}_{stat}"] = float(value)
    return metrics
