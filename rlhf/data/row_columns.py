"""A row's own truth, carried to its reward function: the data set's columns named by ``data.row_columns``.

A verifiable task keeps what a response is checked against in the row itself: IFEval's ``instruction_id_list``
and ``kwargs``, a math answer, unit tests. Preparation keeps the named columns beside every pair and prompt (each
value JSON-encoded in a string column of that name, so any nesting survives Parquet; the file's schema metadata
lists them), and a reward function receives them as keyword arguments, TRL's convention::

    def reward(prompts, completions, instruction_id_list, kwargs, **_): ...

A function that takes only ``(prompts, responses)`` is called as before. Values are looked up by the prompt's
rendered text, so every sample of a prompt gets that prompt's values whatever batch, group (GRPO's repeated
prompts) or resampling (dynamic sampling) it is scored in; a prompt's values are those of its first row.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data.sources import peek_columns
from rlhf.errors import ConfigError, DataError

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


def check_wanted(spec: str, fn: Callable, row_columns: list[str], key: str) -> None:
    """ConfigError (one sentence naming `key`) when the function at `key` takes a column that data.row_columns does
    not keep."""
    missing = [name for name in wanted_columns(fn).required if name not in row_columns]
    if missing:
        kept = ", ".join(row_columns) if row_columns else "none"
        raise ConfigError(
            f"{key}: {spec} takes the keyword argument '{missing[0]}', which names no column of data.row_columns "
            f"(kept: {kept}); add the data set's column to data.row_columns or remove the argument"
        )


def check_source_columns(names: list[str], available: list[str], label: str) -> None:
    """DataError naming the column and the file when a data.row_columns column is not in the source."""
    for name in names:
        if name not in available:
            raise DataError(
                f"data.row_columns: column '{name}' is not in {label} (found: {', '.join(available)}); a reward "
                "function that takes it needs it in every row"
            )


def check_files(names: list[str], paths: list[str | None], encoding: str = "utf-8") -> None:
    """`check_source_columns` on each local file whose columns are cheap to read (before anything else runs)."""
    for path in filter(None, paths):
        available = peek_columns(path, encoding) if names else None
        if available is not None:
            check_source_columns(names, available, str(path))


def check_rows(fn: Callable, names: list[str], rows: Any, label: str) -> None:
    """Every row's kept columns checked by `fn`'s own ``check_row(values, where)``, where it has one (IFEval's and
    IFBench's verifiers: known instruction ids, kwargs their checkers take); its DataError names the row."""
    check = getattr(fn, "check_row", None)
    if check is not None:
        for row, values in enumerate(rows.select_columns(names)):
            check(values, f"row {row} of {label}")


def encode(values: list[Any]) -> pa.Array:
    """A column's values as JSON strings (None stays null)."""
    return pa.array([None if v is None else json.dumps(v, default=_plain) for v in values], pa.string())


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (what Arrow hands back for lists) as plain Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a value of type {type(value).__name__} cannot be kept in a row column")


def with_metadata(schema: pa.Schema, names: list[str]) -> pa.Schema:
    """`schema` plus a string column per row column, listed in the schema metadata."""
    for name in names:
        schema = schema.append(pa.field(name, pa.string()))
    return schema.with_metadata({SCHEMA_KEY: json.dumps(names).encode()}) if names else schema


def file_columns(path: str | Path) -> list[str]:
    """The row columns a prepared Parquet file carries (none for files written without them)."""
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[SCHEMA_KEY]) if SCHEMA_KEY in metadata else []


def _key(prompt: str) -> bytes:
    return hashlib.blake2b(prompt.encode(), digest_size=12).digest()


class RowColumns:
    """The row columns of prepared files, looked up by a prompt's text: `values(prompts, names)` gives each
    prompt's decoded values, one list per column, in the prompts' order."""

    def __init__(self, names: list[str], rows: dict[bytes, list[str | None]], label: str) -> None:
        self.names = names
        self._rows = rows  # prompt key -> the JSON text of each column, in `names` order
        self.label = label

    @classmethod
    def read(cls, *paths: str | Path) -> RowColumns | None:
        """The row columns of prepared Parquet files (a prompt's values: those of its first row, first file first);
        None when they carry none."""
        names: list[str] = []
        rows: dict[bytes, list[str | None]] = {}
        files = [Path(p) for p in paths if p and Path(p).is_file()]
        for path in files:
            columns = file_columns(path)
            if not columns:
                continue
            names = names or columns
            table = pq.read_table(path, columns=["prompt", *names])
            texts = [table.column(name).to_pylist() for name in names]
            for i, prompt in enumerate(table.column("prompt").to_pylist()):
                rows.setdefault(_key(prompt), [column[i] for column in texts])
        return cls(names, rows, " and ".join(str(p) for p in files)) if names else None

    def values(self, prompts: list[str], names: list[str]) -> dict[str, list[Any]]:
        """Each of `names`' values for each prompt. DataError (naming the prompt) for a prompt no row has."""
        positions = [self.names.index(name) for name in names]
        out: dict[str, list[Any]] = {name: [] for name in names}
        for prompt in prompts:
            row = self._rows.get(_key(prompt))
            if row is None:
                clipped = prompt if len(prompt) <= 60 else prompt[:57] + "..."
                raise DataError(f"the prompt {clipped!r} has no row in {self.label}: its row columns are unknown")
            for name, pos in zip(names, positions, strict=True):
                out[name].append(None if row[pos] is None else json.loads(row[pos]))
        return out
