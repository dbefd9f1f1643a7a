"""DAPO's dynamic sampling: which groups are dropped, how the batch is refilled and merged, what it reports."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import PPOConfig
from rlhf.ppo.dynamic_sampling import informative_groups, merge_scored, refill
from rlhf.ppo.update import Rollout
from rlhf.rollout.generation import Responses
from rlhf.rollout.scoring import ScoredResponses

PAD = 0


def _scored(prompt_lens: list[int], resp_lens: list[int], scores: list[float], base: int) -> ScoredResponses:
    """A batch whose prompt token i of row j is base + 10 j + i and response tokens base + 10 j + 5 + i, left-padded
    prompts and right-padded responses, log-probs -(row + 1) / 10 at real response tokens."""
    p, r = max(prompt_lens), max(resp_lens)
    b = len(scores)
    qr = torch.full((b, p + r), PAD)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    logprobs = torch.zeros(b, r)
    for j, (pl, rl) in enumerate(zip(prompt_lens, resp_lens, strict=True)):
        qr[j, p - pl : p] = base + 10 * j + torch.arange(pl)
        qr[j, p : p + rl] = base + 10 * j + 5 + torch.arange(rl)
        mask[j, p - pl : p + rl] = 1
        logprobs[j, :rl] = -(j + 1) / 10
    resp = Responses(qr[:, p:], mask[:, p:], torch.tensor([rl < r for rl in resp_lens]))
    return ScoredResponses(
        qr, mask, p, resp, logprobs, logprobs * 2, None, torch.tensor(scores), {"time/generate": 1.0}, None
    )


def _cfg(**kw) -> PPOConfig:
    base = dict(
        advantage_estimator="dapo",
        samples_per_prompt=2,
        batch_size=4,
        num_mini_batches=1,
        total_episodes=4,
        missing_eos_penalty=None,
        overlong_buffer=0,
        max_new_tokens=4,
    )
    return PPOConfig(**{**base, **kw})


def test_informative_groups_by_hand() -> None:
    flags = informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, -2.0, -2.0]), 2)
    assert flags.tolist() == [False, True, False]


def test_merged_rows_keep_their_tokens_and_pad_to_the_widest() -> None:
    a = _scored([2, 1], [3, 1], [0.1, 0.2], base=100)
    b = _scored([4, 3], [2, 2], [0.3, 0.4], base=200)
    merged = merge_scored([a, b], [torch.tensor([1]), torch.tensor([0, 1])], PAD)
    assert merged.prompt_len == 4 and merged.resp.tokens.shape == (3, 3)
    assert merged.scores.tolist() == pytest.approx([0.2, 0.3, 0.4])
    # each row's real tokens, in order, are those of its source row
    for row, (source, j) in enumerate([(a, 1), (b, 0), (b, 1)]):
        real = merged.query_responses[row][merged.qr_mask[row].bool()]
        assert real.tolist() == source.query_responses[j][source.qr_mask[j].bool()].tolist()
        n = int(source.resp.mask[j].sum())
        assert merged.resp.mask[row].tolist() == [1] * n + [0] * (3 - n)
        assert merged.logprobs[row, :n].tolist() == source.logprobs[j, :n].tolist()
        assert (merged.logprobs[row, n:] == 0).all()
    # the prompt part is left-padded, the response part right-padded
    assert merged.qr_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert merged.timings == {"time/generate": 2.0}


def test_refill_keeps_groups_with_spread_and_stops_once_full() -> None:
    # the first batch: group 0 ties (dropped), group 1 has spread
    first = Rollout([0, 0, 1, 1], _scored([1] * 4, [2] * 4, [1.0, 1.0, 0.0, 1.0], base=100))
    asked = []

    def more(k: int) -> Rollout:
        asked.append(k)
        scores = {1: [5.0, 5.0, 2.0, 3.0], 2: [0.0, 9.0, 1.0, 1.0]}[k]  # round 1: one good group, round 2 not needed
        return Rollout([10 * k, 10 * k, 10 * k + 1, 10 * k + 1], _scored([1] * 4, [2] * 4, scores, base=100 * k))

    rollout, stats = refill(first, more, _cfg(dynamic_sampling_rounds=3), PAD)
    assert asked == [1]  # full after one extra round
    assert rollout.indices == [1, 1, 11, 11]
    assert rollout.scored.scores.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert stats == {
        "dynamic_sampling/dropped_groups": 2.0,  # first batch's group 0, round 1's group 0
        "dynamic_sampling/filled_groups": 0.0,
        "dynamic_sampling/extra_rounds": 1.0,
        "dynamic_sampling/generated_episodes": 8.0,
    }


def test_refill_fills_with_dropped_groups_after_the_last_round() -> None:
    first = Rollout([0, 0, 1, 1], _scored([1] * 4, [2] * 4, [1.0, 1.0, 2.0, 2.0], base=100))
    more = lambda k: Rollout([7, 7, 8, 8], _scored([1] * 4, [2] * 4, [3.0, 3.0, 4.0, 5.0], base=100 * k))  # noqa: E731
    rollout, stats = refill(first, more, _cfg(dynamic_sampling_rounds=1), PAD)
    # one group with spread (round 1's second) and the first dropped one, in the order they were sampled
    assert rollout.indices == [0, 0, 8, 8]
    assert stats["dynamic_sampling/filled_groups"] == 1.0 and stats["dynamic_sampling/extra_rounds"] == 1.0
    assert stats["dynamic_sampling/dropped_groups"] == 3.0


def test_refill_drops_on_shaped_scores() -> None:
    # different raw scores, but both responses miss their stop token and 'replace' sets both to -1: no spread
    first = Rollout([0, 0, 1, 1], _scored([1] * 4, [4] * 4, [0.5, 0.7, 0.1, 0.2], base=100))
    cfg = _cfg(dynamic_sampling_rounds=0, missing_eos_penalty=-1.0, missing_eos_mode="replace")
    _, stats = refill(first, lambda k: first, cfg, PAD)
    assert stats["dynamic_sampling/dropped_groups"] == 2.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (dict(advantage_estimator="gae"), ("PPO", 0.2, 0.2, "reward", "token_mean", "n/a", 0, 0)),
        (dict(advantage_estimator="grpo"), ("GRPO", 0.2, 0.2, "loss", "seq_mean_token_mean", "group", 0, 0)),
        (dict(advantage_estimator="dapo"), ("DAPO", 0.2, 0.28, "loss", "token_mean", "group", 3, 1)),
        (
            dict(advantage_estimator="grpo", importance_sampling_level="sequence"),
            ("GSPO", 3e-4, 4e-4, "loss", "seq_mean_token_mean", "group", 0, 0),
        ),
        (
            dict(advantage_estimator="rloo", importance_sampling_level="sequence_sum"),
            ("RLOO (sequence)", 0.2, 0.2, "reward", "token_mean", "n/a", 0, 0),
        ),
        (
            dict(advantage_estimator="dapo", cliprange=0.1, dynamic_sampling_rounds=0, scale_rewards="batch"),
            ("DAPO", 0.1, 0.28, "loss", "token_mean", "batch", 0, 1),
        ),
    ],
)
def test_each_objective_resolves_its_papers_defaults(overrides, expected) -> None:
    cfg = _cfg(**{"samples_per_prompt": 2, "overlong_buffer": None, **overrides})
    got = cfg.resolved()
    keys = ("objective", "cliprange_resolved", "cliprange_high_resolved", "kl_in_resolved")
    keys += ("loss_aggregation_resolved", "scale_rewards_resolved", "dynamic_sampling_rounds_resolved")
    keys += ("overlong_buffer_resolved",)  # dapo: a fifth of max_new_tokens 4, at least one token
    assert tuple(got[k] for k in keys) == pytest.approx(expected)
