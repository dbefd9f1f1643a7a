"""Signs that the policy is gaming its reward model, from what a run has without a gold reward: how likely the SFT
model finds the policy's tokens and how diverse its responses are, against the SFT policy's own, and an ensemble's
members against each other (docs/overoptimisation.md).

`response_stats` and `ensemble_stats` measure one evaluation's responses; `OveroptimisationAlarm` compares each
periodic evaluation with the first (the SFT policy, step 0) and says when and why it fires.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd

from rlhf.metrics import PERIODIC_EVAL, PERIODIC_GOLD


def _bigrams(text: str) -> list[tuple[str, str]]:
    words = text.split()
    return list(zip(words, words[1:], strict=False))


NEAR_IDENTICAL_JACCARD = 0.8  # two responses whose bigram sets overlap this much say the same thing


def near_identical_share(per_response: Sequence[Sequence[tuple[str, str]]]) -> float:
    """The share of responses whose set of word bigrams overlaps another response's by NEAR_IDENTICAL_JACCARD or
    more (Jaccard: shared over all distinct bigrams of the two): one answer, give or take a word, to different
    prompts. A response without a bigram is near-identical to another without one."""
    sets = [frozenset(bigrams) for bigrams in per_response]
    near = [False] * len(sets)
    for i, a in enumerate(sets):
        for j in range(i + 1, len(sets)):
            b = sets[j]
            union = len(a | b)
            if (union == 0) or len(a & b) / union >= NEAR_IDENTICAL_JACCARD:
                near[i] = near[j] = True
    return sum(near) / max(len(sets), 1)


def response_stats(responses: Sequence[str]) -> dict[str, float]:
    """Diversity of one policy's responses to distinct prompts.

    `distinct_2`: distinct word bigrams over all bigrams of all responses (Li et al. 2016's distinct-2).
    `identical_share`: the share of responses that are word for word another prompt's response.
    `near_identical_share`: the share that are nearly another prompt's response (`near_identical_share`).
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
        "near_identical_share": near_identical_share(per_response),
        "repetition": sum(repeats) / n,
    }


def surprisal_stats(frame: pd.DataFrame) -> dict[str, float]:
    """`ref_surprisal`: the reference (SFT) model's surprisal at one policy's response tokens, -log p_ref in nats per
    token over all of them (`frame`'s ref_nll and tokens columns, `generate_and_score_prompts`). Empty without."""
    if "ref_nll" not in frame or not frame["tokens"].sum():
        return {}
    return {"ref_surprisal": float(frame["ref_nll"].sum() / frame["tokens"].sum())}


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


# What a PPO stage reports of its alarm (its metrics and the pipeline's summary): the update the alarm fired after
# (-1: it did not) and the update whose policy ppo.on_overoptimisation kept (-1: the last)
ALARM_STEP_KEY, KEPT_STEP_KEY = "overoptimisation/alarm_step", "overoptimisation/kept_step"

# The alarm's thresholds (docs/overoptimisation.md: how they were set, and the runs they were checked on).
DISTINCT_DROP = 0.35  # distinct_2 below this fraction of the SFT policy's
DISAGREEMENT_RATIO = 2.0  # the members disagree this many times more than on held-out data (and than at step 0)
CONSERVATIVE_FALL = 0.5  # the ensemble's min below its best by this many in-distribution stds while its mean rose
KL_DRIFT_FACTOR, KL_DRIFT_NATS = 1.5, 1.0  # the KL grew past 1.5 times an earlier evaluation's plus 1 nat ...
SCORE_GAIN_FRACTION = 0.05  # ... while the score gained under 5% of what it had gained over the SFT policy by then
SURPRISAL_RISE = 1.3  # the reference's surprisal at the policy's tokens this many nats per token above the SFT's own
# Evidence that keeps a policy from being kept: the surprisal risen SURPRISAL_RISE, or a jump since the previous
# evaluation of SURPRISAL_JUMP nats per token per update that is also JUMP_PER_KL nats per token per nat of KL gained
# there. A fast fall jumps with little KL (0.64 nats in 5 updates where a GRPO run's gold fell from 0.98 to 0.22); a
# healthy policy that lengthens its responses climbs 0.06-0.10 an update, but with the KL it pays for them
SURPRISAL_JUMP = 0.02
JUMP_PER_KL = 0.06
CONFIRM = 2  # the periodic alarm fires once its rule holds at this many evaluations in a row (or at the last one)


