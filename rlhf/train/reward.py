"""Reward-model training on preference pairs: pairwise loss, held-out evaluation, best checkpoint kept."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load_file
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_linear_schedule_with_warmup

from rlhf.checkpoints import atomic_dir, write_manifest
from rlhf.config import DPOConfig, RewardConfig, RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.memory import peak_memory_mb, reset_peak_memory
from rlhf.metrics import PEAK_MEMORY, REWARD_BEST_EVAL_ACCURACY
from rlhf.models.cpu_kernels import use_cpu_kernels
from rlhf.models.device import autocast, resolve_device, run_dtype
from rlhf.models.heads import sequence_scores
from rlhf.models.loading import load_options, load_reward_model, load_tokenizer
from rlhf.models.training import (
    adamw,
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
    freeze_lower_layers,
)
from rlhf.ops import pairwise_reward_loss
from rlhf.rollout.batching import encode_prompt_response, pair_lengths
from rlhf.stages import REWARD
from rlhf.tracking.metrics_writer import LogFn
from rlhf.train.supervised import LoopSettings, StepEnd, StepOutput, run_supervised

MAX_DROPPED_FRACTION = 0.5  # reward.truncation 'drop': dropping more of a split than this is a config error


def _untied(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop aliases of shared tensors (tied embeddings) so safetensors can write the dict."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        if value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        out[key] = value
    return out


@dataclass
class RewardResult:
    path: str
    digest: str
    metrics: dict[str, float]


def score_pairs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    frame: pd.DataFrame,
    max_length: int,
    device: torch.device,
    min_prompt_tokens: int = 0,
) -> tuple[Tensor, Tensor]:
    """Scores of chosen and rejected responses. Shape: (n,), (n,)."""
    prompts = frame["prompt"].tolist() * 2
    responses = frame["chosen"].tolist() + frame["rejected"].tolist()
    scores = score_texts(model, tokenizer, prompts, responses, max_length, device, min_prompt_tokens)
    return scores[: len(frame)], scores[len(frame) :]


def score_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    responses: list[str],
    max_length: int,
    device: torch.device,
    min_prompt_tokens: int = 0,
) -> Tensor:
    """Reward-model scores of (prompt, response) texts, each encoded as the reward model was trained on them.
    Shape: (n,)."""
    batch = encode_prompt_response(tokenizer, prompts, responses, max_length, min_prompt_tokens=min_prompt_tokens)
    return sequence_scores(model, batch.input_ids.to(device), batch.attention_mask.to(device))


# the reward model's metric keys: TRAIN_PREFIX/<stat> every step, EVAL_PREFIX/<stat> on the held-out pairs every
# reward.eval_every steps (`pair_stats`); the run's summary keys are reward/<name> (reward/best_eval_accuracy: the kept
# checkpoint's held-out accuracy)
TRAIN_PREFIX = "reward/train"
EVAL_PREFIX = "reward/eval"


def pair_stats(prefix: str, chosen: Tensor, rejected: Tensor, loss: Tensor | None = None) -> dict[str, float]:
    """Accuracy, mean margin, and mean and std of the chosen and rejected scores (and the loss) under `prefix`."""
    stats = {
        f"{prefix}/accuracy": (chosen > rejected).float().mean().item(),
        f"{prefix}/margin": (chosen - rejected).mean().item(),
        f"{prefix}/chosen_mean": chosen.mean().item(),
        f"{prefix}/chosen_std": chosen.std().item() if len(chosen) > 1 else 0.0,
        f"{prefix}/rejected_mean": rejected.mean().item(),
        f"{prefix}/rejected_std": rejected.std().item() if len(rejected) > 1 else 0.0,
    }
    if loss is not None:
        stats[f"{prefix}/loss"] = loss.item()
    return stats


@torch.no_grad()
def evaluate_pairs(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    frame: pd.DataFrame,
    cfg: RewardConfig,
    device: torch.device,
    batch_size: int = 128,
) -> dict[str, float]:
    """Held-out loss, accuracy, margin and reward statistics (`EVAL_PREFIX`/<stat>)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for start in range(0, len(frame), batch_size):
        rows = frame.iloc[start : start + batch_size]
        c, r = score_pairs(model, tokenizer, rows, cfg.max_length, device, cfg.min_prompt_tokens)
        chosen.append(c)
        rejected.append(r)
    model.train(was_training)
    c, r = torch.cat(chosen), torch.cat(rejected)
    margin = _margins(frame, cfg, device)
    loss = pairwise_reward_loss(c, r, margin, cfg.center_coef).loss
    return pair_stats(EVAL_PREFIX, c, r, loss)


