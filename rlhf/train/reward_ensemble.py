"""A reward-model ensemble from its trained members: each member's offset and the members' disagreement on the
held-out pairs, each member's and the ensemble's held-out accuracy (docs/overoptimisation.md)."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch
from torch import Tensor

from rlhf.checkpoints import atomic_dir, read_manifest, write_manifest
from rlhf.config import RewardConfig, RuntimeConfig
from rlhf.metrics import REWARD_BEST_EVAL_ACCURACY
from rlhf.models.device import autocast, resolve_device, run_dtype
from rlhf.models.loading import load_options, load_tokenizer
from rlhf.models.reward_ensemble import EnsembleSpec, load_reward
from rlhf.ops import ENSEMBLE_OBJECTIVES, ensemble_scores
from rlhf.tracking.metrics_writer import LogFn
from rlhf.train.reward import RewardResult, score_pairs

ENSEMBLE_PREFIX = "reward_ensemble"


@torch.no_grad()
def member_pair_scores(
    paths: list[str], frame: pd.DataFrame, cfg: RewardConfig, runtime: RuntimeConfig, batch_size: int = 128
) -> tuple[Tensor, Tensor]:
    """Each member's scores of the chosen and the rejected responses of `frame`. Shape: (K, n), (K, n)."""
    device = resolve_device(runtime.device)
    chosen, rejected = [], []
    for path in paths:
        model = load_reward(path, device, **load_options(runtime, device, trainable=False))
        tokenizer = load_tokenizer(path, trust_remote_code=runtime.trust_remote_code)
        c, r = [], []
        with autocast(device, run_dtype(runtime, device)):
            for start in range(0, len(frame), batch_size):
                rows = frame.iloc[start : start + batch_size]
                scores = score_pairs(model, tokenizer, rows, cfg.max_length, device, cfg.min_prompt_tokens)
                c.append(scores[0].float().cpu())
                r.append(scores[1].float().cpu())
        chosen.append(torch.cat(c))
        rejected.append(torch.cat(r))
        del model
    return torch.stack(chosen), torch.stack(rejected)


def ensemble_pair_stats(chosen: Tensor, rejected: Tensor, cfg: RewardConfig) -> tuple[dict[str, float], Tensor, float]:
    """The held-out statistics of K members' scores of n pairs (K, n): each member's accuracy, the ensemble's under
    each objective (and `accuracy`: under `cfg`'s), the share of pairs on which every member agrees with the
    others, and the members' disagreement (their std, mean over pairs) on the chosen and rejected responses, after
    each member's offset (its mean score on the held-out responses less the members' average of those) is taken
    off. Returns
    the statistics, the offsets (K,) and the disagreement on the chosen responses."""
    offsets = torch.cat([chosen, rejected], 1).mean(1)  # (K,)
    offsets = offsets - offsets.mean()
    chosen, rejected = chosen - offsets[:, None], rejected - offsets[:, None]
    prefers = chosen > rejected  # (K, n)
    in_distribution_std = chosen.std(0, unbiased=False).mean().item()
    stats = {f"{ENSEMBLE_PREFIX}/member_{k}_accuracy": prefers[k].float().mean().item() for k in range(len(chosen))}
    for objective in ENSEMBLE_OBJECTIVES:
        c = ensemble_scores(chosen, objective, cfg.uncertainty_coef)
        r = ensemble_scores(rejected, objective, cfg.uncertainty_coef)
        stats[f"{ENSEMBLE_PREFIX}/accuracy_{objective}"] = (c > r).float().mean().item()
    stats |= {
        f"{ENSEMBLE_PREFIX}/accuracy": stats[f"{ENSEMBLE_PREFIX}/accuracy_{cfg.ensemble_objective}"],
        f"{ENSEMBLE_PREFIX}/agreement": (prefers.all(0) | (~prefers).all(0)).float().mean().item(),
        f"{ENSEMBLE_PREFIX}/disagreement_chosen": in_distribution_std,
        f"{ENSEMBLE_PREFIX}/disagreement_rejected": rejected.std(0, unbiased=False).mean().item(),
        f"{ENSEMBLE_PREFIX}/members": float(len(chosen)),
    }
    return stats, offsets, in_distribution_std


def build_ensemble(
    cfg: RewardConfig,
    runtime: RuntimeConfig,
    members: list[str],
    eval_file: str | Path,
    out_dir: str | Path,
    log: LogFn,
) -> RewardResult:
    """Score the held-out pairs with every member, log the ensemble's statistics and write the ensemble's folder
    (`rlhf.models.reward_ensemble`): its spec, member 0's tokenizer and a manifest."""
    start = time.perf_counter()
    frame = pd.read_parquet(eval_file)
    chosen, rejected = member_pair_scores(members, frame, cfg, runtime)
    stats, offsets, in_distribution_std = ensemble_pair_stats(chosen, rejected, cfg)
    stats["time/reward_ensemble"] = time.perf_counter() - start
    log(stats, 0)
    digests = [(read_manifest(path) or {}).get("digest", "") for path in members]
    spec = EnsembleSpec([str(Path(p).resolve()) for p in members], offsets.tolist(), in_distribution_std, digests)
    with atomic_dir(out_dir) as tmp:
        spec.write(tmp)
        load_tokenizer(members[0], trust_remote_code=runtime.trust_remote_code).save_pretrained(tmp)
        manifest = write_manifest(tmp, stage="reward_ensemble", accuracy=stats[f"{ENSEMBLE_PREFIX}/accuracy"])
    metrics = {**stats, REWARD_BEST_EVAL_ACCURACY: stats[f"{ENSEMBLE_PREFIX}/accuracy"]}
    return RewardResult(str(out_dir), manifest["digest"], metrics)
