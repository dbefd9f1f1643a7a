"""The prepared folder's files: fixed Parquet schemas, a seeded split, writing in bounded chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data import row_columns
from rlhf.errors import DataError

PAIR_SCHEMA = pa.schema(
    [
        ("prompt", pa.string()),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
        ("margin", pa.float64()),
        ("gold_chosen", pa.float64()),
        ("gold_rejected", pa.float64()),
    ]
)
SFT_SCHEMA = pa.schema([("prompt", pa.string()), ("response", pa.string())])
PROMPT_SCHEMA = pa.schema([("prompt", pa.string())])
PAIR_COLUMNS = PAIR_SCHEMA.names
CHUNK = 65_536  # rows gathered from the memory-mapped Arrow table at a time


def split_positions(
    kept: np.ndarray, eval_fraction: float, seed: int, prompt_keys: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded split of the kept positions into (train, eval), eval about round(n * fraction) (at least 1) pairs.

    With `prompt_keys` (one per kept position) the split is by prompt: the distinct prompts are shuffled and held
    out whole until the eval set is big enough, so no prompt has pairs on both sides (a ranked row or a prompt
    answered several times would otherwise leak into the held-out accuracy). Without: a shuffle of the pairs.
    """
    rng = np.random.default_rng(seed)
    n_eval = max(1, int(round(len(kept) * eval_fraction)))
    if len(kept) - n_eval < 1:
        raise DataError(f"only {len(kept)} usable pair(s) remain: too few to split off an eval set")
    if prompt_keys is None:
        order = rng.permutation(len(kept))
        return kept[order[n_eval:]], kept[order[:n_eval]]
    unique, group, counts = np.unique(prompt_keys, return_inverse=True, return_counts=True)
    prompt_order = rng.permutation(len(unique))  # the held-out prompts are a prefix of this order
    held = np.zeros(len(unique), dtype=bool)
    taken = np.searchsorted(np.cumsum(counts[prompt_order]), n_eval) + 1  # prompts until n_eval pairs are held
    held[prompt_order[:taken]] = True
    is_eval = held[group]
    if is_eval.all():
        raise DataError(
            f"the {len(kept)} usable pairs have {len(unique)} distinct prompt(s): too few to hold out whole prompts; "
            "give an eval split or file, or set data.split_by_prompt to false"
        )
    # each side in a seeded random order (the training file is written shuffled)
    train, evals = kept[~is_eval], kept[is_eval]
    return train[rng.permutation(len(train))], evals[rng.permutation(len(evals))]


def shuffled(kept: np.ndarray, seed: int) -> np.ndarray:
    """The kept positions in a seeded random order (the training file is written shuffled)."""
    return kept[np.random.default_rng(seed).permutation(len(kept))]


def first_prompt_positions(
    table: pa.Table, positions: np.ndarray, source: Any = None, columns: list[str] | None = None
) -> np.ndarray:
    """Positions of the first occurrence of each distinct prompt, in the order of `positions`; with `columns`
    (data.row_columns, of the `source` rows), of each distinct prompt and truth: a prompt asked with two truths is
    two rows."""
    keys = table.column("prompt_key").to_numpy()[positions]
    if columns:
        kept = source.select(table.column("row").to_numpy()[positions])
        texts = [row_columns.encode(kept[name]).to_pylist() for name in columns]
        keys = np.array([repr(row) for row in zip(keys.tolist(), *texts, strict=True)])
    return positions[np.sort(np.unique(keys, return_index=True)[1])]


def take_rows(table: pa.Table, batches: list[pa.RecordBatch], offsets: np.ndarray, positions: np.ndarray) -> pa.Table:
    """``table.take(positions)`` without materialising whole columns.

    (Arrow's take on a chunked column first concatenates every chunk, which would make memory grow with the data
    set; here each record batch is taken from separately and the small result is put back in order.)
    """
    which = np.searchsorted(offsets, positions, side="right") - 1  # record batch of each position
    order = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[order], np.arange(len(batches) + 1))
    parts = [
        batches[b].take(pa.array(positions[order[bounds[b] : bounds[b + 1]]] - offsets[b]))
        for b in range(len(batches))
        if bounds[b + 1] > bounds[b]
    ]
    grouped = pa.Table.from_batches(parts, schema=table.schema).combine_chunks()
    return grouped.take(pa.array(np.argsort(order, kind="stable")))  # (grouped order) -> (positions order)


def write_rows(
    table: pa.Table, positions: np.ndarray, path: Path, kind: str, source: Any = None, columns: list[str] | None = None
) -> int:
    """Write the rows at `positions` as a pairs ('pairs'), SFT ('sft') or prompts ('prompts') file, chunk by chunk.

    `columns` (data.row_columns) are taken from the `source` rows (a ``datasets.Dataset``) each kept row came from
    (the table's ``row``), JSON-encoded (``rlhf.data.row_columns``)."""
    columns = columns or []
    schema = row_columns.with_metadata(
        {"pairs": PAIR_SCHEMA, "sft": SFT_SCHEMA, "prompts": PROMPT_SCHEMA}[kind], columns
    )
    batches = table.to_batches()
    offsets = np.cumsum([0] + [len(b) for b in batches])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, len(positions), CHUNK):
            part = take_rows(table, batches, offsets, positions[start : start + CHUNK])
            if kind == "pairs":
                nulls = pa.nulls(len(part), pa.float64())
                arrays = [part["prompt"], part["chosen"], part["rejected"], part["margin"], nulls, nulls]
            elif kind == "sft":
                arrays = [part["prompt"], part["chosen"]]
            else:
                arrays = [part["prompt"]]
            if columns:
                kept = source.select(part["row"].to_numpy())
                arrays += [row_columns.encode(kept[name]) for name in columns]
            arrays = [a.cast(field.type) for a, field in zip(arrays, schema, strict=True)]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
    return len(positions)


def write_frame(frame: pd.DataFrame, path: Path, schema: pa.Schema) -> int:
    """Write a small in-memory frame (the synthetic task) with the same fixed schema."""
    pq.write_table(pa.Table.from_pandas(frame[schema.names], schema=schema, preserve_index=False), path)
    return len(frame)
