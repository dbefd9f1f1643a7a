"""Local data files: which packaged `datasets` builder and compression a file's name says, and opening it as bytes
or text (the compression looked through)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

from rlhf.errors import DataError

# Extension -> packaged `datasets` builder.
BUILDERS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Compression suffix of a text file (.jsonl.gz, .csv.bz2, ...) -> (name, the module that reads it): what
# `datasets` decompresses (the standard library's gzip, bz2, lzma; zstd and lz4 when their packages are installed).
COMPRESSIONS = {
    ".gz": ("gzip", "gzip"),
    ".gzip": ("gzip", "gzip"),
    ".bz2": ("bz2", "bz2"),
    ".xz": ("xz", "lzma"),
    ".zst": ("zstd", "zstandard"),
    ".zstd": ("zstd", "zstandard"),
    ".lz4": ("lz4", "lz4"),
}
SUPPORTED = ".jsonl, .json, .parquet, .csv (the text ones also as .gz, .bz2, .xz, .zst) or a save_to_disk folder"


class FileKind(NamedTuple):
    """How a local data file is read: its data extension, the packaged builder and the compression (None: plain)."""

    suffix: str  # ".jsonl" of "train.jsonl.gz"
    builder: str
    compression: str | None


def file_kind(path: str | Path, key: str = "data.path") -> FileKind:
    """The builder and compression of a data file from its name (``train.jsonl.gz`` -> json, gzip); one
    DataError sentence for an extension we cannot read or a compression whose package is not installed."""
    suffixes = Path(Path(path).name.lower()).suffixes
    shown = "".join(suffixes[-2:] if suffixes and suffixes[-1] in COMPRESSIONS else suffixes[-1:]) or "(none)"
    compression = None
    if suffixes and suffixes[-1] in COMPRESSIONS:
        compression, module = COMPRESSIONS[suffixes[-1]]
        suffixes = suffixes[:-1]
        if importlib.util.find_spec(module) is None:
            raise DataError(
                f"{key}: {path} is {compression}-compressed and reading it needs the '{module}' package "
                f"(pip install {module}), or decompress it first"
            )
    builder = BUILDERS.get(suffixes[-1]) if suffixes else None
    if builder is None or (compression and builder == "parquet"):
        raise DataError(f"{key}: {path} has an unsupported extension '{shown}' (use {SUPPORTED})")
    return FileKind(suffixes[-1], builder, compression)


def open_bytes(path: str | Path, compression: str | None):
    """A local file opened for reading bytes, decompressed on the fly."""
    if compression is None:
        return open(path, "rb")
    if compression == "gzip":
        import gzip

        return gzip.open(path, "rb")
    if compression == "bz2":
        import bz2

        return bz2.open(path, "rb")
    if compression == "xz":
        import lzma

        return lzma.open(path, "rb")
    if compression == "zstd":
        import zstandard

        return zstandard.open(path, "rb")
    import lz4.frame

    return lz4.frame.open(path, "rb")


def text_codec(encoding: str = "utf-8") -> str:
    """The codec that reads text of `encoding` as ``datasets`` does: UTF-8 with or without a byte-order mark."""
    import codecs

    return "utf-8-sig" if codecs.lookup(encoding).name == "utf-8" else encoding


def open_text(path: str | Path, compression: str | None, encoding: str = "utf-8"):
    """A local text file opened for reading, decompressed on the fly (a UTF-8 byte-order mark skipped)."""
    import io

    return io.TextIOWrapper(open_bytes(path, compression), encoding=text_codec(encoding), newline="")
