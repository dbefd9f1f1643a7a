"""DPO (Rafailov et al. 2023): the policy trained directly on the preference pairs against the frozen SFT model.

A policy stage beside PPO: it starts from the SFT checkpoint, trains on the same prepared pairs as the reward
model (no reward model, no sampling) and writes ``<out>/final/policy`` as PPO does. The loop is the supervised
one (`rlhf.train.supervised.run_supervised`): seeded batch order, resume, clipping, non-finite checks, saving.
"""

from __future__ import annotations

import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_linear_schedule_with_warmup

from rlhf.checkpoints import atomic_dir, write_manifest
from rlhf.config import DPOConfig, RuntimeConfig
from rlhf.errors import DataError
from rlhf.memory import peak_memory_mb, reset_peak_memory
from rlhf.metrics import PEAK_MEMORY
from rlhf.models.cpu_kernels import use_cpu_kernels
from rlhf.models.device import autocast, resolve_device, run_dtype
from rlhf.models.heads import backbone_hidden, lm_logits
from rlhf.models.loading import load_causal_lm, load_options, load_tokenizer
from rlhf.models.training import (
    adamw,
    disable_dropout,
    disable_gradient_checkpointing,
    enable_gradient_checkpointing,
)
from rlhf.ops import DPOLossOutput, dpo_loss, sequence_logps
from rlhf.rollout.batching import encode_prompt_response
from rlhf.stages import DPO
from rlhf.tracking.metrics_writer import LogFn
from rlhf.train.reward import length_policy
from rlhf.train.supervised import LoopSettings, StepEnd, StepOutput, run_supervised

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
FORWARD_PAIRS = 64  # pairs per no-grad forward (reference log-probs, held-out evaluation): 128 sequences


@dataclass
class DPOResult:
    path: str  # <out>/final/policy: what later stages pass to from_pretrained
    digest: str  # content digest of <out>/final (its manifest)
    steps: int
    metrics: dict[str, float]


class PairLogps(NamedTuple):
    chosen: Tensor  # (n,)
    rejected: Tensor  # (n,)


def total_steps(cfg: DPOConfig, n_pairs: int) -> int:
    """Optimizer steps of a DPO run: `cfg.epochs` passes over `n_pairs` in batches (at least one)."""
    return max(1, int(cfg.epochs * math.ceil(n_pairs / cfg.batch_size)))


def _pairs(value: str | Path | pd.DataFrame, split: str) -> pd.DataFrame:
    """The pairs of a split, read from a Parquet file or given as a frame, with the columns DPO needs."""
    frame = value if isinstance(value, pd.DataFrame) else pd.read_parquet(value)
    where = "" if isinstance(value, pd.DataFrame) else f" ({value})"
    missing = [c for c in PAIR_COLUMNS if c not in frame.columns]
    if missing:
        raise DataError(f"the {split} pairs{where} lack the column(s) {', '.join(missing)}")
    if frame.empty:
        raise DataError(f"the {split} pairs{where} are empty")
    return frame.reset_index(drop=True)


def fit_pairs(
    train: pd.DataFrame, evals: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, cfg: DPOConfig
) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """Apply `cfg.truncation` to the pairs longer than `cfg.max_length` (prompt + the longer response + EOS), as
    the reward stage does (`rlhf.train.reward.length_policy`): 'drop' leaves them out, counted, and is a ConfigError
    past MAX_DROPPED_FRACTION of a split; 'truncate' keeps them, and `pair_logps` cuts them (the prompt on the left,
    at least `cfg.min_prompt_tokens` of it kept; the response on the right). Returns the pairs and the counts."""
    return length_policy(train, evals, tokenizer, cfg, "dpo")


def pair_logps(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: pd.DataFrame,
    cfg: DPOConfig,
    device: torch.device,
) -> PairLogps:
    """Log-probs of the chosen and the rejected responses given their prompt under `model`, in one forward of the
    2n sequences: sums over the response tokens and the EOS (means with `cfg.length_normalized`).

    The rows are laid out as the reward model's (`encode_prompt_response`); only the positions that predict a
    response token go through the LM head. Shape: n rows -> (n,), (n,) in float32.
    """
    n = len(rows)
    prompts = rows["prompt"].tolist() * 2
    responses = rows["chosen"].tolist() + rows["rejected"].tolist()
    batch = encode_prompt_response(
        tokenizer, prompts, responses, cfg.max_length, min_prompt_tokens=cfg.min_prompt_tokens
    )
    ids, mask, loss_mask = (t.to(device) for t in batch)  # (2n, t), right-padded
    # the first response token of any row; position t predicts token t + 1, and token 0 has no predictor
    start = max(1, int(loss_mask.argmax(1).min()))
    hidden = backbone_hidden(model, ids, mask)[:, start - 1 : -1]  # (2n, t, h) -> (2n, t - start, h)
    logps = sequence_logps(lm_logits(model, hidden), ids[:, start:], loss_mask[:, start:], cfg.length_normalized)
    logps = logps.float()  # (2n,)
    return PairLogps(logps[:n], logps[n:])


