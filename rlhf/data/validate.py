"""Validation: every would-be pair is kept or dropped for one named reason, and the reasons are counted.

Drop reasons (a row is counted once, under the first problem found; structure is read first, then the texts,
then lengths, then duplicates among the rows that passed everything else):

- ``malformed``: structure that cannot be read (a message list without roles or not ending with the assistant
  turn, chosen and rejected answering different conversations, an implicit transcript pair whose common prefix
  has no assistant marker, a ranked row whose scores do not match its responses);
- ``not_finite``: a score or margin (``score_chosen``/``score_rejected``, ``margin``, a ranked row's ``scores`` or
  ``ranks``) that is NaN or infinite;
- ``missing``: a prompt, chosen or rejected (or message content) that is missing, empty or only whitespace;
- ``not_string``: content that is not a string (a number, a list where text belongs);
- ``tie``: a ranked response scored the same as the best one (no preference to learn);
- ``identical``: chosen and rejected are the same text;
- ``too_long``: prompt + chosen or prompt + rejected is longer than ``data.max_length_tokens`` (tokens of
  ``data.tokenizer``, prompt and response tokenized separately without special tokens, as the stages encode them;
  batched) or ``data.max_length_chars``;
- ``duplicate``: the same (prompt, chosen, rejected) as an earlier kept pair (the first is kept; an eval row
  that repeats a training pair counts too).

Validation runs as a batched ``datasets.Dataset.map`` (``num_proc`` processes) writing Arrow to a scratch
folder in the system temp dir, so texts are only held a batch at a time; duplicates are found from 8-byte
content keys (about 50 bytes of index arrays per row in all).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlhf.data import formats
from rlhf.data.formats import IDENTICAL, MALFORMED, MISSING, NOT_FINITE, NOT_STRING, TIE, ChatRenderer, Plan
from rlhf.errors import DataError
from rlhf.rollout.tokens import token_counts

TOO_LONG, DUPLICATE = "too_long", "duplicate"
REASONS = (MALFORMED, NOT_FINITE, MISSING, NOT_STRING, TIE, IDENTICAL, TOO_LONG, DUPLICATE)
REASON_TEXT = {
    MALFORMED: "a structure that cannot be read",
    NOT_FINITE: "a score or margin that is NaN or infinite",
    MISSING: "a missing or empty field",
    NOT_STRING: "non-string content",
    TIE: "a response tied with the best one",
    IDENTICAL: "identical chosen and rejected",
    TOO_LONG: "a length over the configured limit",
    DUPLICATE: "an exact duplicate of an earlier pair",
}


class Limits(NamedTuple):
    """Length limits of prompt + response; None disables one."""

    max_tokens: int | None = None
    max_chars: int | None = None


class Checked(NamedTuple):
    """One validated source split: Arrow columns prompt, chosen, rejected, margin, row, reason, key, prompt_key,
    prompt_len, chosen_len, rejected_len (prompt_len only for a prompt source)."""

    table: pa.Table
    label: str


class Outcome(NamedTuple):
    """What validation kept (positions into each Checked table, in order) and what it dropped."""

    kept: list[np.ndarray]
    n_in: int
    dropped: dict[str, int]
    examples: dict[str, str]  # reason -> "row 12 of <source>"


def content_key(*texts: str) -> int:
    """8-byte content key of some texts (signed, to fit Arrow int64)."""
    digest = hashlib.blake2b("\x00".join(texts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def token_lengths(tokenizer: Any, texts: list[str]) -> list[int]:
    """Token counts of a batch of texts (one batched tokenizer call), special tokens included as encoded by default."""
    return token_counts(tokenizer, texts, add_special_tokens=True)


def text_lengths(texts: list[str], tokenizer: Any) -> list[int]:
    """Lengths of texts in tokens (without special tokens, as the stages encode a prompt or a response; repeated
    texts are tokenized once) or, without a tokenizer, in characters."""
    if tokenizer is None:
        return [len(t) for t in texts]
    distinct = list(dict.fromkeys(texts))
    counts = dict(zip(distinct, token_counts(tokenizer, distinct), strict=True))
    return [counts[t] for t in texts]


def _measure(cands: list[formats.Candidate], ok: list[int], tokenizer: Any) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) lengths of the candidates at positions `ok`: one batched tokenizer call."""
    texts = [cands[i].prompt for i in ok] + [cands[i].chosen for i in ok] + [cands[i].rejected for i in ok]
    lengths, n = text_lengths(texts, tokenizer), len(ok)
    return list(zip(lengths[:n], lengths[n : 2 * n], lengths[2 * n :], strict=True))


def _too_long(
    cands: list[formats.Candidate], ok: list[int], lengths: list[tuple[int, int, int]], limits: Limits, tokenizer: Any
) -> set[int]:
    long: set[int] = set()
    if limits.max_chars is not None:
        long |= {
            i for i in ok if len(cands[i].prompt) + max(len(cands[i].chosen), len(cands[i].rejected)) > limits.max_chars
        }
    if limits.max_tokens is not None and tokenizer is not None:
        long |= {i for i, (p, c, r) in zip(ok, lengths, strict=True) if p + max(c, r) > limits.max_tokens}
    return long


