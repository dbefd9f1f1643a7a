"""The built-in synthetic preference task: short film reviews, a programmatic gold reward.

Prompts ask for a review of a made-up film. A response is a sentence of clauses ``the <aspect> was <adjective>``
joined by ``and`` and closed by a full stop. The gold reward is the mean valence of the adjectives in the
well-formed clauses (each adjective has a fixed valence in [-1, 1]), minus 0.5 if the sentence is not closed;
a response with no well-formed clause scores -1. SFT demonstrations are a mixture of positive, negative and
mixed reviewers, so the SFT policy is mediocre under the gold reward and PPO has room to improve it.
Everything is generated deterministically from a seed.
"""

from __future__ import annotations

import random
import re
from typing import NamedTuple

GOLD_REWARD_NAME = "synthetic-review-sentiment-v1"

_TITLE_FIRST = [
    "silent",
    "golden",
    "broken",
    "hidden",
    "last",
    "crimson",
    "frozen",
    "wild",
    "distant",
    "quiet",
    "burning",
    "paper",
    "iron",
    "lonely",
    "secret",
    "electric",
]
_TITLE_SECOND = [
    "river",
    "garden",
    "empire",
    "voyage",
    "harbor",
    "mirror",
    "forest",
    "city",
    "letter",
    "machine",
    "winter",
    "island",
    "tower",
    "promise",
    "signal",
    "horizon",
]
ASPECTS = ["plot", "acting", "music", "ending", "pacing", "dialogue", "cast", "script", "camera", "score"]

POSITIVE = {
    "superb": 1.0,
    "excellent": 1.0,
    "brilliant": 0.9,
    "wonderful": 0.9,
    "great": 0.8,
    "lovely": 0.7,
    "charming": 0.6,
    "good": 0.5,
    "nice": 0.4,
    "decent": 0.3,
}
NEGATIVE = {
    "awful": -1.0,
    "terrible": -1.0,
    "dreadful": -0.9,
    "boring": -0.7,
    "poor": -0.6,
    "dull": -0.6,
    "weak": -0.5,
    "messy": -0.5,
    "bland": -0.4,
    "slow": -0.3,
}
VALENCE = {**POSITIVE, **NEGATIVE}

# Reviewer moods of the SFT demonstrations: probability that each adjective is drawn from POSITIVE.
_MOODS = (0.85, 0.5, 0.15)
_CLAUSE = re.compile(r"the (\w+) was (\w+)")


class Demonstration(NamedTuple):
    prompt: str
    response: str


class PreferencePair(NamedTuple):
    prompt: str
    chosen: str
    rejected: str
    gold_chosen: float
    gold_rejected: float


def make_prompt(rng: random.Random) -> str:
    return f"Review of The {rng.choice(_TITLE_FIRST).title()} {rng.choice(_TITLE_SECOND).title()}:"


def make_response(rng: random.Random, p_positive: float | None = None, max_clauses: int = 3) -> str:
    """One review sentence of 2 to `max_clauses` clauses from a reviewer of the given mood (None: a random mood)."""
    p = rng.choice(_MOODS) if p_positive is None else p_positive
    aspects = rng.sample(ASPECTS, rng.randint(2, max_clauses))
    clauses = []
    for aspect in aspects:
        pool = POSITIVE if rng.random() < p else NEGATIVE
        clauses.append(f"the {aspect} was {rng.choice(sorted(pool))}")
    return " " + " and ".join(clauses) + "."


def gold_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """The gold scores of a batch as a reward function (``reward.function: rlhf.data.synthetic:gold_reward``):
    `gold_score` of each (prompt, response)."""
    return [gold_score(p, r) for p, r in zip(prompts, responses, strict=True)]


def gold_score(prompt: str, response: str, row: str | None = None) -> float:
    """Programmatic gold score of a response, in [-1.5, 1] (the prompt and its row do not change it)."""
    del prompt, row
    valences = [VALENCE[adj] for aspect, adj in _CLAUSE.findall(response) if aspect in ASPECTS and adj in VALENCE]
    if not valences:
        return -1.0
    score = sum(valences) / len(valences)
    if not response.rstrip().endswith("."):
        score -= 0.5
    return round(score, 6)


def demonstrations(n: int, seed: int, max_clauses: int = 3) -> list[Demonstration]:
    rng = random.Random(f"sft-{seed}")
    return [Demonstration(make_prompt(rng), make_response(rng, max_clauses=max_clauses)) for _ in range(n)]


def clause_count(response: str) -> int:
    """Well-formed clauses of a response (those the gold reward reads)."""
    return sum(aspect in ASPECTS and adj in VALENCE for aspect, adj in _CLAUSE.findall(response))


def labeller_preference(prompt: str, response: str, length_bias: float) -> float:
    """What a labeller ranks a response by: its gold score plus `length_bias` per well-formed clause (a taste for
    longer reviews that the gold reward does not share; 0: the gold score alone)."""
    return gold_score(prompt, response) + length_bias * clause_count(response)


def preference_pairs(
    n: int, seed: int, label_noise: float, split: str, length_bias: float = 0.0, max_clauses: int = 3
) -> list[PreferencePair]:
    """Pairs of two sampled reviews; the chosen one is preferred by `labeller_preference` (the higher gold score
    when `length_bias` is 0), flipped with `label_noise`."""
    rng = random.Random(f"pairs-{split}-{seed}")
    pairs: list[PreferencePair] = []
    while len(pairs) < n:
        prompt = make_prompt(rng)
        a, b = make_response(rng, max_clauses=max_clauses), make_response(rng, max_clauses=max_clauses)
        ga, gb = gold_score(prompt, a), gold_score(prompt, b)
        pa, pb = labeller_preference(prompt, a, length_bias), labeller_preference(prompt, b, length_bias)
        if pa == pb:
            continue  # no preference to learn
        if pa < pb:
            a, b, ga, gb = b, a, gb, ga
        if rng.random() < label_noise:
            a, b, ga, gb = b, a, gb, ga
        pairs.append(PreferencePair(prompt, a, b, ga, gb))
    return pairs
