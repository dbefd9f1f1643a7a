"""Preference layouts: detect which one a source uses and turn its rows into (prompt, chosen, rejected) pairs.

Formats (``data.format``; 'auto' detects them in this order, after ``data.columns`` renamed the source's columns
to these roles):

- ``ranked``: ``prompt``, ``responses`` (list of str) and ``scores`` (higher is better) or ``ranks`` (1 is
  best). Each row becomes best-vs-each-other pairs (n-1 pairs for n responses); margin = score difference
  (null with ranks); a response tied with the best is not a preference and is dropped as ``tie``.
- ``conversational``: ``chosen`` / ``rejected`` are lists of ``{role, content}`` messages ending with the
  assistant turn (UltraFeedback-binarized, where both include the user turn; or TRL's layout with a separate
  ``prompt`` message list). The messages before the last one are the prompt; it is rendered with the chat
  template of ``data.tokenizer`` when that tokenizer has one, else with the plain template below.
- ``explicit``: ``prompt``, ``chosen``, ``rejected`` strings.
- ``implicit``: ``chosen``, ``rejected`` full transcripts without a prompt column (Anthropic HH-RLHF). The prompt
  is their longest common prefix cut after its last ``data.assistant_marker`` ("\\n\\nAssistant:"); the
  responses are what follows the prompt. The text is used as it is, unless ``data.tokenizer`` has a chat template:
  then the prompt is split into turns at ``data.user_marker`` ("\\n\\nHuman:") and the assistant marker, and
  prompt and responses are rendered with the template like conversational rows (a transcript that does not split
  into turns, or a response that goes on with another turn, is ``malformed``).

Plain chat template (no tokenizer, or one without a chat template): each message is ``"\\n\\n<Role>: <content>"``
with the role capitalised ("\\n\\nUser: hi"), and the prompt ends with the generation marker
``"\\n\\nAssistant:"``; a response is ``" " + content``. So ``[user: hi, assistant: hello]`` gives prompt
``"\\n\\nUser: hi\\n\\nAssistant:"`` and response ``" hello"``, the same shape as HH-RLHF.

Scores: ``score_chosen`` / ``score_rejected`` (or the aliases in ``SCORE_ALIASES``) give margin =
score_chosen - score_rejected; a ``margin`` column is used as is; otherwise margin is null. A score or margin that is
NaN or infinite (JSON's ``NaN``, ``Infinity``; a float column's NaN) makes the row ``not_finite``: dropped and counted,
since it would make the reward model's loss NaN or infinite from the first step. A null one is no margin.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, NamedTuple

from rlhf.errors import DataError

FORMATS = ("explicit", "implicit", "conversational", "ranked")
SCORE_ALIASES = (
    ("score_chosen", "score_rejected"),
    ("chosen_score", "rejected_score"),
    ("chosen_rating", "rejected_rating"),
    ("chosen-rating", "rejected-rating"),
)
REQUIRED = {
    "explicit": ("prompt", "chosen", "rejected"),
    "implicit": ("chosen", "rejected"),
    "conversational": ("chosen", "rejected"),
    "ranked": ("prompt", "responses"),
}

# Drop reasons a normaliser can give (validate.py adds too_long and duplicate, and finds identical pairs).
MISSING, NOT_STRING, MALFORMED, TIE, IDENTICAL = "missing", "not_string", "malformed", "tie", "identical"
NOT_FINITE = "not_finite"  # a score or margin that is NaN or infinite (it would make the reward loss NaN)


class Plan(NamedTuple):
    """How to read a source: its format and the source column of each role it uses."""

    format: str
    columns: dict[str, str]  # role -> source column


class Candidate(NamedTuple):
    """One would-be pair: raw values (validated later) or, when it already failed, the reason."""

    row: int
    prompt: Any
    chosen: Any
    rejected: Any
    margin: float | None
    reason: str | None = None


def plan_columns(names: list[str], sample: dict[str, list], fmt: str, mapping: dict[str, str], label: str) -> Plan:
    """Resolve roles to columns and pick the format; one DataError sentence when that is impossible."""
    for role, column in mapping.items():
        if column not in names:
            raise DataError(f"data.columns.{role}: column '{column}' is not in {label} (found: {', '.join(names)})")
    mapped = set(mapping.values())
    columns = dict(mapping)
    for role in ("prompt", "chosen", "rejected", "margin", "responses", "scores", "ranks"):
        if role not in columns and role in names and role not in mapped:
            columns[role] = role
    if "score_chosen" not in columns and "score_rejected" not in columns:
        for good, bad in SCORE_ALIASES:
            if good in names and bad in names:
                columns["score_chosen"], columns["score_rejected"] = good, bad
                break
    if fmt == "auto":
        fmt = _detect(columns, sample, names, label)
    missing = [repr(role) for role in REQUIRED[fmt] if role not in columns]
    if fmt == "ranked" and "scores" not in columns and "ranks" not in columns:
        missing.append("'scores' or 'ranks'")
    if missing:
        raise DataError(
            f"{label} has no column {', '.join(missing)} for the {fmt} format "
            f"(found: {', '.join(names)}; map yours with data.columns)"
        )
    return Plan(fmt, columns)


def _detect(columns: dict[str, str], sample: dict[str, list], names: list[str], label: str) -> str:
    if "responses" in columns and ("scores" in columns or "ranks" in columns):
        return "ranked"
    if "chosen" in columns or "rejected" in columns:
        values = [v for role in ("chosen", "rejected") if role in columns for v in sample.get(columns[role], [])]
        first = next((v for v in values if v is not None), None)
        if isinstance(first, list):
            return "conversational"
        return "explicit" if "prompt" in columns else "implicit"
    raise DataError(
        f"{label} has no recognisable preference format (found columns: {', '.join(names)}); expected "
        "prompt/chosen/rejected, chosen/rejected transcripts or message lists, or prompt/responses/scores "
        "(map yours with data.columns)"
    )


def _number(value: Any) -> float | None:
    """A score as a float (NaN and infinities included: `_margin` and `_ranked` refuse them), None when the value is
    missing or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