def validate_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    plan: Plan,
    chat: ChatRenderer,
    markers: formats.Markers,
    limits: Limits,
    tokenizer: Any = None,
) -> dict[str, list]:
    """``Dataset.map`` function: the batch's would-be pairs with their drop reason ('' when kept) and the lengths
    of the kept ones (prompt_len, chosen_len, rejected_len: tokens of `tokenizer`, else characters)."""
    cands = formats.candidates(batch, indices, plan, chat, markers)
    reasons: list[str | None] = []
    for c in cands:
        reason = c.reason or next(filter(None, map(formats.text_problem, (c.prompt, c.chosen, c.rejected))), None)
        reasons.append(reason or (IDENTICAL if c.chosen == c.rejected else None))
    ok = [i for i, r in enumerate(reasons) if r is None]
    measured = _measure(cands, ok, tokenizer)
    for i in _too_long(cands, ok, measured, limits, tokenizer):
        reasons[i] = TOO_LONG
    lengths = dict(zip(ok, measured, strict=True))
    out: dict[str, list] = {k: [] for k in ("prompt", "chosen", "rejected", "margin", "row", "reason", "key")}
    out |= {k: [] for k in ("prompt_key", "prompt_len", "chosen_len", "rejected_len")}
    for i, (c, reason) in enumerate(zip(cands, reasons, strict=True)):
        keep = reason is None
        out["prompt"].append(c.prompt if keep else None)
        out["chosen"].append(c.chosen if keep else None)
        out["rejected"].append(c.rejected if keep else None)
        out["margin"].append(c.margin if keep else None)
        out["row"].append(c.row)
        out["reason"].append(reason or "")
        out["key"].append(content_key(c.prompt, c.chosen, c.rejected) if keep else 0)
        out["prompt_key"].append(content_key(c.prompt) if keep else 0)
        p, ch, r = lengths[i] if keep else (0, 0, 0)
        out["prompt_len"].append(p)
        out["chosen_len"].append(ch)
        out["rejected_len"].append(r)
    return out


def validate_prompts(
    batch: dict[str, list],
    indices: list[int],
    *,
    column: str,
    chat: ChatRenderer,
    fmt: str = "explicit",
    markers: formats.Markers = formats.Markers("\n\nHuman:", "\n\nAssistant:"),
    tokenizer: Any = None,
) -> dict[str, list]:
    """``Dataset.map`` function for a prompt-only source: message lists rendered as prompts, or strings rendered
    the way the pairs' prompts of format `fmt` are (see ``formats.prompt_text``); with their lengths."""
    out: dict[str, list] = {"prompt": [], "row": [], "reason": [], "key": [], "prompt_key": []}
    for value, row in zip(batch[column], indices, strict=True):
        reason = formats.message_problem(value) if isinstance(value, list) else formats.text_problem(value)
        text = value
        if reason is None:
            try:
                text = chat.prompt(value) if isinstance(value, list) else formats.prompt_text(value, fmt, chat, markers)
            except Exception:  # noqa: BLE001 (a chat template that refuses the messages)
                text = None
            reason = None if text is not None else MALFORMED
        out["prompt"].append(text if reason is None else None)
        out["row"].append(row)
        out["reason"].append(reason or "")
        out["key"].append(content_key(text) if reason is None else 0)
        out["prompt_key"].append(out["key"][-1])
    kept = [t for t in out["prompt"] if t is not None]
    lengths = iter(text_lengths(kept, tokenizer))
    out["prompt_len"] = [next(lengths) if t is not None else 0 for t in out["prompt"]]
    return out


def tally(checked: list[Checked]) -> Outcome:
    """Count drops per reason (with a first example row each) and drop duplicates across the splits in order."""
    dropped = dict.fromkeys(REASONS, 0)
    examples: dict[str, str] = {}
    kept, keys = [], []
    for table, label in checked:
        reason = table.column("reason")
        for item in pc.value_counts(reason).to_pylist():
            if item["values"]:
                dropped[item["values"]] = dropped.get(item["values"], 0) + item["counts"]
                if item["values"] not in examples:
                    first = pc.index(reason, item["values"]).as_py()
                    examples[item["values"]] = f"row {table.column('row')[first].as_py()} of {label}"
        ok = np.flatnonzero(pc.equal(reason, "").to_numpy(zero_copy_only=False))
        kept.append(ok)
        keys.append(table.column("key").to_numpy()[ok])
    all_keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
    first_seen = np.zeros(len(all_keys), bool)
    first_seen[np.unique(all_keys, return_index=True)[1]] = True
    offset = 0
    for i, (table, label) in enumerate(checked):
        mine = first_seen[offset : offset + len(kept[i])]
        offset += len(kept[i])
        if not mine.all() and DUPLICATE not in examples:
            examples[DUPLICATE] = f"row {table.column('row')[int(kept[i][~mine][0])].as_py()} of {label}"
        dropped[DUPLICATE] += int((~mine).sum())
        kept[i] = kept[i][mine]
    return Outcome(kept, sum(len(t.table) for t in checked), dropped, examples)


def check_drops(outcome: Outcome, max_fraction: float, label: str) -> None:
    """Stop with one sentence when nothing remains or too much was dropped, naming the dominant reason."""
    total = sum(outcome.dropped.values())
    if not total:
        if outcome.n_in == 0:
            raise DataError(f"{label} has no rows")
        return
    top = max(outcome.dropped, key=outcome.dropped.__getitem__)
    why = f"mostly {top}: {REASON_TEXT.get(top, top)} ({outcome.dropped[top]} rows, e.g. {outcome.examples.get(top)})"
    if sum(len(k) for k in outcome.kept) == 0:
        raise DataError(f"{label}: no usable preference pairs, all {outcome.n_in} were dropped, {why}")
    if total > max_fraction * outcome.n_in:
        raise DataError(
            f"{label}: {total} of {outcome.n_in} pairs ({total / outcome.n_in:.0%}) were dropped, more than "
            f"data.max_drop_fraction ({max_fraction}), {why}"
        )
