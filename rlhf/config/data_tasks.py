"""The config sections of the generated data sources: the built-in synthetic task (``data.synthetic``) and a
reasoning-gym task (``data.task``, ``data.source: reasoning_gym``; rlhf/data/reasoning_gym.py)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlhf.config.base import Section


class SyntheticTaskConfig(Section):
    seed: int = Field(0, description="Seed of the generated task (prompts, demonstrations, pairs).")
    n_sft: int = Field(4000, ge=16, description="Number of SFT demonstrations.")
    n_train_pairs: int = Field(4000, ge=16, description="Number of training preference pairs.")
    n_eval_pairs: int = Field(500, ge=8, description="Number of held-out preference pairs.")
    label_noise: float = Field(
        0.1, ge=0.0, lt=0.5, description="Probability that a training pair's label is flipped (human-like noise)."
    )
    length_bias: float = Field(
        0.0,
        ge=0.0,
        description="Labellers' taste for longer reviews: a training pair's chosen review is the one with the higher "
        "gold score plus length_bias per well-formed clause (the gold reward does not share it; held-out pairs "
        "are labelled by the gold score alone). 0: no bias. docs/overoptimisation.md.",
    )
    max_clauses: int = Field(
        3,
        ge=2,
        le=10,  # the task has 10 aspects, each used once per review
        description="Longest review (clauses) of the demonstrations and pairs; reviews have 2 to max_clauses "
        "clauses. 5 clauses are 25 tokens of the bootstrapped tokenizer: past ppo.max_new_tokens 24, so cut short.",
    )
    sft_max_clauses: int | None = Field(
        None,
        ge=2,
        le=10,
        description="Longest SFT demonstration (clauses), when it should differ from the pairs' max_clauses: "
        "shorter demonstrations make the long reviews the labellers favour rare under the SFT policy. None: "
        "max_clauses. docs/overoptimisation.md.",
    )


class ReasoningTaskConfig(Section):
    """A procedural task of reasoning-gym (``data.source: reasoning_gym``): its generator makes the training and the
    held-out items from two seeds, and its own ``score_answer`` checks a response (docs/data.md)."""

    name: str = Field(
        "chain_sum",
        description="reasoning-gym's name of the task (e.g. chain_sum, basic_arithmetic, leg_counting); an unknown "
        "name is refused before anything loads, with the names the installed reasoning-gym knows.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The generator's own settings, as reasoning-gym's config class of the task takes them (e.g. "
        "{min_terms: 2, max_terms: 3, max_digits: 2} for chain_sum); {} keeps its defaults.",
    )
    train_seed: int = Field(0, ge=0, description="Seed of the training items (the PPO prompts and the pairs).")
    train_size: int = Field(2000, ge=8, description="Number of training items generated (before duplicates go).")
    eval_seed: int = Field(
        1_000_000,
        ge=0,
        description="Seed of the held-out items. reasoning-gym draws item i of a seed from seed + i, so the two "
        "ranges [train_seed, train_seed + train_size) and [eval_seed, eval_seed + eval_size) must not overlap; "
        "held-out items whose question is also a training question are dropped.",
    )
    eval_size: int = Field(256, ge=8, description="Number of held-out items generated (the evaluation's prompts).")

    @model_validator(mode="after")
    def _seeds_apart(self) -> ReasoningTaskConfig:
        train = (self.train_seed, self.train_seed + self.train_size)
        held = (self.eval_seed, self.eval_seed + self.eval_size)
        if held[0] < train[1] and train[0] < held[1]:
            raise ValueError(
                f"data.task.eval_seed: reasoning-gym draws item i from seed + i, so held-out seeds [{held[0]}, "
                f"{held[1]}) overlap the training seeds [{train[0]}, {train[1]}) and would repeat training items; "
                f"use an eval_seed of at least {train[1]}"
            )
        return self
