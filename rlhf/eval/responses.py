"""One policy's responses to held-out prompts, scored: a row per prompt with its response, reward-model score (and
an ensemble's members', a reward function's own), KL from the reference and length. The table the evaluation stage
(``rlhf.eval.evaluate``) and PPO's periodic evaluation (``rlhf.ppo.periodic_eval``) both make."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from rlhf.metrics import REWARD_FUNCTION_PREFIX
from rlhf.ops import kl_per_token
from rlhf.rollout.batching import pad_left
from rlhf.rollout.generation import GenerationSettings, response_texts
from rlhf.rollout.prompt_fit import fit_prompts
from rlhf.rollout.rows import PromptRows
from rlhf.rollout.scoring import ScoringModels, generate_and_score


def eval_prompts(eval_file: str | Path, n: int) -> PromptRows:
    """The first `n` distinct rows of the held-out split (a prompt with two truths is two), in file order."""
    return PromptRows.read(eval_file).distinct(n)


def generate_and_score_prompts(
    models: ScoringModels,
    prompts: list[str],
    settings: GenerationSettings,
    max_prompt_tokens: int,
    batch_size: int,
    generator: torch.Generator,
    dtype: torch.dtype,
    progress: bool = False,
    rows: list[str] | None = None,
) -> pd.DataFrame:
    """One policy's responses to `prompts` in batches (`rlhf.rollout.scoring.generate_and_score`, as PPO rollouts are
    made), with their reward-model score and their KL from the reference (the k1 estimator summed over the
    response), one row per prompt: prompt, row (its key, of `rows`: ``rlhf.rollout.rows``), response, score, kl,
    ref_nll (the reference's surprisal summed over the same tokens: -log p_ref), tokens (how many), length (tokens
    before the stop token), stopped.
    Used by the evaluation stage and by PPO's periodic evaluation (``rlhf.ppo.periodic_eval``)."""
    tokenizer = models.tokenizer
    device = generator.device
    out = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="eval", disable=not progress):
        batch_prompts = prompts[start : start + batch_size]
        ids = fit_prompts(tokenizer, batch_prompts, max_prompt_tokens).ids  # as PPO fits its prompts
        query, query_mask = (t.to(device) for t in pad_left(ids, tokenizer.pad_token_id))
        keys = None if rows is None else rows[start : start + batch_size]
        scored = generate_and_score(models, query, query_mask, batch_prompts, settings, generator, dtype, rows=keys)
        resp = scored.resp
        mask = resp.mask.float()
        kl = kl_per_token(scored.logprobs, scored.ref_logprobs, "k1") * mask  # (b, r)
        texts = response_texts(tokenizer, resp)  # special tokens inside a response visible
        members = member_columns(scored.member_scores) | function_columns(models, scored.function_scores)
        for i, prompt in enumerate(batch_prompts):
            out.append(
                {
                    **{name: float(column[i]) for name, column in members.items()},
                    "prompt": prompt,
                    "row": None if keys is None else keys[i],
                    "response": texts[i],
                    "score": float(scored.scores[i]),
                    "kl": float(kl[i].sum()),
                    "ref_nll": -float((scored.ref_logprobs[i] * mask[i]).sum()),
                    "tokens": int(mask[i].sum()),
                    "length": int(mask[i].sum()) - int(resp.contains_stop[i]),  # tokens before the stop token
                    "stopped": bool(resp.contains_stop[i]),
                }
            )
    return pd.DataFrame(out)


def function_columns(models: ScoringModels, function_scores: Tensor | None) -> dict[str, Tensor]:
    """Each reward function's own scores as a column, rewards/<name> (reward.functions); none without functions."""
    if function_scores is None or models.reward_fn is None:
        return {}
    names = models.reward_fn.names
    return {REWARD_FUNCTION_PREFIX + name: row for name, row in zip(names, function_scores, strict=True)}


def member_columns(member_scores: Tensor | None) -> dict[str, Tensor]:
    """An ensemble's per-response columns: its members' mean, std (population) and minimum. Shape: (K, b) -> (b,)
    each; none without an ensemble."""
    if member_scores is None:
        return {}
    return {
        "members_mean": member_scores.mean(0),
        "members_std": member_scores.std(0, unbiased=False),
        "members_min": member_scores.min(0).values,
    }
