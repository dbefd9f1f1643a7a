"""Which rows and columns each no-grad forward of a scored batch takes: the rows of each policy and reference forward
(`forward_rows`) and the columns some rows use (`used_columns`), so that the rollout's forwards and the optimisation's
first policy forwards see the same rows, columns and threads (docs/models.md, "The same rows, columns and threads")."""

from __future__ import annotations

import torch
from torch import Tensor


def used_columns(qr_mask: Tensor, prompt_len: int, response_mask: Tensor) -> tuple[int, int]:
    """(lead, r) of some rows of a scored batch: the first prompt column any of them uses and their longest response
    (at least 1). Their tensors without the columns that are padding in every one of them (left padding before
    `lead`, response columns past `r`) are `[:, lead : prompt_len + r]`, their prompt `prompt_len - lead` long: the
    same values at every real position, less work. Shape: qr_mask (m, p + R), response_mask (m, R)."""
    used_prompt = qr_mask[:, :prompt_len].any(0)
    lead = int(used_prompt.int().argmax()) if bool(used_prompt.any()) else 0
    return lead, max(1, int(response_mask.sum(1).max()))


def forward_rows(n: int, groups: list[Tensor] | None, forward_batch_size: int | None) -> list[Tensor]:
    """The rows of each no-grad policy and reference forward: `groups` (the optimisation's first epoch's, where it
    is known), else consecutive rows; at most `forward_batch_size` rows a forward (None: no limit)."""
    if groups is None:
        groups = [torch.arange(n)]
    return [piece for rows in groups for piece in (rows.split(forward_batch_size) if forward_batch_size else (rows,))]
