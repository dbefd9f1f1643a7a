"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2): a group whose samples all get the same score has zero
advantage and teaches nothing, so it is dropped and the batch is refilled with groups of new prompts.

`refill` takes the update's first rollout and a function that samples and scores one more batch of new prompts. It
keeps the groups whose shaped scores differ, in order, and asks for another batch while fewer than the batch's
groups are kept, up to ppo.dynamic_sampling_rounds extra rounds (with several processes, every rank takes as many
rounds as the one that needs most, so that sharded generation stays in step). What is still missing after the last
round is filled with dropped groups, so the batch keeps its size (veRL stops with an error there instead). The rows
come together with `merge_scored`, padded to the widest prompt and response.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf.config import PPOConfig
from rlhf.ppo.distributed import DistContext, all_reduce_mean
from rlhf.ppo.update import Rollout, shaped_scores
from rlhf.rollout.generation import Responses
from rlhf.rollout.scoring import ScoredResponses


def informative_groups(scores: Tensor, group_size: int) -> Tensor:
    """Which groups of `group_size` contiguous scores are not all equal (exactly). Shape: (b,) -> (b / G,) bool."""
    grouped = scores.reshape(-1, group_size)
    return grouped.amax(dim=1) != grouped.amin(dim=1)


def _pad(x: Tensor, width: int, value: float | int, left: bool = False) -> Tensor:
    """`x` (b, w) padded to (b, width) with `value`, on the right (or the left)."""
    missing = width - x.shape[1]
    if missing <= 0:
        return x
    fill = torch.full((x.shape[0], missing), value, dtype=x.dtype, device=x.device)
    return torch.cat([fill, x] if left else [x, fill], dim=1)


def merge_scored(parts: list[ScoredResponses], rows: list[Tensor], pad_id: int) -> ScoredResponses:
    """The rows `rows[i]` of each `parts[i]`, in order, as one batch: prompts left-padded to the widest prompt,
    responses right-padded to the widest response (padding: `pad_id`, mask 0, log-probs and values 0), timings
    summed over the parts."""
    width_p = max(part.prompt_len for part in parts)
    width_r = max(part.resp.tokens.shape[1] for part in parts)
    pieces: dict[str, list[Tensor]] = {}

    def add(name: str, value: Tensor | None) -> None:
        if value is not None:
            pieces.setdefault(name, []).append(value)

    for part, idx in zip(parts, rows, strict=True):
        p = part.prompt_len
        prompt_ids = _pad(part.query_responses[idx, :p], width_p, pad_id, left=True)
        prompt_mask = _pad(part.qr_mask[idx, :p], width_p, 0, left=True)
        add("query_responses", torch.cat([prompt_ids, _pad(part.query_responses[idx, p:], width_r, pad_id)], 1))
        add("qr_mask", torch.cat([prompt_mask, _pad(part.qr_mask[idx, p:], width_r, 0)], 1))
        add("tokens", _pad(part.resp.tokens[idx], width_r, pad_id))
        add("mask", _pad(part.resp.mask[idx], width_r, 0))
        add("contains_stop", part.resp.contains_stop[idx])
        add("logprobs", _pad(part.logprobs[idx], width_r, 0.0))
        add("ref_logprobs", _pad(part.ref_logprobs[idx], width_r, 0.0))
        add("values", None if part.values is None else _pad(part.values[idx], width_r, 0.0))
        add("scores", part.scores[idx])
        add("member_scores", None if part.member_scores is None else part.member_scores[:, idx])
        add("function_scores", None if part.function_scores is None else part.function_scores[:, idx])
    timings: dict[str, float] = {}
    for part in parts:
        for key, seconds in part.timings.items():
            timings[key] = timings.get(key, 0.0) + seconds
    by_row = ("member_scores", "function_scores")  # (K, b) and (F, b): rows are the second dimension
    cat = {name: torch.cat(values, dim=1 if name in by_row else 0) for name, values in pieces.items()}
    return ScoredResponses(
        cat["query_responses"],
        cat["qr_mask"],
        width_p,
        Responses(cat["tokens"], cat["mask"], cat["contains_stop"]),
        cat["logprobs"],
        cat["ref_logprobs"],
        cat.get("values"),
        cat["scores"],
        timings,
        cat.get("member_scores"),
        cat.get("function_scores"),
    )


def refill(
    first: Rollout, more: Callable[[int], Rollout], cfg: PPOConfig, pad_id: int, dist: DistContext | None = None
) -> tuple[Rollout, dict[str, float]]:
    """The update's batch after dynamic sampling, and its statistics: `more(k)` samples and scores the k-th extra
    batch (k = 1, 2, ...) of new prompts. The statistics are global counts (with several processes each rank's are
    multiplied by the world size, so that the mean over ranks, `rlhf.ppo.distributed.reduce_stats`, is the sum)."""
    group = cfg.samples_per_prompt
    world = dist.world_size if dist is not None else 1
    wanted = len(first.indices) // group  # this rank's groups
    parts = [first]
    kept: list[tuple[int, int]] = []  # (part, group) in order of sampling
    dropped: list[tuple[int, int]] = []

    def sort(part: int, rollout: Rollout) -> None:
        flags = informative_groups(shaped_scores(rollout.scored, cfg).scores, group).tolist()
        for g, informative in enumerate(flags):
            (kept if informative else dropped).append((part, g))

    sort(0, first)
    rounds = 0
    while rounds < cfg.dynamic_rounds and _any_rank(len(kept) < wanted, world, first.mask.device):
        rounds += 1
        parts.append(more(rounds))
        sort(rounds, parts[-1])
    chosen = (kept + dropped)[:wanted]
    rows: list[list[int]] = [[] for _ in parts]
    for part, g in chosen:
        rows[part].extend(range(g * group, (g + 1) * group))
    used = [i for i, r in enumerate(rows) if r]
    device = first.mask.device
    scored = merge_scored(
        [parts[i].scored for i in used], [torch.tensor(rows[i], dtype=torch.long, device=device) for i in used], pad_id
    )
    indices = [parts[i].indices[row] for i in used for row in rows[i]]
    stats = {
        "dynamic_sampling/dropped_groups": float(len(dropped) * world),
        "dynamic_sampling/filled_groups": float(max(0, wanted - len(kept)) * world),
        "dynamic_sampling/extra_rounds": float(rounds),
        "dynamic_sampling/generated_episodes": float(len(parts) * len(first.indices) * world),
    }
    return Rollout(indices, scored), stats


def _any_rank(flag: bool, world_size: int, device: torch.device) -> bool:
    """Whether `flag` holds on any rank (every rank gets the same answer)."""
    if world_size == 1:
        return flag
    return float(all_reduce_mean(torch.tensor([float(flag)], device=device))) > 0
