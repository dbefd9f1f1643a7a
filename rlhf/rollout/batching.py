"""Turning text into padded tensors (one convention for every stage).

Prompt + response sequences are right-padded: ``[bos | prompt | response | eos | pad ...]``; a prompt batch for
generation is left-padded so that every row's next token is appended at the same position. Every prompt is encoded
by `encode_prompts`: it starts with the tokenizer's BOS when the tokenizer adds one (Llama, Mistral, Gemma, OPT),
as the model saw its texts in training; the BOS is absent for tokenizers without one (GPT-2, Qwen, Pythia). A row
longer than its budget keeps the BOS, the end of its prompt and the start of its response (`fit_lengths`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf.rollout.tokens import token_counts


class TokenBatch(NamedTuple):
    input_ids: Tensor  # (b, t)
    attention_mask: Tensor  # (b, t)
    loss_mask: Tensor  # (b, t): 1 on response tokens (and the closing eos)


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of texts as they are, with no special tokens added."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def bos_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """``[bos]`` when the tokenizer puts its BOS at the start of a text it encodes, else ``[]``."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    added = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return [bos] if added[:1] == [bos] and plain[:1] != [bos] else []


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_tokens: int | None = None
) -> list[list[int]]:
    """Token ids of prompts, each starting with the tokenizer's BOS once when it adds one (a prompt rendered by a
    chat template that wrote the BOS text already has it), left-truncated to `max_tokens` with the BOS kept. (PPO
    and evaluation fit their prompts with `rlhf.rollout.prompt_fit.fit_prompts`, which cuts a chat prompt by turns.)"""
    prefix = bos_prefix(tokenizer)
    rows = [prefix + _without(ids, prefix) for ids in encode_texts(tokenizer, prompts)]
    return rows if max_tokens is None else [keep_last(row, len(prefix), max_tokens) for row in rows]


def _without(ids: list[int], prefix: list[int]) -> list[int]:
    """`ids` without `prefix` when they start with it (a BOS the chat template wrote)."""
    return ids[len(prefix) :] if prefix and ids[: len(prefix)] == prefix else ids


def keep_last(ids: list[int], n_prefix: int, max_tokens: int) -> list[int]:
    """The first `n_prefix` ids (the BOS) and the last ones of the rest, `max_tokens` in all (left truncation)."""
    body = ids[n_prefix:]
    return ids[:n_prefix] + body[max(0, len(body) - max(0, max_tokens - n_prefix)) :]


def pad_right(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


class Fit(NamedTuple):
    """How much of a prompt and a response fits in a length budget."""

    prompt: int  # tokens kept from the prompt's end
    response: int  # tokens kept from the response's start (its EOS included when one is added)


def fit_lengths(prompt_len: int, response_len: int, max_length: int, min_prompt_tokens: int = 0) -> Fit:
    """Tokens of a prompt (kept from its end: left truncation) and of a response (kept from its start: right
    truncation) that fit in `max_length`.

    The response keeps its tokens first, except that at least `min_prompt_tokens` of the prompt survive (all of it
    when it is shorter; never more than ``max_length - 1``, so that one response token fits): with
    ``min_prompt_tokens`` 0 a long response can leave no prompt at all, with 1 or more a non-empty prompt never
    vanishes. `response_len` counts the EOS the caller appends.
    """
    if prompt_len + response_len <= max_length:
        return Fit(prompt_len, response_len)
    floor = min(prompt_len, min_prompt_tokens, max_length - 1)
    prompt = min(prompt_len, max(floor, max_length - response_len))
    return Fit(prompt, min(response_len, max_length - prompt))


class Truncation(NamedTuple):
    """What fitting a batch of (prompt, response) rows into a length cut: row counts."""

    rows: int
    truncated: int  # rows that lost any token
    prompt_truncated: int  # rows whose prompt lost tokens
    response_truncated: int  # rows whose response (or its EOS) lost tokens
    prompt_lost: int  # rows whose non-empty prompt lost every token


def pair_lengths(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], chosen: list[str], rejected: list[str], add_eos: bool = True
) -> np.ndarray:
    """Tokens of each pair's longer sequence, prompt + the longer response (+ EOS), exactly as
    `encode_prompt_response` lays them out. Shape: (n,)."""
    n = len(prompts)
    counts = np.asarray(token_counts(tokenizer, [*prompts, *chosen, *rejected]), dtype=np.int64)
    return counts[:n] + np.maximum(counts[n : 2 * n], counts[2 * n :]) + int(add_eos) + len(bos_prefix(tokenizer))


def encode_and_measure(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    responses: list[str],
    max_length: int,
    add_eos: bool | Sequence[bool] = True,
    min_prompt_tokens: int = 0,
) -> tuple[TokenBatch, Truncation]:
    """Right-padded prompt + response (+ eos) rows fitted into `max_length` by `fit_lengths`, and what that cut.
    `add_eos` per row: False where a response did not end (cut at a sampling limit), so none is taught to stop."""
    ends = [add_eos] * len(prompts) if isinstance(add_eos, bool) else list(add_eos)
    prefix = bos_prefix(tokenizer)
    prompt_ids = [_without(ids, prefix) for ids in encode_texts(tokenizer, prompts)]  # the BOS goes back below
    response_ids = encode_texts(tokenizer, responses)
    rows, response_spans = [], []
    cut = np.zeros((4, len(prompts)), dtype=bool)  # any, prompt, response, prompt lost
    for i, (p, r, end) in enumerate(zip(prompt_ids, response_ids, ends, strict=True)):
        r = r + [tokenizer.eos_token_id] if end else r
        fit = fit_lengths(len(p), len(r), max_length - len(prefix), min_prompt_tokens)
        cut[1, i], cut[2, i] = fit.prompt < len(p), fit.response < len(r)
        cut[3, i] = fit.prompt == 0 and len(p) > 0
        p, r = prefix + p[len(p) - fit.prompt :], r[: fit.response]
        rows.append(p + r)
        response_spans.append((len(p), len(p) + len(r)))
    cut[0] = cut[1] | cut[2]
    ids, mask = pad_right(rows, tokenizer.pad_token_id)
    loss_mask = torch.zeros_like(mask)
    for i, (start, end) in enumerate(response_spans):
        loss_mask[i, start:end] = 1
    return TokenBatch(ids, mask, loss_mask), Truncation(len(rows), *(int(c.sum()) for c in cut))


def encode_prompt_response(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    responses: list[str],
    max_length: int,
    add_eos: bool = True,
    min_prompt_tokens: int = 0,
) -> TokenBatch:
    """Right-padded (bos+)prompt+response(+eos) rows of at most `max_length` tokens: the prompt is left-truncated
    (its BOS kept) and the response right-truncated as `fit_lengths` says (the response first, but
    `min_prompt_tokens` of the prompt survive)."""
    return encode_and_measure(tokenizer, prompts, responses, max_length, add_eos, min_prompt_tokens)[0]
