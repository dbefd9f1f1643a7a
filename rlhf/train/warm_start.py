"""Verified best-of-N warm start: rejection-sampling fine-tuning of the SFT policy before the policy stage.

RAFT (Dong et al. 2023, "RAFT: Reward rAnked FineTuning") and Llama 2's rejection sampling (Touvron et al. 2023)
sample N responses per prompt from the current policy, keep the best by the reward, and fine-tune on them. Here the
reward is a verifier (``reward.function``, e.g. IFEval's checkers with the rows' own ``instruction_id_list`` and
``kwargs``), so "best" has a floor: a response is kept when it scores at least ``warm_start.min_score``, at most
``warm_start.keep_per_prompt`` distinct ones per prompt, the highest scores first (RAFT's top-1 per prompt is
``keep_per_prompt: 1``; a prompt none of whose samples passes contributes nothing, where RAFT would keep its best).

1. `draw_samples`: `warm_start.samples` responses to each of `warm_start.prompts` training prompts (the policy
   stage's ``prompts.parquet``, the first of a seeded order) from the SFT policy, as the PPO stage samples them
   (its prompt budget, stop tokens and decode mode; `WarmStartSampling`), scored and selected, written to
   ``samples.parquet`` in the stage's folder. A retry or a rerun of the same stage reads that file instead of
   sampling again.
2. `finetune_on_kept`: the SFT trainer (`rlhf.train.sft.train_sft`, its save and resume in ``final/state``) on the
   kept (prompt, response) pairs (a response cut at the token limit without its EOS, so that none learns to stop
   mid-sentence), `warm_start.steps` steps at `warm_start.lr`; the checkpoint is ``final/``. A warm
   start that kept nothing stops here with one sentence (`WarmStartError`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from pydantic import BaseModel
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.checkpoints import atomic_file
from rlhf.config import PPOConfig, RuntimeConfig, SFTConfig, WarmStartConfig
from rlhf.errors import WarmStartError
from rlhf.metrics import (
    WARM_START_KEPT,
    WARM_START_KEPT_FRACTION,
    WARM_START_KEPT_RESPONSE_TOKENS,
    WARM_START_MEAN_SCORE,
    WARM_START_PROMPTS,
    WARM_START_PROMPTS_KEPT,
    WARM_START_RESPONSE_TOKENS,
    WARM_START_SAMPLES,
    WARM_START_SAMPLING_TIME,
)
from rlhf.models.device import autocast, resolve_device, run_dtype
from rlhf.models.loading import load_causal_lm, load_options, load_tokenizer
from rlhf.models.stop_tokens import stop_token_ids
from rlhf.models.training import enable_gradient_checkpointing
from rlhf.rollout.batching import pad_left
from rlhf.rollout.generation import GenerationSettings, Responses, sample_responses
from rlhf.rollout.prompt_fit import fit_prompts
from rlhf.rollout.reward_function import load_reward_functions
from rlhf.rollout.rows import PromptRows, RowColumns
from rlhf.rollout.static_decode import resolve_decode
from rlhf.tracking.metrics_writer import LogFn
from rlhf.train.sft import SFTResult, train_sft

SAMPLES_FILE = "samples.parquet"  # every sample (prompt, row, sample, response, ...: COLUMNS), in the stage's folder
CHECKPOINT = "final"  # the warm-started checkpoint's folder inside the stage's folder (its resume state: final/state)
# row: its row key (rlhf.rollout.rows); stopped: the response ended with a stop token (False: cut at its token limit)
COLUMNS = ("prompt", "row", "sample", "response", "score", "tokens", "stopped", "kept")


class WarmStartSampling(BaseModel):
    """What the warm start's sampling takes from the policy stage's settings (part of the stage's cache key, so a
    sweep over the rest of ppo.* shares the warm start)."""

    max_new_tokens: int  # warm_start.max_new_tokens, else ppo.max_new_tokens
    temperature: float  # warm_start.temperature, else ppo.temperature
    max_prompt_tokens: int  # ppo.max_prompt_tokens: prompts are fitted as PPO fits them
    stop_tokens: list[int | str]  # ppo.stop_tokens, beside the tokenizer's EOS and end-of-turn ids
    decode: str  # ppo.generation.decode (the same tokens in every mode; 'auto' resolved on the device)

    @classmethod
    def of(cls, cfg: WarmStartConfig, ppo: PPOConfig) -> WarmStartSampling:
        return cls(
            max_new_tokens=cfg.max_new_tokens or ppo.max_new_tokens,
            temperature=cfg.temperature or ppo.temperature,
            max_prompt_tokens=ppo.max_prompt_tokens,
            stop_tokens=list(ppo.stop_tokens),
            decode=ppo.generation.decode,
        )


@dataclass
class Samples:
    """The scored samples (one row each, `COLUMNS`) and the seconds sampling and scoring them took (None: read
    back from an earlier attempt's file)."""

    frame: pd.DataFrame
    seconds: float | None = None

    @property
    def kept(self) -> pd.DataFrame:
        return self.frame[self.frame["kept"]]


def training_prompts(prompts_file: str | Path, n: int | None, seed: int) -> PromptRows:
    """The distinct rows of `prompts_file` (a prompt with two truths is two) in a seeded order, the first `n` of them
    (None: all)."""
    rows = PromptRows.read(prompts_file).distinct()
    order = list(range(len(rows.keys)))
    random.Random(seed).shuffle(order)
    return PromptRows([rows.prompts[i] for i in order[:n]], [rows.keys[i] for i in order[:n]])


def select(frame: pd.DataFrame, min_score: float, keep_per_prompt: int) -> pd.Series:
    """Which samples are kept: those scoring at least `min_score`, at most `keep_per_prompt` distinct responses per
    prompt row, the highest scores first (ties: the earlier sample). Shape: (rows,) bool, aligned with `frame`."""
    passing = frame[frame["score"] >= min_score].sort_values("score", ascending=False, kind="stable")
    distinct = passing.drop_duplicates(["row", "response"])
    chosen = distinct.groupby("row", sort=False).head(keep_per_prompt).index
    return pd.Series(frame.index.isin(chosen), index=frame.index)


def demonstration_texts(tokenizer: PreTrainedTokenizerBase, resp: Responses) -> list[str]:
    """The responses as SFT demonstrations: their tokens as sampled, special tokens inside them visible, the closing
    stop token left out where it is the tokenizer's EOS (the SFT trainer appends EOS) and kept where it is another
    (a chat template's end of turn, as the chat responses of sft.parquet keep it). Shape: resp (b, r) -> b texts."""
    eos = tokenizer.eos_token_id
    rows = []
    for ids, n, stop in zip(resp.tokens.tolist(), resp.mask.sum(1).tolist(), resp.contains_stop.tolist(), strict=True):
        ids = ids[:n]  # (r,) -> up to and including the first stop token
        rows.append(ids[:-1] if stop and ids and ids[-1] == eos else ids)
    return tokenizer.batch_decode(rows, skip_special_tokens=False)


@torch.no_grad()
def sample_candidates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    n: int,
    settings: GenerationSettings,
    max_prompt_tokens: int,
    batch_prompts: int,
    generator: torch.Generator,
    dtype: torch.dtype,
    progress: bool = False,
) -> pd.DataFrame:
    """`n` responses to each prompt, `batch_prompts` prompts (times `n`) a generation call: one row per sample,
    prompt-major (rows i*n .. i*n + n - 1 are prompt i's): prompt, sample, response (`demonstration_texts`), text
    (what a reward function reads: special tokens and padding dropped, as PPO's scoring decodes), tokens (response
    tokens, the stop token included), stopped (it ended with a stop token, not at the token limit)."""
    device = generator.device
    fitted = fit_prompts(tokenizer, prompts, max_prompt_tokens).ids  # as PPO fits its prompts
    rows: dict[str, list] = {"response": [], "text": [], "tokens": [], "stopped": []}
    for start in tqdm(range(0, len(prompts), batch_prompts), desc="warm start", disable=not progress):
        ids = [row for row in fitted[start : start + batch_prompts] for _ in range(n)]  # (prompts,) -> (prompts * n,)
        query, query_mask = (t.to(device) for t in pad_left(ids, tokenizer.pad_token_id))
        with autocast(device, dtype):
            resp = sample_responses(model, query, query_mask, settings, generator)
        rows["response"] += demonstration_texts(tokenizer, resp)
        rows["text"] += tokenizer.batch_decode(
            resp.tokens.masked_fill(resp.mask == 0, tokenizer.pad_token_id), skip_special_tokens=True
        )
        rows["tokens"] += resp.mask.sum(1).tolist()
        rows["stopped"] += resp.contains_stop.tolist()
    repeated = [prompt for prompt in prompts for _ in range(n)]  # (prompts,) -> (prompts * n,), as the responses
    return pd.DataFrame({"prompt": repeated, "sample": list(range(n)) * len(prompts), **rows})