@dataclass
class Alarm:
    step: int  # the update after which the evaluation that fired ran
    reasons: list[str]
    # the reward is a verifier (a reward function and no reward model): its score is the quality, so the alarm says
    # what it saw (the policy moving away with no gain), not that a proxy is gamed
    verified: bool = False

    def sentence(self) -> str:
        seen = "; ".join(self.reasons)
        if self.verified:
            return (
                f"the policy drifts from the SFT policy without gaining from update {self.step} on ({seen}): the "
                "verified score no longer pays for the distance (docs/overoptimisation.md)"
            )
        return (
            f"the policy looks like it games its reward from update {self.step} on ({seen}): its scores may be "
            "rising while its quality falls (docs/overoptimisation.md)"
        )


@dataclass
class OveroptimisationAlarm:
    """The alarm's rule, fed one evaluation at a time (`check`); the first evaluation (step 0, the SFT policy) is
    the baseline. It fires at the first evaluation where any of the rule's conditions holds and stays fired."""

    in_distribution_std: float = 0.0  # an ensemble's disagreement on held-out chosen responses (0: no ensemble)
    surprisal_rise: float = SURPRISAL_RISE  # the surprisal condition's threshold (nats per token)
    kl_drift_factor: float = KL_DRIFT_FACTOR  # the KL-drift condition's factor
    # whether the surprisal condition waits for the score to stall (the periodic evaluations; the evaluation stage,
    # which compares the final policy with the SFT policy, has no history to stall in)
    surprisal_waits_for_stall: bool = True
    verified: bool = False  # the reward is a verifier (`Alarm.verified`)
    # the evaluations in a row the rule must hold at before the alarm fires (the last evaluation fires alone): an
    # evaluation where it holds once and not at the next is taken back, and its policy is never kept (`quiet`)
    confirm: int = CONFIRM
    surprisal_jump: float = SURPRISAL_JUMP  # nats per token per update since the previous evaluation: evidence ...
    jump_per_kl: float = JUMP_PER_KL  # ... where it is also this many nats a token per nat of KL gained (0: any KL)
    evidence_rise: float = SURPRISAL_RISE  # nats per token above the baseline's: evidence
    baseline: dict[str, float] | None = None
    best_min: float = float("-inf")  # the ensemble's best min so far, and its mean then
    mean_at_best_min: float = float("nan")
    fired: Alarm | None = None
    history: list[tuple[int, list[str]]] = field(default_factory=list)
    points: list[tuple[int, float, float]] = field(default_factory=list)  # (step, score, kl) of each evaluation
    # per evaluation: whether it shows neither the rule nor its evidence (`evidence`), so that its policy may be kept
    quiet: list[bool] = field(default_factory=list)
    streak: int = 0  # the evaluations in a row, up to the last, at which the rule held
    previous: tuple[int, dict[str, float]] | None = None  # the step and stats of the last evaluation checked

    def reasons(self, stats: dict[str, float]) -> list[str]:
        """The conditions `stats` (an evaluation's `response_stats` and `ensemble_stats`) meet against the baseline."""
        base = self.baseline or stats
        found = []
        if stats["distinct_2"] < DISTINCT_DROP * base["distinct_2"]:
            found.append(f"distinct bigrams {stats['distinct_2']:.2f}, SFT {base['distinct_2']:.2f}")
        ratio = stats.get("disagreement_ratio")
        if ratio is not None and ratio > DISAGREEMENT_RATIO * max(1.0, base.get("disagreement_ratio", 1.0)):
            found.append(f"reward models disagree {ratio:.1f}x as much as on held-out data")
        if "ensemble_min" in stats and self.in_distribution_std > 0:
            fall = (self.best_min - stats["ensemble_min"]) / self.in_distribution_std
            if fall > CONSERVATIVE_FALL and stats["ensemble_mean"] >= self.mean_at_best_min:
                found.append(f"the ensemble's worst score fell {fall:.1f} held-out stds while its mean rose")
        rise = self.surprisal_rise_of(stats)
        if rise >= self.surprisal_rise and (self._stalled_points(stats) or not self.surprisal_waits_for_stall):
            found.append(
                f"the SFT model finds the responses' tokens {rise:.2f} nats more surprising each than its own samples, "
                f"{stats['ref_surprisal']:.2f} against {base['ref_surprisal']:.2f} nats at step 0"
            )
        drift = self.kl_drift(stats)
        if drift is not None:
            found.append(drift)
        return found

    def surprisal_rise_of(self, stats: dict[str, float]) -> float:
        """How much more surprising the reference (the SFT model) finds the evaluation's response tokens than the
        SFT policy's own at step 0: `ref_surprisal` (mean nats per token) less the baseline's. A policy that sharpens
        onto what the SFT model already writes gains KL but not this; one that writes what the SFT model would not
        (the reward model's blind spots: broken words, stray tokens) gains both. NaN without the statistic. The
        condition also needs the score to have stalled (`_stalled_points`, as the KL drift does): early in training a
        policy may pass through text the SFT model would not write while its score climbs, and come back."""
        base = self.baseline or stats
        if "ref_surprisal" not in stats or "ref_surprisal" not in base:
            return float("nan")
        return stats["ref_surprisal"] - base["ref_surprisal"]

    def _stalled_points(self, stats: dict[str, float]) -> list[tuple[int, float, float]]:
        """The earlier evaluations (after the first) the score has stalled since: it gained under
        SCORE_GAIN_FRACTION of the gain it had made over the SFT policy by then (a gain there is needed)."""
        if "kl" not in stats or not self.points:
            return []
        base = self.points[0][1]
        return [
            (step, score, kl)
            for step, score, kl in self.points[1:]
            if score - base > 0 and stats["score"] - score < SCORE_GAIN_FRACTION * (score - base)
        ]

    def kl_drift(self, stats: dict[str, float]) -> str | None:
        """The policy moves on without reward: the KL to the reference grew past `kl_drift_factor` times an earlier
        evaluation's (plus KL_DRIFT_NATS) while the score gained under SCORE_GAIN_FRACTION of the gain it had made
        over the SFT policy by that evaluation. None where it does not (or where the evaluation has no KL)."""
        for step, score, kl in self._stalled_points(stats):
            if stats["kl"] >= self.kl_drift_factor * kl + KL_DRIFT_NATS:
                return (
                    f"the KL to the reference grew from {kl:.1f} (update {step}) to {stats['kl']:.1f} while the "
                    f"score moved {stats['score'] - score:+.3f}"
                )
        return None

    def kl_drift_ratio(self, stats: dict[str, float]) -> float:
        """How far the KL-drift condition is from firing: the largest KL / (`kl_drift_factor` * earlier KL +
        KL_DRIFT_NATS) over the earlier evaluations the score has stalled since (1 or more: it fires; 0: none)."""
        stalled = self._stalled_points(stats)
        return max((stats["kl"] / (self.kl_drift_factor * kl + KL_DRIFT_NATS) for _, _, kl in stalled), default=0.0)

    def evidence(self, step: int, stats: dict[str, float]) -> bool:
        """Whether the evaluation after `step` updates shows the surprisal sign before the rule holds: the SFT model
        finds the responses `evidence_rise` nats a token more surprising than its own samples at step 0, or the
        surprisal rose `surprisal_jump` nats a token per update since the previous evaluation and `jump_per_kl` nats a
        token per nat of KL gained there. A policy whose gold falls fast often shows one of them an evaluation before
        the rule holds."""
        if self.surprisal_rise_of(stats) >= self.evidence_rise:
            return True
        if self.previous is None or "ref_surprisal" not in stats or "ref_surprisal" not in self.previous[1]:
            return False
        before, earlier = self.previous
        jump = stats["ref_surprisal"] - earlier["ref_surprisal"]
        if jump < self.surprisal_jump * max(step - before, 1):
            return False
        kl_gained = stats["kl"] - earlier["kl"] if "kl" in stats and "kl" in earlier else 0.0
        return jump >= self.jump_per_kl * max(kl_gained, 0.0)

    def check(self, step: int, stats: dict[str, float], last: bool = False) -> Alarm | None:
        """Take the evaluation after `step` updates (`last`: the run's last, which nothing can take back); the
        alarm when it fires at this one (None otherwise)."""
        if self.baseline is None:
            self.baseline = dict(stats)
        found = self.reasons(stats)
        self.quiet.append(not found and not self.evidence(step, stats))
        if "ensemble_min" in stats and stats["ensemble_min"] > self.best_min:
            self.best_min, self.mean_at_best_min = stats["ensemble_min"], stats["ensemble_mean"]
        self.history.append((step, found))
        if "kl" in stats:
            self.points.append((step, stats["score"], stats["kl"]))
        self.previous = (step, stats)
        self.streak = self.streak + 1 if found else 0
        if found and (self.streak >= self.confirm or last) and self.fired is None:
            self.fired = Alarm(step, found, self.verified)
            return self.fired
        return None


