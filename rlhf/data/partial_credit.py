"""Partial credit on IFEval's instructions: a graded reward for the instructions a policy never follows whole.

IFEval's checkers are pass/fail. An instruction a small model never follows in any of its samples (a whole answer
in lowercase, wrapped in quotes, starting with the request repeated) gives every sample of a group the same score:
no advantage, no gradient, however long it trains (the PPO stage's ``group/zero_std_fraction/<type>`` shows which).
``ifeval_partial`` scores an instruction 1 where IFEval's strict checker passes it, as ``ifeval_strict`` does, and
otherwise gives up to PARTIAL of credit for how far the response got toward it (the share of its letters in the
asked case, the opening and the closing quote, the share of a count reached, ...), so that a sample nearer to
following it scores higher than its group's others. A pass always scores more than any partial credit.

The evaluation keeps IFEval's strict and loose criteria (``rlhf.eval.benchmark``); partial credit only shapes the
training reward (``reward.function: rlhf.data.partial_credit:ifeval_partial``), as the field's graded rewards do.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rlhf.data import verifiers

PARTIAL = 0.5  # the most an instruction not followed can score


def _share(count: float, target: float) -> float:
    return min(count / target, 1.0) if target > 0 else 0.0


def _letters(text: str) -> list[str]:
    return [c for c in text if c.isalpha()]


def _case_share(text: str, upper: bool) -> float:
    letters = _letters(text)
    return sum(c.isupper() == upper for c in letters) / len(letters) if letters else 0.0


def _quotation(response: str, _: dict) -> float:
    text = response.strip()
    return (text.startswith('"') + text.endswith('"')) / 2


def _repeat_prompt(response: str, kw: dict) -> float:
    """The share of the request repeated, word for word, from the start."""
    asked = kw.get("prompt_to_repeat", "").lower().split()
    given = response.lower().split()
    same = next((i for i, (a, b) in enumerate(zip(asked, given, strict=False)) if a != b), min(len(asked), len(given)))
    return _share(same, len(asked))


def _paragraphs(response: str, kw: dict) -> float:
    """How near the count of *** -separated paragraphs is to the one asked."""
    count = len([p for p in re.split(r"\s?\*\*\*\s?", response) if p.strip()])
    asked = kw.get("num_paragraphs", 1)
    return max(0.0, 1 - abs(count - asked) / asked)


def _nth_paragraph(response: str, kw: dict) -> float:
    """Half for the count of blank-line-separated paragraphs, half for the asked one's first word."""
    paragraphs = [p for p in re.split(r"\n\s*\n", response) if p.strip()]
    asked, nth, first = kw.get("num_paragraphs", 1), kw.get("nth_paragraph", 1), kw.get("first_word", "")
    words = paragraphs[nth - 1].split() if len(paragraphs) >= nth else []
    starts = bool(words) and re.sub(r"\W", "", words[0]).lower() == first.lower()
    return (len(paragraphs) == asked) / 2 + starts / 2


def _at_least(count: Callable[[str, dict], float], target: str) -> Callable[[str, dict], float]:
    """The share reached of a floor ("at least" N); nothing for a ceiling ("less than"), which shortening meets."""

    def credit(response: str, kw: dict) -> float:
        relation = kw.get("relation") or kw.get("let_relation") or "at least"
        return _share(count(response, kw), kw.get(target, 1)) if relation == "at least" else 0.0

    return credit


# instruction type -> (response, its kwargs) -> how far the response got toward it, in [0, 1]
PROGRESS: dict[str, Callable[[str, dict], float]] = {
    "change_case:english_lowercase": lambda response, _: _case_share(response, upper=False),
    "change_case:english_capital": lambda response, _: _case_share(response, upper=True),
    "startend:quotation": _quotation,
    "combination:repeat_prompt": _repeat_prompt,
    "combination:two_responses": lambda response, _: float("******" in response),
    "length_constraints:number_paragraphs": _paragraphs,
    "length_constraints:nth_paragraph_first_word": _nth_paragraph,
    "length_constraints:number_words": _at_least(lambda response, _: len(response.split()), "num_words"),
    "keywords:frequency": _at_least(
        lambda response, kw: len(re.findall(rf"\b{re.escape(kw.get('keyword', ''))}\b", response, re.I)), "frequency"
    ),
    "detectable_content:number_placeholders": lambda response, kw: _share(
        len(re.findall(r"\[.*?\]", response)), kw.get("num_placeholders", 1)
    ),
    "detectable_format:number_highlighted_sections": lambda response, kw: _share(
        len(re.findall(r"\*[^\n\*]+\*", response)), kw.get("num_highlights", 1)
    ),
    "detectable_format:multiple_sections": lambda response, kw: _share(
        len(re.findall(rf"\s?{re.escape(kw.get('section_spliter', 'Section'))}\s?\d+\s?", response)),
        kw.get("num_sections", 1),
    ),
}


def instruction_credit(prompt: str, response: str, instruction_ids: list[str], kwargs: list[dict | None]) -> float:
    """The mean over a row's instructions of 1 where IFEval's strict checker passes it, else PARTIAL times its
    progress (`PROGRESS`; 0 for the types without one). Instructions not scorable here are left out."""
    verdict = verifiers.score(prompt, response, instruction_ids, kwargs, "ifeval")
    credits = []
    for instruction_id, arguments, passed in zip(instruction_ids, kwargs, verdict.strict, strict=True):
        if passed is None:
            continue
        progress = PROGRESS.get(instruction_id)
        partial = PARTIAL * progress(response, verifiers.plain_kwargs(arguments)) if progress else 0.0
        credits.append(1.0 if passed else min(partial, PARTIAL))
    return sum(credits) / len(credits) if credits else 0.0


def ifeval_partial(prompts: list[str], completions: list[str], instruction_id_list: list, kwargs: list) -> list[float]:
    """Reward: IFEval's strict share of a prompt's instructions, with partial credit (up to PARTIAL each) for the
    instructions not followed, in [0, 1]."""
    return [
        instruction_credit(p, c, ids, kw)
        for p, c, ids, kw in zip(prompts, completions, instruction_id_list, kwargs, strict=True)
    ]


ifeval_partial.check_row = verifiers.ifeval_strict.check_row  # type: ignore[attr-defined]
ifeval_partial.categories = verifiers.instruction_types  # type: ignore[attr-defined]
