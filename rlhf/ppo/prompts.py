"""The prompts of each PPO update: a seeded stream of shuffled passes over the prompt list."""

from __future__ import annotations

import functools
import random
from typing import NamedTuple

from torch import Tensor

from rlhf.rollout.batching import pad_left


@functools.lru_cache(maxsize=4)
def _pass_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


class PromptBatch(NamedTuple):
    ids: Tensor  # (b, p) left-padded
    mask: Tensor  # (b, p)
    indices: list[int]  # rows of the prompt list


def prompt_batch(
    prompt_ids: list[list[int]],
    update: int,
    batch_size: int,
    seed: int,
    pad_id: int,
    rank: int = 0,
    world_size: int = 1,
) -> PromptBatch:
    """Prompts of one update: a seeded stream of shuffled passes, so the data position is the update index.

    `batch_size` is the global batch; with `world_size` processes, rank r takes the r-th of `world_size` equal,
    disjoint slices of it (padded to its own longest prompt).
    """
    n = len(prompt_ids)
    indices = []
    for pos in range(update * batch_size, (update + 1) * batch_size):
        epoch, offset = divmod(pos, n)
        indices.append(_pass_order(n, seed, epoch)[offset])
    if world_size > 1:
        local = batch_size // world_size
        indices = indices[rank * local : (rank + 1) * local]
    ids, mask = pad_left([prompt_ids[i] for i in indices], pad_id)
    return PromptBatch(ids, mask, indices)