GOLD_FALL = 0.2  # a run over-optimises when its gold ends this far or further below its peak (the measure)


def alarm_inputs(history: pd.DataFrame) -> tuple[list[dict[str, float]], float]:
    """What the alarm reads of one run's logged periodic evaluations (`history`: a `step` column and the
    periodic_eval/* metrics, in step order): each evaluation's stats without the prefix (a NaN, a metric not logged
    there, left out), and the ensemble's in-distribution std (0 without an ensemble)."""
    rows = [
        {key.removeprefix(PERIODIC_EVAL): value for key, value in row.items() if isinstance(key, str)}
        for row in history.to_dict("records")
    ]
    in_distribution_std = 0.0
    if "ensemble_std" in rows[0] and rows[0].get("disagreement_ratio", 0) > 0:
        in_distribution_std = rows[0]["ensemble_std"] / rows[0]["disagreement_ratio"]
    return [{k: v for k, v in row.items() if v == v} for row in rows], in_distribution_std


def replay_alarm(
    stats: list[dict[str, float]], in_distribution_std: float = 0.0, **levers: float
) -> OveroptimisationAlarm:
    """The periodic alarm fed one run's evaluations (`alarm_inputs`' stats, in step order), as `EvalGuard` feeds
    it, the last marked last; `levers`: the alarm's settings to replay other than the shipped ones (`confirm`,
    `surprisal_rise`, `surprisal_jump`, `evidence_rise`, `kl_drift_factor`)."""
    alarm = OveroptimisationAlarm(in_distribution_std, **levers)
    for i, row in enumerate(stats):
        alarm.check(int(row["step"]), row, last=i == len(stats) - 1)
    return alarm


