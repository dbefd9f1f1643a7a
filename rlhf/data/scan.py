"""A local data file read through once before it is loaded, so that a bad byte, line or number is one sentence that
names the file and the line (or byte offset), instead of a library error from deep inside ``datasets`` or pyarrow.

- Text files (JSONL, JSON, CSV; compressed ones decompressed on the fly): every line must decode in
  ``data.encoding`` (UTF-8 unless set; a UTF-8 byte-order mark is skipped, as ``datasets`` does). A byte that does not
  decode names its offset (in the decompressed text, for a compressed file) and line, and says to re-encode the file
  or set ``data.encoding``. A compressed file that ends early (a download cut short) is named as such.
- With ``parse``: every line of a JSON-lines file must be one JSON object (the first one that is not is named by its
  line number); a JSON file must parse (the line and column of the error); a CSV file must have the header's number of
  fields on every line (pandas names the line).
- Parquet: the footer must be readable (a file cut short has none).
- With ``numeric`` columns (the score and margin columns of the source's format): the rows where one of them is NaN or
  infinite are counted, with the first such line. Preparation drops those rows (``not_finite``); `check_not_finite`
  refuses the file at once when they alone are more than ``data.max_drop_fraction`` of the rows.

Preflight reads files up to `PREFLIGHT_SCAN_BYTES` this way (seconds at most); preparation checks the encoding of
larger ones before loading them, and reads a file through again to name the line when ``datasets`` cannot load it.
"""

from __future__ import annotations

import codecs
import json
import lzma
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from rlhf.data.files import file_kind, open_bytes
from rlhf.errors import DataError

PREFLIGHT_SCAN_BYTES = 64 << 20  # preflight reads local data files through up to this size on disk
UTF8_BOM = b"\xef\xbb\xbf"
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
JSON_LINES = (".jsonl", ".ndjson")


class Scan(NamedTuple):
    """What a read through found: the rows, and those with a NaN or infinite value in a numeric column."""

    rows: int | None = None  # None: not counted (a JSON document of columns, an encoding check)
    not_finite: int = 0
    first_not_finite: str | None = None  # "line 12 (column 'margin')"


def _ascii_compatible(encoding: str) -> bool:
    """Whether bytes of `encoding` can be split into lines at b'\\n' (UTF-8, Latin-1, cp1252, ...; not UTF-16)."""
    try:
        return "\n{}".encode(encoding) == b"\n{}" and codecs.lookup(encoding).name not in ("utf-7",)
    except (LookupError, UnicodeError):
        return False


def _not_encoded(
    key: str, path: Path, encoding: str, offset: int, line: int | None, byte: int, compressed: bool
) -> str:
    where = f"byte offset {offset}" + (" of the decompressed text" if compressed else "")
    where += f" (line {line})" if line is not None else ""
    utf8 = codecs.lookup(encoding).name == "utf-8"
    name = "UTF-8" if utf8 else encoding
    hint = (
        "re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or set data.encoding to its encoding (e.g. latin-1, "
        "cp1252)"
        if utf8
        else "re-encode it, or set data.encoding to the encoding it was written in"
    )
    return f"{key}: {path} is not {name} text: byte 0x{byte:02x} at {where} cannot be decoded; {hint}"


def _decoded_lines(f, key: str, path: Path, encoding: str, compressed: bool) -> Iterator[tuple[int, str]]:
    """(line number, text) of an open binary file in an encoding that is not ASCII-compatible (UTF-16, ...): decoded
    in chunks of 1 MiB, then split into lines; one DataError sentence for a byte that does not decode."""
    decoder = codecs.getincrementaldecoder(encoding)(errors="strict")
    offset, pending, number = 0, "", 0
    for chunk in iter(lambda: f.read(1 << 20), b""):
        buffered = len(decoder.getstate()[0])
        try:
            pending += decoder.decode(chunk)
        except UnicodeDecodeError as err:
            at = offset - buffered + err.start
            raise DataError(_not_encoded(key, path, encoding, at, None, err.object[err.start], compressed)) from None
        offset += len(chunk)
        *complete, pending = pending.split("\n")
        for text in complete:
            number += 1
            yield number, text + "\n"
    try:
        pending += decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise DataError(_not_encoded(key, path, encoding, offset, None, err.object[err.start], compressed)) from None
    if pending:
        yield number + 1, pending