def _margins(frame: pd.DataFrame, cfg: RewardConfig, device: torch.device) -> Tensor | None:
    if not cfg.use_margin or "margin" not in frame or frame["margin"].isna().all():
        return None
    return torch.tensor(frame["margin"].fillna(0.0).to_numpy(), dtype=torch.float32, device=device)


def length_policy(
    train: pd.DataFrame,
    evals: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    cfg: RewardConfig | DPOConfig,
    section: str = "reward",
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """Apply `cfg.truncation` to the pairs longer than `cfg.max_length` (prompt + the longer response + EOS); the
    reward stage's pairs and the DPO stage's (`section` names the config section and the metrics' prefix).

    'drop': they leave training and held-out evaluation, counted; a ConfigError when every pair of a split, or
    more than MAX_DROPPED_FRACTION of it, is too long. 'truncate': they stay and are counted; the stage cuts them
    keeping at least `cfg.min_prompt_tokens` of the prompt. Returns the pairs to use and the counts.
    """
    kept, over_counts = [], []
    for split, frame in (("training", train), ("held-out", evals)):
        texts = (frame[c].tolist() for c in ("prompt", "chosen", "rejected"))
        over = pair_lengths(tokenizer, *texts) > cfg.max_length
        n_over = int(over.sum())
        if cfg.truncation == "drop" and n_over > MAX_DROPPED_FRACTION * len(frame):  # all of them, too
            raise ConfigError(
                f"{section}.max_length ({cfg.max_length} tokens) is shorter than {n_over} of the {len(frame)} {split} "
                f"pairs ({n_over / len(frame):.0%}, prompt + the longer response + EOS), and {section}.truncation "
                f"'drop' would leave them out: raise {section}.max_length, or set {section}.truncation to 'truncate'"
            )
        kept.append(frame[~over].reset_index(drop=True) if cfg.truncation == "drop" else frame)
        over_counts.append(n_over)
    n_pairs, n_over = len(train) + len(evals), sum(over_counts)
    dropped = n_over if cfg.truncation == "drop" else 0
    stats = {
        f"{section}/dropped_too_long": float(dropped),
        f"{section}/dropped_too_long_fraction": dropped / max(n_pairs, 1),
        f"{section}/train_dropped_too_long": float(over_counts[0] if dropped else 0),
        f"{section}/eval_dropped_too_long": float(over_counts[1] if dropped else 0),
        f"{section}/truncated_fraction": (n_over - dropped) / max(n_pairs, 1),
    }
    return kept[0], kept[1], stats


def total_steps(cfg: RewardConfig, n_pairs: int) -> int:
    """Optimizer steps of a reward-model run: `cfg.epochs` passes over `n_pairs` in batches (at least one)."""
    return max(1, int(cfg.epochs * math.ceil(n_pairs / cfg.batch_size)))


BEST_FILE = "best.safetensors"  # the best checkpoint's weights, in the resume state's folder


@dataclass
class BestCheckpoint:
    """The checkpoint with the best held-out accuracy so far: its accuracy, step and a copy of its weights, saved
    with the resume state in `folder` (`fields`, `tensor_files`) and restored from it (`resume`)."""

    folder: Path  # the resume state's folder
    device: torch.device  # where resumed weights are loaded
    accuracy: float = -1.0
    step: int = 0
    weights: dict[str, Tensor] | None = None

    def update(self, model: PreTrainedModel, accuracy: float, step: int) -> None:
        """Keep `model`'s weights when `accuracy` beats the best so far (the earliest of equal ones stays)."""
        if accuracy > self.accuracy:
            self.accuracy, self.step = accuracy, step
            # frozen parameters (reward.frozen_layers) never change: the copy is of what trains (and the buffers)
            frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
            self.weights = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in frozen}

    def resume(self, saved: dict[str, Any]) -> None:
        """The best checkpoint of the resume state in `folder` (`saved`: its fields)."""
        self.accuracy, self.step = saved["best_acc"], saved["best_step"]
        if (self.folder / BEST_FILE).is_file():
            self.weights = load_file(self.folder / BEST_FILE, device=str(self.device))

    def fields(self) -> dict[str, Any]:
        return {"best_acc": self.accuracy, "best_step": self.step}

    def tensor_files(self) -> dict[str, dict[str, Tensor]] | None:
        return {BEST_FILE: _untied(self.weights)} if self.weights is not None else None

    def load_into(self, model: PreTrainedModel) -> None:
        """Give `model` the best checkpoint's weights (none kept: it stays as it is)."""
        if self.weights is not None:
            model.load_state_dict(self.weights, strict=False)


