"""Signs that the policy is gaming its reward model, from what a run has without a gold reward: the diversity of
its responses against the SFT policy's, and an ensemble's members against each other (docs/overoptimisation.md).

`response_stats` and `ensemble_stats` measure one evaluation's responses; `OveroptimisationAlarm` compares each
periodic evaluation with the first (the SFT policy, step 0) and says when and why it fires.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd


def _bigrams(text: str) -> list[tuple[str, str]]:
    words = text.split()
    return list(zip(words, words[1:], strict=False))


def response_stats(responses: Sequence[str]) -> dict[str, float]:
    """Diversity of one policy's responses to distinct prompts.

    `distinct_2`: distinct word bigrams over all bigrams of all responses (Li et al. 2016's distinct-2).
    `identical_share`: the share of responses that are word for word another prompt's response.
    `repetition`: the mean over responses of the share of its bigrams that repeat an earlier bigram of the same
    response (``was excellent and was excellent`` repeats).
    """
    per_response = [_bigrams(text) for text in responses]
    every = [bigram for bigrams in per_response for bigram in bigrams]
    counts = Counter(" ".join(text.split()) for text in responses)
    repeats = [1 - len(set(bigrams)) / len(bigrams) if bigrams else 0.0 for bigrams in per_response]
    n = max(len(responses), 1)
    return {
        "distinct_2": len(set(every)) / len(every) if every else 0.0,
        "identical_share": sum(counts[" ".join(text.split())] > 1 for text in responses) / n,
        "repetition": sum(repeats) / n,
    }


def ensemble_stats(frame: pd.DataFrame, in_distribution_std: float) -> dict[str, float]:
    """An ensemble's view of one policy's responses (`frame`'s members_* columns, `member_columns`): the members'
    mean score, their std and minimum (means over responses), and `disagreement_ratio`, their std over the std they
    show on held-out chosen responses (1: as much disagreement as on the data they were trained for). Empty
    without an ensemble."""
    if "members_std" not in frame:
        return {}
    std = float(frame["members_std"].mean())
    return {
        "ensemble_mean": float(frame["members_mean"].mean()),
        "ensemble_std": std,
        "ensemble_min": float(frame["members_min"].mean()),
        "disagreement_ratio": std / in_distribution_std if in_distribution_std > 0 else float("nan"),
    }


# The alarm's thresholds (docs/overoptimisation.md: how they were set, and the runs they were checked on).
DISTINCT_DROP = 0.5  # distinct_2 below this fraction of the SFT policy's
REPETITION_RISE = 0.15  # repetition above the SFT policy's by this much
DISAGREEMENT_RATIO = 2.0  # the members disagree this many times more than on held-out data (and than at step 0)
CONSERVATIVE_FALL = 0.5  # the ensemble's min below its best by this many in-distribution stds while its mean rose


@dataclass
class Alarm:
    step: int  # the update after which the evaluation that fired ran
    reasons: list[str]

    def sentence(self) -> str:
        return (
            f"the reward model looks gamed from update {self.step} on ({'; '.join(self.reasons)}): the policy's "
            "scores may be rising while its quality falls (docs/overoptimisation.md)"
        )


@dataclass
class OveroptimisationAlarm:
    """The alarm's rule, fed one evaluation at a time (`check`); the first evaluation (step 0, the SFT policy) is
    the baseline. It fires at the first evaluation where any of the rule's conditions holds and stays fired."""

    in_distribution_std: float = 0.0  # an ensemble's disagreement on held-out chosen responses (0: no ensemble)
    baseline: dict[str, float] | None = None
    best_min: float = float("-inf")  # the ensemble's best min so far, and its mean then
    mean_at_best_min: float = float("nan")
    fired: Alarm | None = None
    history: list[tuple[int, list[str]]] = field(default_factory=list)

    def reasons(self, stats: dict[str, float]) -> list[str]:
        """The conditions `stats` (an evaluation's `response_stats` and `ensemble_stats`) meet against the baseline."""
        base = self.baseline or stats
        found = []
        if stats["distinct_2"] < DISTINCT_DROP * base["distinct_2"]:
            found.append(f"distinct bigrams {stats['distinct_2']:.2f}, SFT {base['distinct_2']:.2f}")
        if stats["repetition"] > base["repetition"] + REPETITION_RISE:
            found.append(f"repeated bigrams {stats['repetition']:.2f}, SFT {base['repetition']:.2f}")
        ratio = stats.get("disagreement_ratio")
        if ratio is not None and ratio > DISAGREEMENT_RATIO * max(1.0, base.get("disagreement_ratio", 1.0)):
            found.append(f"reward models disagree {ratio:.1f}x as much as on held-out data")
        if "ensemble_min" in stats and self.in_distribution_std > 0:
            fall = (self.best_min - stats["ensemble_min"]) / self.in_distribution_std
            if fall > CONSERVATIVE_FALL and stats["ensemble_mean"] >= self.mean_at_best_min:
                found.append(f"the ensemble's worst score fell {fall:.1f} held-out stds while its mean rose")
        return found

    def check(self, step: int, stats: dict[str, float]) -> Alarm | None:
        """Take the evaluation after `step` updates; the alarm when it fires at this one (None otherwise)."""
        if self.baseline is None:
            self.baseline = dict(stats)
        found = self.reasons(stats)
        if "ensemble_min" in stats and stats["ensemble_min"] > self.best_min:
            self.best_min, self.mean_at_best_min = stats["ensemble_min"], stats["ensemble_mean"]
        self.history.append((step, found))
        if found and self.fired is None:
            self.fired = Alarm(step, found)
            return self.fired
        return None
