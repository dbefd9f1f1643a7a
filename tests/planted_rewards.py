"""A reward built to be gamed, for the over-optimisation alarm's end-to-end test (tests/test_flow_resume.py)."""

from __future__ import annotations


def repeated_words(prompts: list[str], responses: list[str]) -> list[float]:
    """The number of words a response repeats: a policy learns to say the same words again and again."""
    return [float(len(r.split()) - len(set(r.split()))) for r in responses]
