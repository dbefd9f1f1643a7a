"""Fitting prompts into a token budget (``ppo.max_prompt_tokens``) without cutting off a chat template's head.

A plain prompt keeps its last tokens, its BOS kept in front (`rlhf.rollout.batching.keep_last`). A chat prompt, one
rendered with the tokenizer's chat template, is cut by turns instead: left truncation would remove the system
prompt and the first ``<|im_start|>user`` header, and the policy would see a prompt that starts mid-sentence outside
its template. Its **head** (everything up to the end of the first user header: the template's start, the system
prompt, the header) stays, and so do its **last turns**: the oldest turns after the head are dropped whole, as few as
make it fit. When even the last user turn does not fit with the head, the head is followed by the last tokens of
that turn (cut inside it). Either way the prompt starts as the template starts and ends with its generation prompt.

Where the user header is, is found from the template itself (`chat_layout`: probe conversations rendered with it).
A prompt the header is not found in (plain text, or another model's template), or whose head would take more than
half of the budget, is left-truncated as a plain prompt.

    <|im_start|>system ... <|im_end|>\\n<|im_start|>user\\n | Q1<|im_end|>...<|im_start|>user\\n | Q2<|im_end|> ...
    `------------------------ head ------------------------'  `-- dropped turns --' `-- kept turns ... --'
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from rlhf.rollout.batching import bos_prefix, encode_prompts, encode_texts, keep_last
from rlhf.rollout.generation import special_token_ids
from rlhf.rollout.tokens import token_counts

# contents of the probe conversations: plain letters and digits, which no template rewrites and no text contains
PROBES = ("Zq7Probe1", "Zq7Probe2", "Zq7Probe3")


class ChatLayout(NamedTuple):
    """Where a chat template's user turns start."""

    user_header: str  # the text right before a user message's content (e.g. "<|im_end|>\n<|im_start|>user\n")


class FittedPrompts(NamedTuple):
    ids: list[list[int]]  # each prompt's token ids (a BOS first where the tokenizer adds one), at most the budget
    truncated: int  # prompts that were longer than the budget
    head_kept: int  # of those, chat prompts cut by turns with their template's head kept


def chat_layout(tokenizer: PreTrainedTokenizerBase) -> ChatLayout | None:
    """The user header of the tokenizer's chat template: the longest text that both ends the template's head (what
    precedes the first user message) and precedes a later user message. None without a template, or when the probes
    do not render (a template that refuses them) or share no such text."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    first, answer, second = PROBES
    user, assistant = ({"role": "user", "content": first}, {"role": "assistant", "content": answer})
    try:
        one = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        three = tokenizer.apply_chat_template(
            [user, assistant, {"role": "user", "content": second}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 (a template that raises on the probes: the plain cut)
        return None
    if not isinstance(one, str) or not isinstance(three, str) or first not in one:
        return None
    if not all(probe in three for probe in PROBES):
        return None
    head = one[: one.index(first)]
    between = three[three.index(answer) + len(answer) : three.index(second)]
    header = os.path.commonprefix([head[::-1], between[::-1]])[::-1]
    # the common text can start inside a special token ("|><|start_header_id|>..." after "<|begin_of_text|>" and
    # "<|eot_id|>"): it then starts at the first whole special token in it
    starts = [header.find(token) for token in _special_texts(tokenizer) if token in header]
    header = header[min(starts) :] if starts else header
    return ChatLayout(header) if header.strip() else None


def _special_texts(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The texts of the tokenizer's special tokens (`<|im_start|>`, `<|eot_id|>` ...)."""
    tokens = tokenizer.convert_ids_to_tokens(sorted(special_token_ids(tokenizer)))
    return {token for token in tokens if isinstance(token, str) and token}


def fit_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_tokens: int) -> FittedPrompts:
    """Token ids of `prompts` (as `encode_prompts` gives them) fitted into `max_tokens`: chat prompts by turns
    with their template's head kept (`keep_turns`), any other prompt by its last tokens."""
    rows = encode_prompts(tokenizer, prompts)
    over = [i for i, row in enumerate(rows) if len(row) > max_tokens]
    layout = chat_layout(tokenizer) if over else None
    by_turns = keep_turns(tokenizer, [prompts[i] for i in over], max_tokens, layout) if layout else [None] * len(over)
    n_bos = len(bos_prefix(tokenizer))
    for i, kept in zip(over, by_turns, strict=True):
        rows[i] = kept if kept is not None else keep_last(rows[i], n_bos, max_tokens)
    return FittedPrompts(rows, len(over), sum(kept is not None for kept in by_turns))


class _Plan(NamedTuple):
    head: str  # the template's start up to the end of the first user header
    candidates: list[str]  # head + the prompt from a later user turn on: the oldest turns dropped, fewest first
    rest: str  # head + the prompt from the last user turn on (or after the head): what a cut inside keeps the end of


def keep_turns(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], max_tokens: int, layout: ChatLayout
) -> list[list[int] | None]:
    """Token ids of chat prompts longer than `max_tokens`, each its head and the most of its last turns that fit
    (see the module docstring); None for a text the user header is not found in or whose head takes more than half
    of `max_tokens` (the caller cuts those as plain prompts). Tokens are counted on the texts as they would be
    encoded (one batched call), and the kept text is encoded as a whole."""
    plans = [_plan(text, layout.user_header) for text in texts]
    heads = list(dict.fromkeys(plan.head for plan in plans if plan is not None))
    head_ids = dict(zip(heads, encode_prompts(tokenizer, heads), strict=True))
    # what encode_prompts adds to a text's own tokens: the BOS, unless the template wrote it (the head starts the
    # text, so every candidate of a prompt gets what its head gets)
    bos = {
        head: len(ids) - len(own)
        for (head, ids), own in zip(head_ids.items(), encode_texts(tokenizer, list(head_ids)), strict=True)
    }
    counts = iter(token_counts(tokenizer, [c for plan in plans if plan is not None for c in plan.candidates]))
    chosen: list[str | None] = []  # the kept text; "" where no whole turn fits; None: cut as a plain prompt
    for plan in plans:
        if plan is None:
            chosen.append(None)
            continue
        lengths = [next(counts) + bos[plan.head] for _ in plan.candidates]
        if 2 * len(head_ids[plan.head]) > max_tokens:
            chosen.append(None)
            continue
        chosen.append(next((c for c, n in zip(plan.candidates, lengths, strict=True) if n <= max_tokens), ""))
    fits = [c for c in chosen if c]
    encoded = dict(zip(fits, encode_prompts(tokenizer, fits), strict=True))
    cut = [plan.rest for plan, c in zip(plans, chosen, strict=True) if c == ""]
    cut_ids = dict(zip(cut, encode_prompts(tokenizer, cut), strict=True))
    out: list[list[int] | None] = []
    for plan, c in zip(plans, chosen, strict=True):
        if c is None:
            out.append(None)
        elif c:
            out.append(encoded[c])
        else:  # even the last user turn is too long: the head, then that turn's last tokens
            head, ids = head_ids[plan.head], cut_ids[plan.rest]
            room = max_tokens - len(head)  # at least half the budget
            out.append(head + ids[len(head) :][-room:] if ids[: len(head)] == head else None)
    return out


def _plan(text: str, header: str) -> _Plan | None:
    """How a chat prompt can be cut: None when the user header is not in it."""
    first = text.find(header)
    if first < 0:
        return None
    split = first + len(header)
    head = text[:split]
    starts = [split + m.end() for m in re.finditer(re.escape(header), text[split:])]
    candidates = [head + text[start:] for start in starts]
    return _Plan(head, candidates, candidates[-1] if candidates else text)
