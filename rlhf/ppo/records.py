"""The rollout records of a PPO update: one row per sample (prompt, response, scores, KL, length, gold score),
written to ``rollouts/update_NNNNN.parquet`` (ppo.record_rollouts) and logged as the stage's artifact."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rlhf.ppo import distributed
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.models import PPOModels
from rlhf.ppo.run import PolicyRun
from rlhf.ppo.update import Rollout
from rlhf.rollout.generation import response_texts
from rlhf.tracking.metrics_writer import GoldFn


def record_rollouts(
    run: PolicyRun, update: int, models: PPOModels, rollout: Rollout, dist: DistContext
) -> dict[str, float]:
    """The update's rollout records to Parquet (ppo.record_rollouts) and, with a gold reward, its mean gold score."""
    if not run.cfg.record_rollouts and run.gold_fn is None:
        return {}
    records = rollout_records(models, update, run.prompts, rollout, run.gold_fn, run.prompt_rows)
    if run.cfg.record_rollouts:
        write_records(Path(run.out_dir), update, records, dist)
    return {"objective/gold_score": float(records["gold_score"].mean())} if run.gold_fn is not None else {}


def write_records(out_dir: Path, update: int, records: pd.DataFrame, dist: DistContext) -> None:
    """The rollout records of one update, gathered in rank order (the global batch's order) and written by rank 0."""
    if dist.world_size > 1:
        frames = distributed.all_gather_object(records)
        if not dist.is_main:
            return
        records = pd.concat(frames, ignore_index=True)
    (out_dir / "rollouts").mkdir(parents=True, exist_ok=True)
    records.to_parquet(out_dir / "rollouts" / f"update_{update + 1:05d}.parquet", index=False)


def rollout_records(
    models: PPOModels,
    update: int,
    prompts: list[str],
    rollout: Rollout,
    gold_fn: GoldFn | None,
    rows: list[str] | None = None,
) -> pd.DataFrame:
    """Per-sample records of one update (the Parquet artifact of the rollouts); the gold reward reads each row's
    columns by its key, of `rows`."""
    resp = rollout.scored.resp
    responses = response_texts(models.tokenizer, resp)  # special tokens inside a response visible
    frame = pd.DataFrame(
        {
            "update": update + 1,
            "prompt": [prompts[i] for i in rollout.indices],
            "response": responses,
            "score": rollout.scored.scores.cpu().numpy(),
            "shaped_score": rollout.shaped_scores.cpu().numpy(),
            "kl": rollout.kl.sum(1).cpu().numpy(),
            "non_score_reward": rollout.non_score_rewards.sum(1).cpu().numpy(),
            "response_len": resp.mask.sum(1).cpu().numpy(),
            "contains_stop": resp.contains_stop.cpu().numpy(),
        }
    )
    if gold_fn is not None:
        keys = [None if rows is None else rows[i] for i in rollout.indices]
        frame["gold_score"] = [gold_fn(*row) for row in zip(frame["prompt"], frame["response"], keys, strict=True)]
    return frame
