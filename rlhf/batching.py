"""Turning text into padded tensors (one convention for every stage).

Prompt + response sequences are right-padded: ``[bos | prompt | response | eos | pad ...]``; a prompt batch for
generation is left-padded so that every row's next token is appended at the same position. Every prompt is encoded
by `encode_prompts`: it starts with the tokenizer's BOS when the tokenizer adds one (Llama, Mistral, Gemma, OPT),
as the model saw its texts in training; the BOS is absent for tokenizers without one (GPT-2, Qwen, Pythia).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase


class TokenBatch(NamedTuple):
    input_ids: Tensor  # (b, t)
    attention_mask: Tensor  # (b, t)
    loss_mask: Tensor  # (b, t): 1 on response tokens (and the closing eos)


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of texts as they are, with no special tokens added."""
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


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
    chat template that wrote the BOS text already has it), left-truncated to `max_tokens` with the BOS kept."""
    prefix = bos_prefix(tokenizer)
    rows = [prefix + _without(ids, prefix) for ids in encode_texts(tokenizer, prompts)]
    return rows if max_tokens is None else [_keep_last(row, len(prefix), max_tokens) for row in rows]


def _without(ids: list[int], prefix: list[int]) -> list[int]:
    """`ids` without `prefix` when they start with it (a BOS the chat template wrote)."""
    return ids[len(prefix) :] if prefix and ids[: len(prefix)] == prefix else ids


def _keep_last(ids: list[int], n_prefix: int, max_tokens: int) -> list[int]:
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


def encode_prompt_response(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    responses: list[str],
    max_length: int,
    add_eos: bool = True,
) -> TokenBatch:
    """Right-padded (bos+)prompt+response(+eos); prompts are left-truncated (their BOS kept) so the response fits."""
    eos = [tokenizer.eos_token_id] if add_eos else []
    prefix = bos_prefix(tokenizer)
    prompt_ids = encode_prompts(tokenizer, prompts)
    response_ids = encode_texts(tokenizer, responses)
    rows, response_spans = [], []
    for p, r in zip(prompt_ids, response_ids, strict=True):
        r = (r + eos)[: max_length - len(prefix)]
        p = _keep_last(p, len(prefix), max_length - len(r))
        rows.append(p + r)
        response_spans.append((len(p), len(p) + len(r)))
    ids, mask = pad_right(rows, tokenizer.pad_token_id)
    loss_mask = torch.zeros_like(mask)
    for i, (start, end) in enumerate(response_spans):
        loss_mask[i, start:end] = 1
    return TokenBatch(ids, mask, loss_mask)
