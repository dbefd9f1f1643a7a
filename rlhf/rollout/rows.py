"""A prompt row's key and its own truth: the data set's columns named by ``data.row_columns``, by row, for the reward
functions that take them.

A verifiable task keeps what a response is checked against in the row itself: IFEval's ``instruction_id_list``
and ``kwargs``, a math answer, unit tests. Preparation (``rlhf.data.row_columns``) keeps the named columns beside
every pair and prompt (each value JSON-encoded in a string column of that name, so any nesting survives Parquet; the
file's schema metadata lists them), and a reward function receives them as keyword arguments, TRL's convention::

    def reward(prompts, completions, instruction_id_list, kwargs, **_): ...

A function that takes only ``(prompts, responses)`` is called as before. Every prompt row has a key, `row_key`: the
digest of its prompt and its kept columns as preparation wrote them, the same in every prepared file and run. The
key travels with the row (`PromptRows`; a PPO batch's rows of the prompt list), through groups, dynamic sampling and
the evaluations, and its columns are looked up by it (`RowColumns`), as veRL carries ``ground_truth`` with each
sample: two rows with the same prompt and different truths are two rows, each scored against its own.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.parquet as pq

from rlhf.errors import DataError

SCHEMA_KEY = b"rlhf.row_columns"  # Parquet schema metadata: the JSON list of a file's row columns
RESPONSE_ARGS = 2  # (prompts, responses): the positional arguments every reward function takes first


class WantedColumns(NamedTuple):
    """The columns a reward function takes: `named` keyword parameters (`required` ones have no default), and
    whether it takes every column (`**kwargs`)."""

    named: tuple[str, ...]
    required: tuple[str, ...]
    takes_all: bool

    def of(self, available: Iterable[str]) -> list[str]:
        """The columns of `available` to pass: all with ``**kwargs``, else the named ones there are."""
        available = list(available)
        return available if self.takes_all else [name for name in self.named if name in available]


def wanted_columns(fn: Callable) -> WantedColumns:
    """The data columns `fn` takes beyond its first two positional arguments (prompts, responses)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return WantedColumns((), (), False)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = positional[RESPONSE_ARGS:] + [p for p in params if p.kind == p.KEYWORD_ONLY]
    named = tuple(p.name for p in rest)
    required = tuple(p.name for p in rest if p.default is p.empty)
    return WantedColumns(named, required, any(p.kind == p.VAR_KEYWORD for p in params))


def file_columns(path: str | Path) -> list[str]:
    """The row columns a prepared Parquet file carries (none for files written without them)."""
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[SCHEMA_KEY]) if SCHEMA_KEY in metadata else []


def row_key(prompt: str, texts: Sequence[str | None] = ()) -> str:
    """A row's key: the digest of its prompt and its row columns' JSON texts (none: the prompt's alone)."""
    return hashlib.blake2b(json.dumps([prompt, *texts]).encode(), digest_size=12).hexdigest()


def _read(path: str | Path) -> tuple[list[str], list[str], list[list[str | None]]]:
    """A prepared Parquet file's prompts, its row columns, and each row's JSON texts of them."""
    names = file_columns(path)
    table = pq.read_table(path, columns=["prompt", *names])
    prompts = [str(p) for p in table.column("prompt").to_pylist()]
    columns = [table.column(name).to_pylist() for name in names]
    return prompts, names, [list(texts) for texts in zip(*columns, strict=True)] if names else [[] for _ in prompts]


class PromptRows(NamedTuple):
    """Prompts and their rows' keys (`row_key`), in the same order."""

    prompts: list[str]
    keys: list[str]

    @classmethod
    def read(cls, path: str | Path) -> PromptRows:
        """Every row of a prepared Parquet file (a 'prompt' column and its row columns), in file order."""
        prompts, _, texts = _read(path)
        return cls(prompts, [row_key(prompt, row) for prompt, row in zip(prompts, texts, strict=True)])

    def distinct(self, n: int | None = None) -> PromptRows:
        """The first row of each key, in order; the first `n` of them (None: all)."""
        first: dict[str, int] = {}
        for i, key in enumerate(self.keys):
            first.setdefault(key, i)
        kept = list(first.values())[:n]
        return PromptRows([self.prompts[i] for i in kept], [self.keys[i] for i in kept])


class RowColumns:
    """The row columns of prepared files by row key: `values(keys, names)` gives each row's decoded values, one list
    per column, in the keys' order."""

    def __init__(self, names: list[str], rows: dict[str, list[str | None]], label: str) -> None:
        self.names = names
        self._rows = rows  # row key -> the JSON text of each column, in `names` order
        self.label = label

    @classmethod
    def read(cls, *paths: str | Path) -> RowColumns | None:
        """The row columns of prepared Parquet files; None when they carry none."""
        names: list[str] = []
        rows: dict[str, list[str | None]] = {}
        files = [Path(p) for p in paths if p and Path(p).is_file()]
        for path in files:
            prompts, columns, texts = _read(path)
            names = names or columns
            rows.update({row_key(prompt, row): row for prompt, row in zip(prompts, texts, strict=True) if row})
        return cls(names, rows, " and ".join(str(p) for p in files)) if names else None

    def values(self, keys: list[str], names: list[str]) -> dict[str, list[Any]]:
        """Each of `names`' values for each row key. DataError (naming the key) for a key no row has."""
        positions = [self.names.index(name) for name in names]
        out: dict[str, list[Any]] = {name: [] for name in names}
        for key in keys:
            row = self._rows.get(key)
            if row is None:
                raise DataError(f"the row {key!r} is not in {self.label}: its row columns are unknown")
            for name, pos in zip(names, positions, strict=True):
                out[name].append(None if row[pos] is None else json.loads(row[pos]))
        return out