def kept_index(alarm: OveroptimisationAlarm) -> int:
    """The evaluation (its index) whose policy `ppo.on_overoptimisation: stop` keeps after `replay_alarm`: the last
    quiet one before the alarm (update 0's, the SFT policy's, at worst), the last one where it never fired."""
    steps = [step for step, _ in alarm.history]
    if alarm.fired is None:
        return len(steps) - 1
    fired = steps.index(alarm.fired.step)
    return max((i for i in range(fired) if alarm.quiet[i]), default=0)


def replay(history: pd.DataFrame, **levers: float) -> dict[str, float]:
    """The alarm's rule replayed over one run's periodic evaluations, against its gold reward: `history` has a
    `step` column and the periodic_eval/* metrics (`rlhf.ppo.periodic_eval`, with periodic_eval/gold). Returns the
    gold peak and its update, the final gold, the first update at which the gold is GOLD_FALL below its peak so far (-1:
    never), the update the alarm fires at (-1: never), the gold there and the gold of the policy 'stop' keeps
    (`kept_index`, as `EvalGuard` keeps it). `levers`: `replay_alarm`'s."""
    history = history.sort_values("step").reset_index(drop=True)
    alarm = replay_alarm(*alarm_inputs(history), **levers)
    gold = history[PERIODIC_GOLD]
    peak = int(gold.idxmax())
    fell_at = next((i for i in range(len(gold)) if gold[i] <= gold[: i + 1].max() - GOLD_FALL), None)
    fired = alarm.fired
    return {
        "gold_start": float(gold.iloc[0]),
        "gold_peak": float(gold.iloc[peak]),
        "peak_step": int(history["step"][peak]),
        "gold_final": float(gold.iloc[-1]),
        "falls": bool(gold.iloc[-1] <= gold.max() - GOLD_FALL),
        "fall_step": int(history["step"][fell_at]) if fell_at is not None else -1,
        "last_step": int(history["step"].iloc[-1]),
        "alarm_step": fired.step if fired else -1,
        "gold_at_alarm": float(gold[history["step"] == fired.step].iloc[0]) if fired else float("nan"),
        "gold_if_stopped": float(gold[kept_index(alarm)]),  # what ppo.on_overoptimisation 'stop' would have kept
        "quiet": list(alarm.quiet),  # which evaluations' policies the guard may keep
        "reasons": "; ".join(fired.reasons) if fired else "",
    }
