"""Rewards planted for tests: one built to be gamed (tests/test_flow_resume.py), a coarse rule
(tests/test_ppo_trainer.py)."""

from __future__ import annotations


def repeated_words(prompts: list[str], responses: list[str]) -> list[float]:
    """The number of words a response repeats: a policy learns to say the same words again and again."""
    return [float(len(r.split()) - len(set(r.split()))) for r in responses]


def ends_a_sentence(prompts: list[str], responses: list[str]) -> list[float]:
    """1 for a response that ends with a full stop, else 0: a coarse rule whose groups of samples often all score the
    same (DAPO's dynamic sampling test, tests/test_ppo_trainer.py)."""
    del prompts
    return [float(response.rstrip().endswith(".")) for response in responses]
