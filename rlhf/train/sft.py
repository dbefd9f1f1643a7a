"""Supervised fine-tuning: bootstrap a tiny GPT-2 and tokenizer on the demonstrations, fine-tune an existing
model on them, or use an existing checkpoint as it is."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_with_min_lr_schedule_with_warmup

from rlhf.checkpoints import atomic_dir, dir_digest, text_digest, write_manifest
from rlhf.config import RuntimeConfig, SFTConfig
from rlhf.memory import peak_memory_mb, reset_peak_memory
from rlhf.metrics import PEAK_MEMORY
from rlhf.models.bootstrap import build_tiny_gpt2, build_tokenizer
from rlhf.models.cpu_kernels import use_cpu_kernels
from rlhf.models.device import autocast, resolve_device, run_dtype
from rlhf.models.gguf import ModelSource, resolve_model
from rlhf.models.loading import is_local_checkpoint, load_causal_lm, load_options, load_tokenizer
from rlhf.models.training import adamw, disable_gradient_checkpointing, enable_gradient_checkpointing
from rlhf.rollout.batching import encode_and_measure
from rlhf.stages import SFT
from rlhf.tracking.metrics_writer import LogFn
from rlhf.train.supervised import LoopSettings, StepEnd, StepOutput, run_supervised


@dataclass
class SFTResult:
    path: str  # checkpoint folder or hub id: what later stages pass to from_pretrained
    digest: str
    trained: bool
    metrics: dict[str, float]


def model_source(cfg: SFTConfig, runtime: RuntimeConfig) -> ModelSource:
    """What `sft.model` loads from: a GGUF file's dequantised folder under runtime.output_dir (converted once),
    else the configured path or hub id at `sft.revision`."""
    assert cfg.model is not None
    key = "sft.gguf_file" if cfg.gguf_file else "sft.model"
    return resolve_model(key, cfg.model, cfg.gguf_file, cfg.revision, runtime.output_dir)


def load_existing(cfg: SFTConfig, runtime: RuntimeConfig) -> SFTResult:
    """Use a configured checkpoint as the SFT policy (its tokenizer and config must load)."""
    source = model_source(cfg, runtime)
    load_tokenizer(source.path, source.revision, runtime.trust_remote_code)
    if source.digest is not None:  # a dequantised GGUF file: its manifest has the folder's digest
        digest = source.digest
    elif is_local_checkpoint(source.path):
        digest = dir_digest(source.path)
    else:
        digest = text_digest(source.path, source.revision)
    return SFTResult(source.path, digest, trained=False, metrics={})


def tokenizer_corpus(demos: pd.DataFrame, pairs: pd.DataFrame) -> list[str]:
    """Every text the tokenizer will see: prompts and responses of the demonstrations and the pairs."""
    return [*demos["prompt"], *demos["response"], *pairs["prompt"], *pairs["chosen"], *pairs["rejected"]]


def bootstrap_sft(
    cfg: SFTConfig,
    runtime: RuntimeConfig,
    demonstrations: str | Path,
    pairs: str | Path,
    out_dir: str | Path,
    seed: int,
    log: LogFn,
    stop_after: int | None = None,
) -> SFTResult:
    """Train a byte-level BPE tokenizer and a tiny GPT-2 from scratch on prompt -> response demonstrations."""
    demos = pd.read_parquet(demonstrations)
    tokenizer = build_tokenizer(tokenizer_corpus(demos, pd.read_parquet(pairs)), cfg.bootstrap.vocab_size)
    boot = cfg.bootstrap
    model = build_tiny_gpt2(tokenizer, boot.n_layer, boot.n_head, boot.n_embd, boot.n_positions, seed)
    return train_sft(model, tokenizer, demos, cfg, runtime, out_dir, seed, log, boot.n_positions, stop_after)


def finetune_sft(
    cfg: SFTConfig,
    runtime: RuntimeConfig,
    demonstrations: str | Path,
    out_dir: str | Path,
    seed: int,
    log: LogFn,
    stop_after: int | None = None,
) -> SFTResult:
    """Fine-tune the configured model (`sft.model`: a path, hub id or GGUF file) on prompt -> response
    demonstrations."""
    source = model_source(cfg, runtime)
    tokenizer = load_tokenizer(source.path, source.revision, runtime.trust_remote_code)
    cpu = torch.device("cpu")  # train_sft moves it to the runtime device
    model = load_causal_lm(source.path, cpu, source.revision, **load_options(runtime, cpu, trainable=True))
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    max_length = min(cfg.max_length, positions) if positions else cfg.max_length
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    demos = pd.read_parquet(demonstrations)
    return train_sft(model, tokenizer, demos, cfg, runtime, out_dir, seed, log, max_length, stop_after)


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demos: pd.DataFrame,
    cfg: SFTConfig,
    runtime: RuntimeConfig,
    out_dir: str | Path,
    seed: int,
    log: LogFn,
    max_length: int,
    stop_after: int | None = None,
) -> SFTResult:
    """Next-token loss on the response tokens (and the closing EOS, except on rows of `demos` whose optional
    ``stopped`` column is False) only, for `cfg.steps` AdamW steps.

    A demonstration longer than `max_length` keeps its response first and loses the start of its prompt (the
    response is cut on the right only when it does not fit alone); the shares cut are logged once
    (``sft/truncated_fraction``, ``sft/response_truncated_fraction``, ``sft/prompt_lost_fraction``).

    The full state (weights, optimizer, scheduler, RNGs, data order, step) is saved atomically to
    ``out_dir/state`` every ``cfg.save_every`` steps; a restart with the same config continues from it and logs
    only the steps after it. `stop_after` ends training after that many steps, as a crash would (resume tests).
    """
    device = resolve_device(runtime.device)
    reset_peak_memory(device)
    torch.manual_seed(seed)
    model.to(device).train()
    dtype = run_dtype(runtime, device)
    use_cpu_kernels(model)
    optimizer = adamw(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # linear warm-up, then cosine decay to 10% of the peak
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, round(cfg.warmup_ratio * cfg.steps), cfg.steps, min_lr_rate=0.1
    )
    # the response keeps its tokens first, the prompt is cut on the left; the share cut is measured and logged.
    # A demonstration marked not `stopped` (a sample cut at its token limit) gets no EOS to learn.
    ends = demos["stopped"].tolist() if "stopped" in demos else True
    prompts, responses = demos["prompt"].tolist(), demos["response"].tolist()
    batch, cut = encode_and_measure(tokenizer, prompts, responses, max_length, add_eos=ends)
    rows = max(cut.rows, 1)
    length_stats = {
        "sft/truncated_fraction": cut.truncated / rows,
        "sft/response_truncated_fraction": cut.response_truncated / rows,
        "sft/prompt_lost_fraction": cut.prompt_lost / rows,
    }
    pending = dict(length_stats)  # logged once, with the first logged step
    start = time.perf_counter()
    loss_value = float("nan")

    def step_fn(batch_rows: list[int]) -> StepOutput:
        """Next-token loss on the response tokens of one batch. Shapes: (b, T) rows cut to (b, width)."""
        idx = torch.tensor(batch_rows)
        ids, mask, loss_mask = (t[idx] for t in batch)
        width = int(mask.sum(1).max())  # (b, T) -> (b, width): drop all-pad columns
        ids, mask, loss_mask = ids[:, :width].to(device), mask[:, :width].to(device), loss_mask[:, :width].to(device)
        with autocast(device, dtype):
            logits = model(input_ids=ids, attention_mask=mask).logits
        # next-token loss on response tokens only: position t predicts token t+1
        token_loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
        target_mask = loss_mask[:, 1:].float()
        loss = (token_loss * target_mask).sum() / target_mask.sum().clamp(min=1)
        return StepOutput(loss, {"sft/loss": loss})

    def after_step(end: StepEnd) -> None:
        nonlocal loss_value, pending
        loss_value = end.loss.item()
        if end.step == 1 or end.step % 10 == 0 or end.step == cfg.steps or end.skip:  # the first, every 10th, last
            stats = {"sft/loss": loss_value, "sft/lr": scheduler.get_last_lr()[0]}
            stats |= {k: v for k, v in end.stats.items() if k in ("sft/grad_norm", "sft/skipped_nonfinite")}
            log({**stats, **pending}, end.step)
            pending = {}

    settings = LoopSettings(
        stage=SFT,
        prefix="sft",
        total_steps=cfg.steps,
        batch_size=cfg.batch_size,
        n_rows=len(demos),
        save_every=cfg.save_every,
        on_nonfinite=runtime.on_nonfinite,
        progress=runtime.progress,
    )
    rng = random.Random(seed)
    state_dir = Path(out_dir) / "state"
    run_supervised(
        model, optimizer, scheduler, rng, state_dir, device, settings, step_fn, log, after_step, None, stop_after
    )
    elapsed = time.perf_counter() - start
    model.eval()
    if cfg.gradient_checkpointing:
        disable_gradient_checkpointing(model)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        manifest = write_manifest(tmp, stage="sft", steps=cfg.steps, final_loss=loss_value, base_model=cfg.model)
    metrics = {"sft/final_loss": loss_value, "time/sft": elapsed, PEAK_MEMORY: peak_memory_mb(device)}
    metrics |= length_stats
    log(metrics, cfg.steps)
    return SFTResult(str(out_dir), manifest["digest"], trained=True, metrics=metrics)