def draw_samples(
    cfg: WarmStartConfig,
    sampling: WarmStartSampling,
    runtime: RuntimeConfig,
    sft_path: str,
    prompts_file: str | Path,
    reward_functions: list[str],
    reward_weights: list[float],
    out_dir: str | Path,
    seed: int,
) -> Samples:
    """`cfg.samples` responses of the SFT policy at `sft_path` to each training prompt, scored by the weighted sum of
    `reward_functions` (with the prompts' row columns) and selected (`select`), written to `out_dir`/samples.parquet;
    an earlier attempt's file (a retry, a rerun of the same stage) is read instead of sampling again."""
    path = Path(out_dir) / SAMPLES_FILE
    if path.is_file():
        return Samples(pd.read_parquet(path))
    started = time.perf_counter()
    rows = training_prompts(prompts_file, cfg.prompts, seed)
    # the verifier and the rows' own truth first: a function that cannot be used stops before a model loads
    verifier = load_reward_functions(reward_functions, reward_weights).with_columns(RowColumns.read(prompts_file))
    device = resolve_device(runtime.device)
    tokenizer = load_tokenizer(sft_path, trust_remote_code=runtime.trust_remote_code)
    model = load_causal_lm(sft_path, device, **load_options(runtime, device, trainable=False)).eval()
    settings = GenerationSettings(
        sampling.max_new_tokens,
        sampling.temperature,
        stop_token_ids=stop_token_ids(tokenizer, sampling.stop_tokens, model.config, model.generation_config),
        pad_token_id=tokenizer.pad_token_id,
        decode=resolve_decode(sampling.decode, device),
    )
    generator = torch.Generator(device=device).manual_seed(seed)
    frame = sample_candidates(
        model, tokenizer, rows.prompts, cfg.samples, settings, sampling.max_prompt_tokens, cfg.batch_size, generator,
        run_dtype(runtime, device), runtime.progress,
    )  # fmt: skip
    del model
    frame["row"] = [key for key in rows.keys for _ in range(cfg.samples)]  # prompt-major, as the samples
    frame["score"] = verifier(frame["prompt"].tolist(), frame.pop("text").tolist(), frame["row"].tolist())
    frame["kept"] = select(frame, cfg.min_score, cfg.keep_per_prompt)
    frame = frame[list(COLUMNS)]
    with atomic_file(path, "wb") as f:  # whole or absent: a retry reads complete samples or samples anew
        frame.to_parquet(f, index=False)
    return Samples(frame, time.perf_counter() - started)


