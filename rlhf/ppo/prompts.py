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
    samples_per_prompt: int = 1,
) -> PromptBatch:
    """Prompts of one update: a seeded stream of shuffled passes, so the data position is the update index.

    `batch_size` is the global batch of episodes: batch_size / `samples_per_prompt` prompts of the stream, each
    repeated `samples_per_prompt` times in a row (a group: rows g*G .. g*G + G - 1). With `world_size` processes,
    rank r takes the r-th of `world_size` equal, disjoint slices of it (padded to its own longest prompt), whole
    groups each (`rlhf.ppo.distributed.check_world_size`).
    """
    n = len(prompt_ids)
    prompts_per_batch = batch_size // samples_per_prompt
    indices = []
    for pos in range(update * prompts_per_batch, (update + 1) * prompts_per_batch):
        epoch, offset = divmod(pos, n)
        indices.extend([_pass_order(n, seed, epoch)[offset]] * samples_per_prompt)
    if world_size > 1:
        local = batch_size // world_size
        indices = indices[rank * local : (rank + 1) * local]
    ids, mask = pad_left([prompt_ids[i] for i in indices], pad_id)
    return PromptBatch(ids, mask, indices)
