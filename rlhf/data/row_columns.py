"""data.row_columns at preparation: the named columns checked in the source and kept beside every pair and prompt
(each value JSON-encoded in a string column of that name, so any nesting survives Parquet; the file's schema metadata
lists them). Their reading, by row key, is ``rlhf.rollout.rows``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from rlhf.data.sources import peek_columns
from rlhf.errors import ConfigError, DataError
from rlhf.rollout.rows import SCHEMA_KEY, wanted_columns


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
