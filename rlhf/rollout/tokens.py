"""Counting tokens in bulk, without importing torch (data preparation uses it too)."""

from __future__ import annotations

from typing import Any


def token_counts(tokenizer: Any, texts: list[str], add_special_tokens: bool = False) -> list[int]:
    """Token counts of a batch of texts, as ``tokenizer(texts, add_special_tokens=...)`` gives them (one batched call).

    A fast tokenizer without saved truncation or padding is called through its Rust backend's
    ``encode_batch_fast``, which skips computing the offsets that counting does not need; the counts are the same.
    """
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is not None and backend.truncation is None and backend.padding is None:
        return [len(encoding) for encoding in fast(texts, add_special_tokens=add_special_tokens)]
    ids = tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False, verbose=False)
    return [len(x) for x in ids["input_ids"]]