def _lines(key: str, path: Path, compression: str | None, encoding: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of a text file, decoded in `encoding`; one DataError sentence for a byte
    that does not decode or a compressed stream that cannot be read to its end."""

    compressed = compression is not None
    try:
        with open_bytes(path, compression) as f:
            head = f.peek(4)[:4] if hasattr(f, "peek") else b""
            utf8 = codecs.lookup(encoding).name == "utf-8"
            if utf8 and head[:2] in UTF16_BOMS:
                raise DataError(
                    f"{key}: {path} is UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8; "
                    "re-encode it as UTF-8 or set data.encoding: utf-16"
                )
            if _ascii_compatible(encoding):
                offset = 0
                for number, raw in enumerate(f, 1):
                    start = len(UTF8_BOM) if number == 1 and utf8 and raw.startswith(UTF8_BOM) else 0
                    try:
                        text = raw[start:].decode(encoding)
                    except UnicodeDecodeError as err:
                        at, byte = offset + start + err.start, raw[start + err.start]
                        raise DataError(_not_encoded(key, path, encoding, at, number, byte, compressed)) from None
                    offset += len(raw)
                    yield number, text
                return
            yield from _decoded_lines(f, key, path, encoding, compressed)
    except (EOFError, OSError, lzma.LZMAError) as err:
        if isinstance(err, FileNotFoundError):
            raise DataError(f"{key}: file {path} does not exist") from None
        what = f"{compression}-compressed file" if compressed else "file"
        raise DataError(
            f"{key}: {path} could not be read to its end as a {what} ({err}); it may be cut short: download it again"
        ) from None
    except Exception as err:  # noqa: BLE001 (zstandard and lz4 have error classes of their own)
        if not compressed or isinstance(err, DataError):
            raise
        raise DataError(
            f"{key}: {path} could not be decompressed ({compression}: {err}); it may be cut short: download it again"
        ) from None


def _not_finite_columns(row: dict[str, Any], numeric: tuple[str, ...]) -> str | None:
    """The first of `numeric` whose value in `row` is a NaN or infinite number."""
    for name in numeric:
        value = row.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            return name
    return None


def scan_file(
    path: str | Path,
    key: str = "data.path",
    encoding: str = "utf-8",
    parse: bool = True,
    numeric: tuple[str, ...] = (),
) -> Scan:
    """Read a local data file through (see the module's docstring); one DataError sentence naming `key`, the file and
    the line or byte for the first problem. Without `parse` only the encoding (and the stream) of a text file is
    checked and nothing is counted."""

    path = Path(path)
    kind = file_kind(path, key)
    if kind.builder == "parquet":
        return _scan_parquet(path, key, numeric if parse else ())
    lines = _lines(key, path, kind.compression, encoding)
    if not parse:
        for _ in lines:
            pass
        return Scan()
    if kind.builder == "csv":
        return _scan_csv(path, key, lines, numeric)
    if kind.suffix in JSON_LINES:
        return _scan_json_lines(path, key, lines, numeric)
    return _scan_json(path, key, lines, numeric)


def _scan_json_lines(path: Path, key: str, lines: Iterator[tuple[int, str]], numeric: tuple[str, ...]) -> Scan:
    rows, bad, first = 0, 0, None
    for number, text in lines:
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as err:
            why = f"{err.msg.removesuffix(' at')} at column {err.colno}"
            if number == 1 and text.lstrip().startswith("["):
                raise DataError(
                    f"{key}: {path} starts with '[': it looks like a JSON array, not JSON lines (one object per "
                    "line); name it .json, or write one object per line"
                ) from None
            raise DataError(
                f"{key}: line {number} of {path} is not valid JSON ({why}); fix or delete that line (a JSON-lines "
                "file holds one JSON object per line)"
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{key}: line {number} of {path} is a JSON {type(row).__name__}, not an object; a JSON-lines file "
                "holds one object (one row) per line"
            )
        rows += 1
        column = _not_finite_columns(row, numeric)
        if column is not None:
            bad += 1
            first = first or f"line {number} (column '{column}')"
    return Scan(rows, bad, first)


def _scan_json(path: Path, key: str, lines: Iterator[tuple[int, str]], numeric: tuple[str, ...]) -> Scan:
    """A .json file: one JSON document (an array of rows, or an object of columns or with a list of rows), or JSON
    lines under a .json name (``datasets`` reads both)."""
    text = "".join(t for _, t in lines)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        first = next((line for line in text.splitlines() if line.strip()), "")
        try:
            looks_like_lines = isinstance(json.loads(first), dict)
        except json.JSONDecodeError:
            looks_like_lines = False
        if looks_like_lines:
            return _scan_json_lines(path, key, iter(enumerate(text.splitlines(keepends=True), 1)), numeric)
        raise DataError(
            f"{key}: {path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}; fix the file there"
        ) from None
    records = document if isinstance(document, list) else None
    if isinstance(document, dict):
        lists = [v for v in document.values() if isinstance(v, list)]
        records = lists[0] if len(lists) == 1 and all(isinstance(r, dict) for r in lists[0]) else None
    if records is None:
        return Scan()
    bad = [i for i, row in enumerate(records) if isinstance(row, dict) and _not_finite_columns(row, numeric)]
    first = f"row {bad[0]}" if bad else None
    return Scan(len(records), len(bad), first)


def _scan_csv(path: Path, key: str, lines: Iterator[tuple[int, str]], numeric: tuple[str, ...]) -> Scan:
    import io

    import numpy as np
    import pandas as pd

    text = "".join(t for _, t in lines)
    try:
        frame = pd.read_csv(io.StringIO(text))
    except pd.errors.EmptyDataError:
        return Scan(0)
    except (pd.errors.ParserError, ValueError) as err:
        why = str(err).strip().splitlines()[0].removeprefix("Error tokenizing data. C error: ")
        raise DataError(
            f"{key}: {path} is not valid CSV: {why}; fix that line (a field with a comma, quote or line break needs "
            'double quotes: "a, b")'
        ) from None
    # A CSV cell cannot hold NaN apart from an empty one (a missing value): only infinities count.
    bad = np.zeros(len(frame), bool)
    first_column: dict[int, str] = {}
    for name in numeric:
        if name in frame and pd.api.types.is_float_dtype(frame[name]):
            here = np.isinf(frame[name].to_numpy())
            for i in np.flatnonzero(here & ~bad)[:1]:
                first_column[int(i)] = name
            bad |= here
    rows = np.flatnonzero(bad)
    first = f"line {rows[0] + 2} (column '{first_column.get(int(rows[0]), '?')}')" if len(rows) else None
    return Scan(len(frame), int(bad.sum()), first)


def _scan_parquet(path: Path, key: str, numeric: tuple[str, ...]) -> Scan:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
        names = set(meta.schema_arrow.names)
        columns = [c for c in numeric if c in names and pa.types.is_floating(meta.schema_arrow.field(c).type)]
        if not columns or path.stat().st_size > PREFLIGHT_SCAN_BYTES:
            return Scan(meta.metadata.num_rows)
        table = pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(
            f"{key}: {path} is not a readable Parquet file ({why}); it may be cut short: download it again"
        ) from None
    bad = pa.array([False] * table.num_rows)
    first = None
    for name in columns:
        column = table.column(name)
        here = pc.fill_null(pc.invert(pc.is_finite(column)), False)
        if first is None and pc.any(here).as_py():
            first = f"row {pc.index(here, True).as_py()} (column '{name}')"
        bad = pc.or_(bad, here)
    return Scan(table.num_rows, pc.sum(bad).as_py() or 0, first)


def check_not_finite(scan: Scan, key: str, path: str | Path, max_fraction: float) -> None:
    """Refuse a file whose rows with a NaN or infinite score or margin are alone more than `max_fraction` of its rows
    (preparation would drop them and then stop the same way, with the other drop reasons added)."""
    if scan.rows and scan.not_finite > max_fraction * scan.rows:
        raise DataError(
            f"{key}: {scan.not_finite} of {scan.rows} rows of {path} ({scan.not_finite / scan.rows:.0%}) have a score "
            f"or margin that is NaN or infinite (the first: {scan.first_not_finite}), more than data.max_drop_fraction "
            f"({max_fraction}); fix or remove those values (a missing margin is null)"
        )
