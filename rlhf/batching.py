"""Turning text into padded tensors (one convention for every stage).

Prompt + response sequences are right-padded: ``[prompt | response | eos | pad ...]``; a prompt batch for
generation is left-padded so that every row's next token is appended at the same position.
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
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


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
    """Right-padded prompt+response(+eos); prompts are left-truncated so the response always fits."""
    eos = [tokenizer.eos_token_id] if add_eos else []
    prompt_ids = encode_texts(tokenizer, prompts)
    response_ids = encode_texts(tokenizer, responses)
    rows, response_spans = [], []
    for p, r in zip(prompt_ids, response_ids, strict=True):
        r = (r + eos)[:max_length]
        p = p[-(max_length - len(r)) :] if max_length > len(r) else []
        rows.append(p + r)
        response_spans.append((len(p), len(p) + len(r)))
    ids, mask = pad_right(rows, tokenizer.pad_token_id)
    loss_mask = torch.zeros_like(mask)
    for i, (start, end) in enumerate(response_spans):
        loss_mask[i, start:end] = 1
    return TokenBatch(ids, mask, loss_mask)
