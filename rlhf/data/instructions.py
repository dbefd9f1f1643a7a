"""The real tier's instruction-following prompts: IFEval's instruction types and kwargs, generated from a seed.

Each prompt asks for a short text about a topic and adds one or two instructions of IFEval (Zhou et al. 2023),
stated in IFEval's own words (its checkers' ``build_description``), with arguments a short answer can meet (fewer
than N words, 2 or 3 bullet points, ...). A row carries IFEval's ``instruction_id_list`` and ``kwargs``, so IFEval's
checkers (``rlhf.data.verifiers``) score a response against the row, not against the prompt's wording. Held-out
prompts are about topics no training prompt mentions. Instructions IFEval's registry marks as conflicting are never
drawn together.

What this module adds to ``if-verifiable``: the topics, the tasks, the argument ranges and the seeded draw. The
preference pairs in ``data/ifeval/`` were sampled from SmolLM2-135M-Instruct on these prompts and labelled by the
checkers (``tools/sample_instruction_pairs.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from rlhf.data import verifiers

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
WORDS = ["bright", "simple", "river", "gentle", "window", "golden", "careful", "morning", "quiet", "friend"]
END_PHRASES = ["Is there anything else I can help with?", "That is all.", "Thank you for reading.", "The end."]

# IFEval's instruction types a short answer (about 64 tokens) can follow, each with a draw of its arguments
ARGUMENTS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "keywords:existence": lambda rng: {"keywords": rng.sample(WORDS, rng.randint(1, 2))},
    "keywords:forbidden_words": lambda rng: {
        "forbidden_words": rng.sample(["very", "really", "good", "nice", "also", "things"], 2)
    },
    "length_constraints:number_words": lambda rng: {"num_words": rng.choice([20, 30, 40]), "relation": "less than"},
    "detectable_content:postscript": lambda rng: {"postscript_marker": rng.choice(["P.S.", "P.P.S"])},
    "detectable_content:number_placeholders": lambda rng: {"num_placeholders": rng.randint(1, 2)},
    "detectable_format:number_bullet_lists": lambda rng: {"num_bullets": rng.randint(2, 3)},
    "detectable_format:number_highlighted_sections": lambda rng: {"num_highlights": rng.randint(1, 2)},
    "detectable_format:title": lambda rng: {},
    "detectable_format:constrained_response": lambda rng: {},
    "startend:end_checker": lambda rng: {"end_phrase": rng.choice(END_PHRASES)},
    "startend:quotation": lambda rng: {},
    "change_case:english_lowercase": lambda rng: {},
    "change_case:english_capital": lambda rng: {},
    "punctuation:no_comma": lambda rng: {},
}
INSTRUCTION_TYPES = tuple(ARGUMENTS)


def describe(instruction_id: str, kwargs: dict[str, Any]) -> str:
    """IFEval's own sentence for an instruction with these arguments."""
    checker = verifiers.registry("ifeval")[instruction_id](instruction_id)
    return checker.build_description(**kwargs)


def make_row(rng: random.Random, topics: list[str], max_instructions: int = 2) -> dict[str, Any]:
    """One prompt: a task about one of `topics` and 1 to `max_instructions` instructions that do not conflict, as a
    row with ``prompt``, ``instruction_id_list`` and ``kwargs`` (IFEval's layout)."""
    conflicts = verifiers.conflicts("ifeval")
    ids: list[str] = []
    for _ in range(rng.randint(1, max_instructions)):
        options = [
            i
            for i in INSTRUCTION_TYPES
            if i not in ids and not any(i in conflicts.get(o, ()) or o in conflicts.get(i, ()) for o in ids)
        ]
        if not options:
            break
        ids.append(rng.choice(options))
    kwargs = [ARGUMENTS[i](rng) for i in ids]
    task = rng.choice(TASKS).format(topic=rng.choice(topics))
    prompt = " ".join([task, *(describe(i, k) for i, k in zip(ids, kwargs, strict=True))])
    return {"prompt": prompt, "instruction_id_list": ids, "kwargs": kwargs}


def make_rows(n: int, seed: int, split: str, max_instructions: int = 2) -> list[dict[str, Any]]:
    """`n` rows with distinct prompts of a split: 'train' (TRAIN_TOPICS) or 'eval' (EVAL_TOPICS, disjoint)."""
    rng = random.Random(f"ifeval-{split}-{seed}")
    topics = EVAL_TOPICS if split == "eval" else TRAIN_TOPICS
    rows: dict[str, dict[str, Any]] = {}
    while len(rows) < n:
        row = make_row(rng, topics, max_instructions)
        rows.setdefault(row["prompt"], row)
    return [{"key": f"{split}-{i}", **row} for i, row in enumerate(rows.values())]