@torch.no_grad()
def frame_logps(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    frame: pd.DataFrame,
    cfg: DPOConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> PairLogps:
    """`pair_logps` of every pair of `frame`, under no grad, `FORWARD_PAIRS` pairs at a time (eval mode: the same
    numbers in train mode, as dropout is off). Shape: n rows -> (n,), (n,)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for first in range(0, len(frame), FORWARD_PAIRS):
        with autocast(device, dtype):
            out = pair_logps(model, tokenizer, frame.iloc[first : first + FORWARD_PAIRS], cfg, device)
        chosen.append(out.chosen)
        rejected.append(out.rejected)
    model.train(was_training)
    return PairLogps(torch.cat(chosen), torch.cat(rejected))


def dpo_stats(prefix: str, out: DPOLossOutput, policy: PairLogps) -> dict[str, float]:
    """What DPO users read: the loss, the implicit rewards (means), their margin and accuracy, the log-probs."""
    return {
        f"{prefix}/loss": out.loss.item(),
        f"{prefix}/rewards/chosen": out.chosen_rewards.mean().item(),
        f"{prefix}/rewards/rejected": out.rejected_rewards.mean().item(),
        f"{prefix}/rewards/margin": out.reward_margin.item(),
        f"{prefix}/rewards/accuracy": out.reward_accuracy.item(),
        f"{prefix}/logps/chosen": policy.chosen.detach().mean().item(),
        f"{prefix}/logps/rejected": policy.rejected.detach().mean().item(),
    }


def _loss(policy: PairLogps, ref: PairLogps, cfg: DPOConfig) -> DPOLossOutput:
    return dpo_loss(
        policy.chosen, policy.rejected, ref.chosen, ref.rejected, cfg.beta, cfg.loss_type, cfg.label_smoothing
    )


def evaluate_dpo(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    frame: pd.DataFrame,
    ref: PairLogps,
    cfg: DPOConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, float]:
    """Held-out DPO statistics (``dpo/eval/...``) of the policy against the reference log-probs `ref` of `frame`."""
    policy = frame_logps(model, tokenizer, frame, cfg, device, dtype)
    return dpo_stats("dpo/eval", _loss(policy, ref, cfg), policy)


def train_dpo(
    cfg: DPOConfig,
    runtime: RuntimeConfig,
    sft_path: str,
    train_pairs: str | Path | pd.DataFrame,
    eval_pairs: str | Path | pd.DataFrame,
    out_dir: str | Path,
    seed: int,
    log: LogFn,
    stop_after: int | None = None,
) -> DPOResult:
    """Train the policy, initialised from the SFT checkpoint, with the DPO loss on the preference pairs (columns
    prompt, chosen, rejected; a Parquet file or a frame) against the SFT model as the frozen reference.

    Reference log-probs are computed once, before the first step, by the policy itself while it still holds the
    SFT weights (dropout off, so it is the reference exactly), for the training and the held-out pairs, and kept in
    memory: one no-grad pass over the pairs instead of a no-grad forward of a second, frozen model every step and
    every evaluation, and no second model in memory. Measured on a CPU (one thread) at conf/smoke.yaml's sizes
    (1-layer GPT-2 of width 64, 256 + 64 pairs, batch 32, 8 steps, 2 evaluations): 0.45 s once against 0.60 s on
    the fly (0.57 s of forwards and 0.03 s to load the reference), medians of 7; on the fly grows with the epochs
    and the evaluations, once does not. A resumed run computes them again the same way, before its saved state is
    loaded, so no cache on disk can go stale (a different SFT model, data or max_length).

    Logged every step: ``dpo/loss``, ``dpo/rewards/{chosen,rejected,margin,accuracy}``, ``dpo/logps/{chosen,
    rejected}``, ``dpo/lr``, ``dpo/grad_norm``; every ``cfg.eval_every`` steps and after the last one the same
    statistics of the held-out pairs under ``dpo/eval/``; steps count from 1. The full state (weights, optimizer,
    scheduler, RNGs, data order) is saved to ``out_dir/state`` every ``cfg.save_every`` steps; a restart with the
    same settings continues from it. `stop_after` ends training after that many steps, as a crash would. The
    policy and its tokenizer are written atomically to ``out_dir/final/policy`` (manifest in ``out_dir/final``),
    then the resume state is removed.
    """
    train, evals = _pairs(train_pairs, "training"), _pairs(eval_pairs, "held-out")
    device = resolve_device(runtime.device)
    reset_peak_memory(device)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(sft_path, trust_remote_code=runtime.trust_remote_code)
    train, evals, length_stats = fit_pairs(train, evals, tokenizer, cfg)
    model = load_causal_lm(sft_path, device, **load_options(runtime, device, trainable=True))
    use_cpu_kernels(model)
    disable_dropout(model)  # the policy must equal the reference before the first step
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    dtype = run_dtype(runtime, device)
    start = time.perf_counter()
    # step 0. reference log-probs: the policy still holds the SFT weights (a resume loads its state later)
    ref_train = frame_logps(model, tokenizer, train, cfg, device, dtype)
    ref_eval = frame_logps(model, tokenizer, evals, cfg, device, dtype)
    reference_seconds = time.perf_counter() - start
    model.train()
    total = total_steps(cfg, len(train))
    optimizer = adamw(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(cfg.warmup_ratio * total), total)
    pending = dict(length_stats)  # logged once, with this run's first step
    last_eval: dict[str, float] = {}

    def step_fn(batch_rows: list[int]) -> StepOutput:
        """DPO loss of one batch of pairs: the policy's log-probs (b,) against the cached reference's."""
        nonlocal pending
        # step 1. policy log-probs of the chosen and rejected responses, one forward
        with autocast(device, dtype):
            policy = pair_logps(model, tokenizer, train.iloc[batch_rows], cfg, device)
        # step 2. the loss against the reference log-probs of the same rows
        index = torch.tensor(batch_rows, device=ref_train.chosen.device)
        ref = PairLogps(ref_train.chosen[index], ref_train.rejected[index])
        out = _loss(policy, ref, cfg)
        stats = {**dpo_stats("dpo", out, policy), "dpo/lr": scheduler.get_last_lr()[0], **pending}
        pending = {}
        return StepOutput(out.loss, stats)

    def after_step(end: StepEnd) -> None:
        nonlocal last_eval
        stats = end.stats
        if end.step % cfg.eval_every == 0 or end.step == total:
            last_eval = evaluate_dpo(model, tokenizer, evals, ref_eval, cfg, device, dtype)
            stats.update(last_eval)
        log(stats, end.step)

    settings = LoopSettings(
        stage=DPO,
        prefix="dpo",
        total_steps=total,
        batch_size=cfg.batch_size,
        n_rows=len(train),
        save_every=cfg.save_every,
        on_nonfinite=runtime.on_nonfinite,
        progress=runtime.progress,
    )
    state_dir = Path(out_dir) / "state"
    run_supervised(
        model, optimizer, scheduler, random.Random(seed), state_dir, device, settings, step_fn, log, after_step,
        None, stop_after,
    )  # fmt: skip
    if not last_eval:  # the last step is always run in this process, so this is a guard only
        last_eval = evaluate_dpo(model, tokenizer, evals, ref_eval, cfg, device, dtype)
    summary = {
        "time/dpo": time.perf_counter() - start,
        "time/dpo_reference": reference_seconds,
        PEAK_MEMORY: peak_memory_mb(device),
        **length_stats,
    }
    log(summary, total)
    if cfg.gradient_checkpointing:
        disable_gradient_checkpointing(model)
    model.eval()
    with atomic_dir(Path(out_dir) / "final") as tmp:
        model.save_pretrained(tmp / "policy", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "policy")
        manifest = write_manifest(
            tmp, stage="dpo", steps=total, beta=cfg.beta, loss_type=cfg.loss_type, sft_model=sft_path,
            eval_accuracy=last_eval["dpo/eval/rewards/accuracy"],
        )  # fmt: skip
    shutil.rmtree(state_dir, ignore_errors=True)  # the policy is written: the resume state has served
    return DPOResult(str(Path(out_dir) / "final" / "policy"), manifest["digest"], total, {**last_eval, **summary})