def train_reward_model(
    cfg: RewardConfig,
    runtime: RuntimeConfig,
    init_path: str,
    train_file: str | Path,
    eval_file: str | Path,
    out_dir: str | Path,
    seed: int,
    log: LogFn,
    stop_after: int | None = None,
) -> RewardResult:
    """Initialise a scalar-head model from `init_path` (the SFT checkpoint, or an ensemble member's own model of
    reward.ensemble_models, with its tokenizer) and train it on preference pairs.

    The full state (weights, optimizer, scheduler, RNGs, data order, best checkpoint) is saved to
    ``out_dir/state`` every ``cfg.save_every`` steps; a restart with the same config continues from it.
    `stop_after` ends training after that many steps, as a crash would (for resume tests).
    """
    device = resolve_device(runtime.device)
    reset_peak_memory(device)
    train = pd.read_parquet(train_file)
    evals = pd.read_parquet(eval_file)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(init_path, trust_remote_code=runtime.trust_remote_code)
    train, evals, length_stats = length_policy(train, evals, tokenizer, cfg)
    if cfg.bootstrap:  # an ensemble member's own resample of the pairs, with replacement (reward.bootstrap)
        train = train.sample(n=len(train), replace=True, random_state=seed).reset_index(drop=True)
    model = load_reward_model(init_path, device, **load_options(runtime, device, trainable=True))
    use_cpu_kernels(model)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    trainable = freeze_lower_layers(model, cfg.frozen_layers)
    total = total_steps(cfg, len(train))
    warmup = int(cfg.warmup_ratio * total)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total)  # linear warm-up, then linear decay to 0
    dtype = run_dtype(runtime, device)
    state_dir = Path(out_dir) / "state"
    best = BestCheckpoint(state_dir, device)
    pending = {**length_stats, f"{TRAIN_PREFIX}/trainable_parameters": float(trainable)}  # logged with step 1
    start = time.perf_counter()

    def step_fn(batch_rows: list[int]) -> StepOutput:
        """Pairwise loss of one batch of pairs; the statistics of its chosen (b,) and rejected (b,) scores."""
        rows = train.iloc[batch_rows]
        with autocast(device, dtype):
            chosen, rejected = score_pairs(model, tokenizer, rows, cfg.max_length, device, cfg.min_prompt_tokens)
        out = pairwise_reward_loss(chosen, rejected, _margins(rows, cfg, device), cfg.center_coef)
        stats = pair_stats(TRAIN_PREFIX, chosen.detach(), rejected.detach(), out.loss.detach())
        stats.update({f"{TRAIN_PREFIX}/lr": scheduler.get_last_lr()[0], **pending})
        pending.clear()
        return StepOutput(out.loss, stats)

    def after_step(end: StepEnd) -> None:
        stats = end.stats
        if end.step % cfg.eval_every == 0 or end.step == total:
            stats.update(evaluate_pairs(model, tokenizer, evals, cfg, device))
            best.update(model, stats[f"{EVAL_PREFIX}/accuracy"], end.step)
        log(stats, end.step)

    settings = LoopSettings(
        stage=REWARD,
        prefix=TRAIN_PREFIX,
        total_steps=total,
        batch_size=cfg.batch_size,
        n_rows=len(train),
        save_every=cfg.save_every,
        on_nonfinite=runtime.on_nonfinite,
        progress=runtime.progress,
        extra_fields=best.fields,
        tensor_files=best.tensor_files,
    )
    rng = random.Random(seed)
    run_supervised(
        model, optimizer, scheduler, rng, state_dir, device, settings, step_fn, log, after_step, best.resume, stop_after
    )
    best.load_into(model)
    # the kept checkpoint's accuracy was measured when it was kept, at these weights (a held-out evaluation is
    # deterministic): evaluated again only where no checkpoint was kept (no step ran)
    if best.weights is not None:
        accuracy = best.accuracy
    else:
        accuracy = evaluate_pairs(model, tokenizer, evals, cfg, device)[f"{EVAL_PREFIX}/accuracy"]
    metrics = {
        REWARD_BEST_EVAL_ACCURACY: accuracy,
        "reward/best_step": float(best.step),
        "time/reward": time.perf_counter() - start,
        PEAK_MEMORY: peak_memory_mb(device),
        **length_stats,
    }
    log(metrics, total)
    if cfg.gradient_checkpointing:
        disable_gradient_checkpointing(model)
    model.eval()
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # `init`: the checkpoint it started from (an ensemble's members: which SFT checkpoint or model of their own)
        manifest = write_manifest(tmp, stage="reward", init=init_path, best_step=best.step, eval_accuracy=accuracy)
    return RewardResult(str(out_dir), manifest["digest"], metrics)