class Margin(NamedTuple):
    """A row's margin (None: none) and whether a score or margin it was read from is NaN or infinite."""

    value: float | None
    not_finite: bool = False


def _margin(batch: dict[str, list], plan: Plan, i: int) -> Margin:
    cols = plan.columns
    if "score_chosen" in cols and "score_rejected" in cols:
        good, bad = _number(batch[cols["score_chosen"]][i]), _number(batch[cols["score_rejected"]][i])
        if any(v is not None and not math.isfinite(v) for v in (good, bad)):
            return Margin(None, True)
        return Margin(None if good is None or bad is None else good - bad)
    if "margin" in cols:
        value = _number(batch[cols["margin"]][i])
        return Margin(None, True) if value is not None and not math.isfinite(value) else Margin(value)
    return Margin(None)


def text_problem(value: Any) -> str | None:
    """Why a value is not usable text: missing (None or blank), not_string, or None when it is fine."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return MISSING
    return None if isinstance(value, str) else NOT_STRING


class ChatRenderer:
    """Renders message lists: the tokenizer's chat template when it has one, else the plain template above."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer if getattr(tokenizer, "chat_template", None) else None

    @property
    def templated(self) -> bool:
        """Whether message lists are rendered with a tokenizer's chat template (not the plain template)."""
        return self.tokenizer is not None

    def pair(self, context: list[dict], chosen: dict, rejected: dict) -> tuple[str, str, str] | None:
        """(prompt, chosen, rejected) texts of a conversation and its two answers; None when the chat template
        refuses the conversation (some templates raise on roles that do not alternate)."""
        try:
            text = self.prompt(context)
            return text, self.response(context, text, chosen), self.response(context, text, rejected)
        except Exception:  # noqa: BLE001 (a template error is a malformed row, not a crash)
            return None

    def prompt(self, messages: list[dict]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return "".join(f"\n\n{m['role'].capitalize()}: {m['content']}" for m in messages) + "\n\nAssistant:"

    def response(self, messages: list[dict], prompt: str, final: dict) -> str:
        if self.tokenizer is not None:
            full = self.tokenizer.apply_chat_template([*messages, final], tokenize=False)
            if full.startswith(prompt):  # the response keeps the template's end-of-turn text
                return full[len(prompt) :]
        return " " + final["content"]


def message_problem(messages: Any) -> str | None:
    """Why a message list is not usable (missing / not_string / malformed), or None."""
    if messages is None or (isinstance(messages, list) and not messages):
        return MISSING
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        return MALFORMED
    for m in messages:
        problem = text_problem(m.get("content"))
        if problem:
            return problem
    return None


def _conversational(row: int, prompt: Any, chosen: Any, rejected: Any, margin: float | None, chat: ChatRenderer):
    for value in (chosen, rejected):
        problem = message_problem(value)
        if problem:
            return Candidate(row, None, None, None, None, problem)
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        return Candidate(row, None, None, None, None, MALFORMED)
    context = chosen[:-1]
    if isinstance(prompt, list):
        problem = message_problem(prompt)
        if problem:
            return Candidate(row, None, None, None, None, problem)
        context = [*prompt, *context]
    elif isinstance(prompt, str) and prompt.strip() and not context:
        context = [{"role": "user", "content": prompt}]
    if not context:
        return Candidate(row, None, None, None, None, MISSING)
    if chosen[:-1] != rejected[:-1]:
        return Candidate(row, None, None, None, None, MALFORMED)  # the two sides answer different conversations
    texts = chat.pair(context, chosen[-1], rejected[-1])
    if texts is None:
        return Candidate(row, None, None, None, None, MALFORMED)
    return Candidate(row, *texts, margin)


class Markers(NamedTuple):
    """Turn markers of implicit transcripts ("\\n\\nHuman:", "\\n\\nAssistant:" in HH-RLHF)."""

    user: str
    assistant: str


def transcript_messages(text: str, markers: Markers) -> list[dict] | None:
    """A transcript ``"\\n\\nHuman: hi\\n\\nAssistant: hello"`` as messages (contents stripped); a final empty
    assistant turn (the prompt's generation slot) is left out. None when the text does not start with a marker."""
    pattern = "(" + "|".join(re.escape(m) for m in sorted(set(markers), key=len, reverse=True)) + ")"
    parts = re.split(pattern, text)
    if parts[0].strip() or len(parts) < 3:
        return None
    roles = {markers.user: "user", markers.assistant: "assistant"}
    messages = [{"role": roles[m], "content": c.strip()} for m, c in zip(parts[1::2], parts[2::2], strict=True)]
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
        messages.pop()
    return messages


def _implicit(
    row: int, chosen: Any, rejected: Any, margin: float | None, markers: Markers, chat: ChatRenderer
) -> Candidate:
    problem = text_problem(chosen) or text_problem(rejected) or (IDENTICAL if chosen == rejected else None)
    if problem:
        return Candidate(row, None, None, None, None, problem)
    marker = markers.assistant
    cut = os.path.commonprefix([chosen, rejected]).rfind(marker)
    if cut < 0:
        return Candidate(row, None, None, None, None, MALFORMED)
    cut += len(marker)
    if not chat.templated:
        return Candidate(row, chosen[:cut], chosen[cut:], rejected[cut:], margin)
    # with a chat template: the prompt's turns and each response as one assistant message, rendered
    context = transcript_messages(chosen[:cut], markers)
    answers = [chosen[cut:], rejected[cut:]]
    if not context or any(m in a for a in answers for m in markers):
        return Candidate(row, None, None, None, None, MALFORMED)  # no turns, or a response that goes on
    problem = message_problem(context) or next(filter(None, map(text_problem, answers)), None)
    if problem:
        return Candidate(row, None, None, None, None, problem)
    texts = chat.pair(context, *({"role": "assistant", "content": a.strip()} for a in answers))
    if texts is None:
        return Candidate(row, None, None, None, None, MALFORMED)
    return Candidate(row, *texts, margin)


def prompt_text(value: str, fmt: str, chat: ChatRenderer, markers: Markers) -> str | None:
    """A prompt string of a separate prompt source, rendered the way the pairs' prompts are: a user turn of a
    conversational data set, a transcript of an implicit one when a chat template renders it (None: it does not
    split into turns); as it is otherwise."""
    if fmt == "conversational":
        return chat.prompt([{"role": "user", "content": value}])
    if fmt == "implicit" and chat.templated:
        messages = transcript_messages(value, markers)
        return chat.prompt(messages) if messages and not message_problem(messages) else None
    return value


def _ranked(row: int, prompt: Any, responses: Any, scores: Any, ranks: Any) -> list[Candidate]:
    if not responses:
        return [Candidate(row, None, None, None, None, MISSING)]
    values = scores if scores is not None else ranks
    if not isinstance(responses, list) or not isinstance(values, list) or len(values) != len(responses):
        return [Candidate(row, None, None, None, None, MALFORMED)]
    numbers = [_number(v) for v in values]
    if any(v is None for v in numbers):
        return [Candidate(row, None, None, None, None, MALFORMED)]
    if not all(math.isfinite(v) for v in numbers):
        return [Candidate(row, None, None, None, None, NOT_FINITE)]
    goodness = numbers if scores is not None else [-v for v in numbers]
    best = max(range(len(responses)), key=goodness.__getitem__)
    out = []
    for i, response in enumerate(responses):
        if i == best:
            continue
        margin = goodness[best] - goodness[i] if scores is not None else None
        reason = TIE if goodness[i] == goodness[best] else None
        out.append(Candidate(row, prompt, responses[best], response, margin, reason))
    return out


def candidates(
    batch: dict[str, list], rows: list[int], plan: Plan, chat: ChatRenderer, markers: Markers
) -> list[Candidate]:
    """The would-be pairs of one batch of source rows (ranked rows give several)."""
    cols = plan.columns

    def get(role: str, i: int) -> Any:
        return batch[cols[role]][i] if role in cols else None

    out: list[Candidate] = []
    for i, row in enumerate(rows):
        if plan.format == "ranked":
            out += _ranked(row, get("prompt", i), get("responses", i), get("scores", i), get("ranks", i))
            continue
        margin = _margin(batch, plan, i)
        if plan.format == "conversational":
            pair = _conversational(row, get("prompt", i), get("chosen", i), get("rejected", i), margin.value, chat)
        elif plan.format == "implicit":
            pair = _implicit(row, get("chosen", i), get("rejected", i), margin.value, markers, chat)
        else:
            pair = Candidate(row, get("prompt", i), get("chosen", i), get("rejected", i), margin.value)
        out.append(pair._replace(reason=NOT_FINITE) if margin.not_finite and pair.reason is None else pair)
    return out
