"""Score shaping and per-token rewards (Ziegler et al. 2019; Huang et al. 2024, details 4 and 5)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rlhf.ops.kl import kl_per_token

PENALTY_MODES: tuple[str, ...] = ("subtract", "replace")


class ShapedScores(NamedTuple):
    scores: Tensor  # (b,) shaped scores
    missing_eos: Tensor  # (b,) bool, the response has no stop token (EOS by default)
    too_short: Tensor  # (b,) bool, the response is shorter than min_length (all False without min_length)


class TokenRewards(NamedTuple):
    rewards: Tensor  # (b, t) non_score_rewards plus the score at the last real token
    non_score_rewards: Tensor  # (b, t) -kl_coef * kl
    kl: Tensor  # (b, t) per-token KL estimate, 0 at padding


def _apply_penalty(scores: Tensor, flag: Tensor, penalty: float | None, mode: str) -> Tensor:
    if penalty is None:
        return scores
    if mode == "subtract":
        return torch.where(flag, scores - penalty, scores)
    return torch.where(flag, torch.full_like(scores, penalty), scores)


def shape_scores(
    scores: Tensor,
    response_lengths: Tensor,
    contains_stop: Tensor,
    *,
    clip: float | None = None,
    missing_eos_penalty: float | None = None,
    missing_eos_mode: str = "subtract",
    min_length: int | None = None,
    min_length_penalty: float | None = None,
    min_length_mode: str = "subtract",
    overlong_max_length: int | None = None,
    overlong_buffer: int | None = None,
    overlong_factor: float = 1.0,
) -> ShapedScores:
    """Shape reward-model scores before they become rewards.

    In order: clip to ``[-clip, clip]``; then for responses without a stop token, ``"subtract"`` gives
    ``score - missing_eos_penalty`` and ``"replace"`` sets the score to ``missing_eos_penalty`` as given (e.g.
    ``-1.0``); then likewise for responses with ``length < min_length`` (so with both in ``"replace"`` mode the
    length penalty wins); then DAPO's soft overlong penalty (``overlong_penalty``) is added when
    ``overlong_buffer`` is given. A penalty of ``None`` changes nothing; the flags are returned either way.

    Shape: scores, response_lengths and contains_stop (b,); outputs (b,).
    """
    for name, mode in (("missing_eos_mode", missing_eos_mode), ("min_length_mode", min_length_mode)):
        if mode not in PENALTY_MODES:
            raise ValueError(f"Unknown {name} {mode!r}; allowed values are {', '.join(PENALTY_MODES)}.")
    if clip is not None and clip <= 0:
        raise ValueError(f"Score clip must be positive, got {clip}.")

    missing_eos = ~contains_stop.bool()
    if min_length is None:
        too_short = torch.zeros_like(missing_eos)
    else:
        too_short = response_lengths < min_length

    shaped = scores if clip is None else scores.clamp(-clip, clip)
    shaped = _apply_penalty(shaped, missing_eos, missing_eos_penalty, missing_eos_mode)
    shaped = _apply_penalty(shaped, too_short, min_length_penalty, min_length_mode)
    if overlong_buffer is not None:
        if overlong_max_length is None:
            raise ValueError("the overlong penalty needs overlong_max_length (the generation's max_new_tokens)")
        lengths = response_lengths.to(shaped.dtype)
        shaped = shaped + overlong_penalty(lengths, overlong_max_length, overlong_buffer, overlong_factor)
    return ShapedScores(scores=shaped, missing_eos=missing_eos, too_short=too_short)


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times ``factor`` (veRL's ``penalty_factor``).

    With ``L_max = max_length`` and ``L_cache = buffer``: 0 up to ``L_max - L_cache`` tokens, then falling linearly,
    ``((L_max - L_cache) - |y|) / L_cache``, to -1 at ``L_max``, and -1 beyond (a response cut at max_new_tokens is
    at most ``L_max`` long here, so -1 is the floor). Added to the score.

    >>> overlong_penalty(torch.tensor([10.0, 20.0, 22.0, 24.0]), max_length=24, buffer=4)
    tensor([ 0.0000,  0.0000, -0.5000, -1.0000])

    Shape: lengths (b,) -> (b,).
    """
    if buffer < 1 or buffer > max_length:
        raise ValueError(f"the overlong buffer must be 1 to max_length ({max_length}) tokens, got {buffer}")
    over = (lengths.to(torch.get_default_dtype()) - (max_length - buffer)).clamp(min=0.0) / buffer
    return -factor * over.clamp(max=1.0)


def per_token_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> TokenRewards:
    """Per-token rewards: ``-kl_coef * kl_t`` at every response token plus the score at the last real token.

    The last real token of a row is the highest position where ``response_mask`` is 1 (``mask.sum(1) - 1`` for
    right-padded rows). Every row is expected to hold at least one real token; a row with none gets no score and
    stays all zeros. Padded positions are 0 in all three outputs, whatever the log-probs hold there.

    Shape: scores (b,); logprobs, ref_logprobs and response_mask (b, t); outputs (b, t).
    """
    m = response_mask.to(logprobs.dtype)
    real = m != 0
    kl = kl_per_token(logprobs, ref_logprobs, estimator)
    kl = torch.where(real, kl * m, torch.zeros_like(kl))
    non_score_rewards = -kl_coef * kl

    positions = torch.arange(m.shape[1], device=m.device).expand_as(m)  # (t,) -> (b, t)
    last = torch.where(real, positions, torch.zeros_like(positions)).amax(dim=1)  # (b,)
    has_token = real.any(dim=1).to(logprobs.dtype)  # (b,)
    rewards = non_score_rewards.clone()
    rows = torch.arange(m.shape[0], device=m.device)
    rewards[rows, last] += scores.to(rewards.dtype) * has_token
    return TokenRewards(rewards=rewards, non_score_rewards=non_score_rewards, kl=kl)


ENSEMBLE_OBJECTIVES: tuple[str, ...] = ("mean", "uwo", "wco")


def ensemble_scores(member_scores: Tensor, objective: str = "mean", uncertainty_coef: float = 0.0) -> Tensor:
    """One score per response from the scores of K reward models (Coste et al. 2023, "Reward Model Ensembles Help
    Mitigate Overoptimization", section 3).

    'mean': the members' mean. 'uwo' (uncertainty-weighted optimisation): the mean minus ``uncertainty_coef`` times
    the members' variance (the population variance, divided by K, as in the paper's eq. 3). 'wco' (worst-case
    optimisation): the members' minimum. With K = 1 every objective is that member's score.

    Shape: member_scores (K, b) -> (b,).
    """
    if objective not in ENSEMBLE_OBJECTIVES:
        raise ValueError(f"unknown ensemble objective {objective!r}: use one of {', '.join(ENSEMBLE_OBJECTIVES)}")
    if objective == "wco":
        return member_scores.min(dim=0).values
    mean = member_scores.mean(dim=0)
    if objective == "uwo":
        return mean - uncertainty_coef * member_scores.var(dim=0, unbiased=False)
    return mean