def sample_metrics(samples: Samples) -> dict[str, float]:
    """The samples' figures (step 0): prompts, samples, kept, their shares, the mean score, mean response tokens."""
    frame, kept = samples.frame, samples.kept
    metrics = {
        WARM_START_PROMPTS: float(frame["prompt"].nunique()),
        WARM_START_SAMPLES: float(len(frame)),
        WARM_START_KEPT: float(len(kept)),
        WARM_START_KEPT_FRACTION: len(kept) / max(len(frame), 1),
        WARM_START_PROMPTS_KEPT: float(kept["prompt"].nunique()),
        WARM_START_MEAN_SCORE: float(frame["score"].mean()),
        WARM_START_RESPONSE_TOKENS: float(frame["tokens"].mean()),
    }
    if len(kept):
        metrics[WARM_START_KEPT_RESPONSE_TOKENS] = float(kept["tokens"].mean())
    if samples.seconds is not None:
        metrics[WARM_START_SAMPLING_TIME] = samples.seconds
    return metrics


def require_kept(samples: Samples, cfg: WarmStartConfig) -> None:
    """WarmStartError, one sentence, when no sample was kept: a fine-tuning on nothing would start the policy stage
    from the SFT policy under another name."""
    if len(samples.kept):
        return
    frame = samples.frame
    raise WarmStartError(
        f"warm start kept no response: 0 of {len(frame)} samples of {frame['prompt'].nunique()} prompts scored at "
        f"least {cfg.min_score} (warm_start.min_score); raise warm_start.samples or lower warm_start.min_score"
    )


def finetune_on_kept(
    cfg: WarmStartConfig,
    sft_cfg: SFTConfig,
    runtime: RuntimeConfig,
    sft_path: str,
    samples: Samples,
    out_dir: str | Path,
    seed: int,
    log: LogFn,
    stop_after: int | None = None,
) -> SFTResult:
    """The SFT policy at `sft_path` fine-tuned on the kept samples by the SFT trainer: `cfg.steps` steps of
    `cfg.batch_size` at peak `cfg.lr`, the SFT stage's other settings (`sft_cfg`: weight decay, warm-up, length
    limit, save_every, gradient checkpointing). The checkpoint is `out_dir`/final; a restart resumes from its saved
    state. WarmStartError (before any model loads) when nothing was kept."""
    require_kept(samples, cfg)
    train_cfg = sft_cfg.model_copy(update={"steps": cfg.steps, "lr": cfg.lr, "batch_size": cfg.batch_size})
    tokenizer = load_tokenizer(sft_path, trust_remote_code=runtime.trust_remote_code)
    cpu = torch.device("cpu")  # train_sft moves it to the runtime device
    model = load_causal_lm(sft_path, cpu, **load_options(runtime, cpu, trainable=True))
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    max_length = min(train_cfg.max_length, positions) if positions else train_cfg.max_length
    if train_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    demos = samples.kept[["prompt", "response", "stopped"]].reset_index(drop=True)  # a cut response learns no EOS
    out = Path(out_dir) / CHECKPOINT
    return train_sft(model, tokenizer, demos, train_cfg, runtime, out, seed, log, max_length, stop_after)
