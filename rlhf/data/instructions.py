"""The built-in instruction-following task of the real tier: prompts with verifiable constraints, IFEval-style.

Each prompt asks for a short text about a topic and adds one or two constraints in the spirit of IFEval (Zhou et
al. 2023, "Instruction-Following Evaluation for Large Language Models"): all lowercase, fewer than N words,
include a keyword, end with an exact phrase, exactly N bullet points, no commas, start with a given word, wrap the
answer in double quotes. Every constraint is stated in a fixed sentence, so the checker reads the constraints back
from the prompt text itself (rendered with any chat template) and needs nothing else: `gold_reward` is a reward
function (``reward.function: rlhf.data.instructions:gold_reward``) and the data set's gold reward
(``data.gold_reward``). The gold score of a response is the fraction of its prompt's constraints it satisfies, in
[0, 1]; an empty response scores 0.

`make_prompts` generates the prompts from a seed; the preference pairs in ``data/instructions/`` were sampled from
SmolLM2-135M-Instruct itself and labelled by this checker (``tools/sample_instruction_pairs.py``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import NamedTuple

GOLD_REWARD = "rlhf.data.instructions:gold_reward"

TOPICS = [
    "the ocean",
    "a rainy afternoon",
    "your favourite breakfast",
    "learning to cook",
    "a walk in the mountains",
    "why sleep matters",
    "the first bicycle",
    "keeping a garden",
    "a visit to a museum",
    "the night sky",
    "saving money",
    "a good teacher",
    "moving to a new city",
    "the sound of rain",
    "learning a new language",
    "a winter morning",
    "drinking enough water",
    "an old library",
    "playing chess",
    "a busy train station",
    "planting a tree",
    "the smell of fresh bread",
    "a long road trip",
    "taking photographs",
    "a friendly neighbour",
    "recycling at home",
    "a summer festival",
    "riding a horse",
    "baking a cake",
    "the first day of school",
    "a quiet lake",
    "exercise in the morning",
    "a lighthouse",
    "writing letters by hand",
    "a small bakery",
    "the moon",
    "a lost umbrella",
    "honey bees",
    "a snowy forest",
    "board games with family",
]
# Held-out prompts are about topics no training prompt mentions (and so never repeat a training prompt).
EVAL_TOPICS = TOPICS[-8:]
TRAIN_TOPICS = TOPICS[:-8]
TASKS = [
    "Write a short note about {topic}.",
    "Describe {topic}.",
    "Tell me about {topic}.",
    "Write a few sentences about {topic}.",
    "Give a short explanation of {topic}.",
]
KEYWORDS = ["bright", "simple", "river", "gentle", "window", "golden", "careful", "morning", "quiet", "friend"]
END_PHRASES = ["Is there anything else I can help with?", "That is all.", "Thank you for reading.", "The end."]
START_WORDS = ["Today", "Honestly", "Imagine", "Yes", "Well"]
WORD_LIMITS = [15, 25, 40]
BULLET_COUNTS = [2, 3, 4]


class Constraint(NamedTuple):
    """One verifiable constraint: its name, the sentence the prompt states it with, and the check of a response."""

    name: str
    sentence: str
    check: Callable[[str], bool]


_WORD = re.compile(r"[A-Za-z0-9']+")
_BULLET = re.compile(r"^\s*[*-]\s+\S", re.MULTILINE)


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def lowercase() -> Constraint:
    return Constraint(
        "lowercase",
        "Your entire answer must be in lowercase letters, with no capital letters at all.",
        lambda r: any(c.isalpha() for c in r) and r == r.lower(),
    )


def word_limit(n: int) -> Constraint:
    return Constraint("word_limit", f"Answer in fewer than {n} words.", lambda r: 0 < len(_words(r)) < n)


def keyword(word: str) -> Constraint:
    pattern = re.compile(rf"\b{re.escape(word)}\b", re.IGNORECASE)
    return Constraint("keyword", f'Include the word "{word}" in your answer.', lambda r: bool(pattern.search(r)))


def end_phrase(phrase: str) -> Constraint:
    return Constraint(
        "end_phrase",
        f'End your answer with the exact phrase "{phrase}" and nothing after it.',
        lambda r: r.rstrip().endswith(phrase),
    )


def bullets(n: int) -> Constraint:
    return Constraint(
        "bullets",
        f"Answer with exactly {n} bullet points, each on its own line starting with '* '.",
        lambda r: len(_BULLET.findall(r)) == n,
    )


def no_commas() -> Constraint:
    return Constraint("no_commas", "Do not use any commas in your answer.", lambda r: bool(r.strip()) and "," not in r)


def start_word(word: str) -> Constraint:
    return Constraint(
        "start_word",
        f'Start your answer with the word "{word}".',
        lambda r: bool(_words(r)) and r.lstrip().startswith(word) and _words(r)[0] == word,
    )


def quoted() -> Constraint:
    return Constraint(
        "quoted",
        "Wrap your entire answer in double quotation marks.",
        lambda r: len(r.strip()) > 2 and r.strip().startswith('"') and r.strip().endswith('"'),
    )


def _every_constraint() -> list[Constraint]:
    """Every constraint the task states, with each of its parameters (the checker's table)."""
    return [
        lowercase(),
        no_commas(),
        quoted(),
        *(word_limit(n) for n in WORD_LIMITS),
        *(keyword(w) for w in KEYWORDS),
        *(end_phrase(p) for p in END_PHRASES),
        *(bullets(n) for n in BULLET_COUNTS),
        *(start_word(w) for w in START_WORDS),
    ]


CONSTRAINTS = {c.sentence: c for c in _every_constraint()}
# Constraints that contradict each other (a quoted answer cannot start with a word or end with a phrase; bullet
# points are not a quoted text) are never drawn together.
_CONFLICTS = {
    frozenset({"quoted", "start_word"}),
    frozenset({"quoted", "end_phrase"}),
    frozenset({"quoted", "bullets"}),
    frozenset({"start_word", "bullets"}),
    frozenset({"end_phrase", "bullets"}),
    frozenset({"lowercase", "start_word"}),
    frozenset({"lowercase", "end_phrase"}),
}


def constraints_of(prompt: str) -> list[Constraint]:
    """The constraints a prompt states (found by their sentences, wherever the chat template put the prompt)."""
    return [c for sentence, c in CONSTRAINTS.items() if sentence in prompt]


def gold_score(prompt: str, response: str) -> float:
    """The fraction of the prompt's constraints that the response satisfies, in [0, 1] (0 for a prompt with none)."""
    found = constraints_of(prompt)
    if not found:
        return 0.0
    return round(sum(c.check(response) for c in found) / len(found), 6)


def gold_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The gold scores of a batch as a reward function: `gold_score` of each (prompt, response)."""
    return [gold_score(p, r) for p, r in zip(prompts, responses, strict=True)]


def make_prompt(rng: random.Random, topics: list[str], max_constraints: int = 2) -> str:
    """One instruction: a task about one of `topics` and 1 to `max_constraints` non-conflicting constraints."""
    text = rng.choice(TASKS).format(topic=rng.choice(topics))
    chosen: list[Constraint] = []
    pool = _every_constraint()
    for _ in range(rng.randint(1, max_constraints)):
        options = [
            c for c in pool if all(c.name != o.name and frozenset({c.name, o.name}) not in _CONFLICTS for o in chosen)
        ]
        chosen.append(rng.choice(options))
    return " ".join([text, *(c.sentence for c in chosen)])


def make_prompts(n: int, seed: int, split: str, max_constraints: int = 2) -> list[str]:
    """`n` distinct instructions of a split: 'train' (TRAIN_TOPICS) or 'eval' (EVAL_TOPICS, disjoint)."""
    rng = random.Random(f"instructions-{split}-{seed}")
    topics = EVAL_TOPICS if split == "eval" else TRAIN_TOPICS
    prompts: dict[str, None] = {}
    while len(prompts) < n:
        prompts[make_prompt(rng, topics, max_constraints)] = None
    return list(prompts)
