"""Where preference rows come from: one loader for hub ids, local files and ``save_to_disk`` folders.

Every source becomes a ``datasets.Dataset`` (Arrow, memory-mapped), so later steps work in batches and memory
stays bounded. Hub ids and local files go through the same call, ``datasets.load_dataset(builder, config_name,
data_files=..., revision=..., split=...)``: a local file only picks the packaged builder from its extension
("json", "parquet" or "csv"; a compression suffix such as ``.jsonl.gz`` is looked through, and ``datasets``
decompresses the file) and passes itself as ``data_files``. A Git LFS pointer (a clone without git-lfs) is
refused with one sentence before anything is read. A folder written by ``save_to_disk`` is opened
with ``datasets.load_from_disk``. Any failure inside ``datasets`` becomes one :class:`DataError` sentence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pandas as pd

from rlhf.config import DataConfig
from rlhf.data.files import file_kind, open_text, text_codec
from rlhf.data.scan import scan_file
from rlhf.errors import DataError, first_line
from rlhf.lfs import is_lfs_pointer, lfs_pointers

if TYPE_CHECKING:
    from datasets import Dataset


class Source(NamedTuple):
    """One split of a source: the rows and a label that names it in messages."""

    rows: Dataset
    label: str


def check_lfs(key: str, path: str | Path, data_dir: str | None = None) -> None:
    """Refuse a Git LFS pointer (the file, or any file of a data folder) with one sentence naming it."""
    local = Path(path)
    if local.is_dir():
        pointers = lfs_pointers(local / data_dir if data_dir and (local / data_dir).is_dir() else local)
        if pointers:
            more = f" (and {len(pointers) - 1} more file(s) under {path})" if len(pointers) > 1 else ""
            raise DataError(
                f"{key}: {pointers[0]}{more} is a Git LFS pointer, not the data: the repository was cloned without "
                "git-lfs; run `git lfs pull` in it"
            )
    elif is_lfs_pointer(local):
        raise DataError(
            f"{key}: {path} is a Git LFS pointer, not the data: the repository was cloned without git-lfs; run "
            "`git lfs pull` in it"
        )


def read_table(path: str | Path, encoding: str = "utf-8") -> pd.DataFrame:
    """Read a small local JSONL / JSON / Parquet / CSV file (optionally compressed) into a frame, with one clear
    error when it cannot."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    check_lfs("data file", path)
    kind = file_kind(path, "data file")
    try:
        if kind.builder == "parquet":
            return pd.read_parquet(path)
        with open_text(path, kind.compression, encoding) as f:
            if kind.builder == "csv":
                return pd.read_csv(f)
            return pd.read_json(f, lines=kind.suffix in (".jsonl", ".ndjson"))
    except ValueError as err:  # a UnicodeDecodeError too
        raise DataError(f"data file {path} could not be parsed as {kind.builder}: {err}") from None


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def check_local_path(key: str, path: str | None, data_dir: str | None = None) -> None:
    """The file or folder named by config `key` exists, holds data rather than Git LFS pointers, and is a kind we
    can read (one sentence otherwise)."""
    if not path:
        return
    local = Path(path)
    if not local.exists():
        raise DataError(f"{key}: file {path} does not exist")
    check_lfs(key, local, data_dir)
    if local.is_file():
        file_kind(local, key)


def peek_columns(path: str | Path, encoding: str = "utf-8") -> list[str] | None:
    """Column names of a local source when they are cheap to read (Parquet schema, CSV header, first JSONL line;
    compressed files are decompressed as far as that)."""
    local = Path(path)
    try:
        if is_saved_dataset(local):
            info = next(local.rglob("dataset_info.json"), None)
            return list(json.loads(info.read_text()).get("features", {})) if info else None
        if not local.is_file():
            return None
        kind = file_kind(local)
        if kind.builder == "parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(local).names)
        if kind.builder == "csv":
            with open_text(local, kind.compression, encoding) as f:
                return pd.read_csv(f, nrows=0).columns.tolist()
        if kind.suffix in (".jsonl", ".ndjson"):
            with open_text(local, kind.compression, encoding) as f:
                first = f.readline()
            row = json.loads(first) if first.strip() else None
            return list(row) if isinstance(row, dict) else None
    except (OSError, ValueError, EOFError, DataError):
        return None  # the full load reports the problem with its own sentence
    return None


def peek_rows(path: str | Path, n: int = 100, encoding: str = "utf-8") -> dict[str, list] | None:
    """The first `n` rows of a local JSONL, CSV or Parquet file as columns (compressed files too), when that is
    cheap; None for folders, JSON arrays and anything unreadable (the full load then reports the problem)."""
    local = Path(path)
    try:
        if not local.is_file():
            return None
        kind = file_kind(local)
        if kind.builder == "parquet":
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(local).iter_batches(batch_size=n), None)
            return batch.to_pydict() if batch is not None else None
        if kind.builder == "csv":
            with open_text(local, kind.compression, encoding) as f:
                return pd.read_csv(f, nrows=n).to_dict("list")
        if kind.suffix in (".jsonl", ".ndjson"):
            rows = []
            with open_text(local, kind.compression, encoding) as f:
                for line in f:
                    if line.strip():
                        rows.append(json.loads(line))
                    if len(rows) >= n:
                        break
            if not rows or not all(isinstance(r, dict) for r in rows):
                return None
            names = list(dict.fromkeys(k for r in rows for k in r))
            return {k: [r.get(k) for r in rows] for k in names}
    except (OSError, ValueError, EOFError, DataError):
        return None
    return None


def load_split(
    builder: str,
    split: str,
    *,
    config_name: str | None = None,
    data_files: str | None = None,
    data_dir: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
    encoding: str | None = None,
    label: str,
    key: str | None = None,
) -> Dataset:
    """``datasets.load_dataset`` for one split: the same call serves hub ids and local files. `encoding`: that of a
    local JSON or CSV file (None: UTF-8). A local file that cannot be loaded is read through (`scan_file`) to name the
    line or byte at fault; otherwise the sentence gives the innermost error's first line."""
    import datasets

    extra = (
        {"encoding": encoding}
        if encoding and text_codec(encoding) != "utf-8-sig" and builder in ("json", "csv")
        else {}
    )
    try:
        rows = datasets.load_dataset(
            builder,
            config_name,
            data_files=data_files,
            data_dir=data_dir,
            revision=revision,
            split=split,
            cache_dir=cache_dir,
            **extra,
        )
    except Exception as err:  # noqa: BLE001 (any library failure becomes one sentence)
        if data_files is not None and Path(data_files).is_file():
            scan_file(data_files, key or label, encoding or "utf-8")  # raises the sentence naming the line
        raise DataError(f"{label} could not be loaded: {innermost(err)}") from None
    return rows


def innermost(err: BaseException) -> str:
    """The first line of the innermost error of `err`'s cause chain that says something (``datasets`` wraps the
    parser's error in "An error occurred while generating the dataset")."""
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    for inner in reversed(chain):
        if str(inner).strip():
            return first_line(str(inner), type(inner).__name__)
    return type(chain[0]).__name__


def load_saved(path: Path, split: str, label: str) -> Dataset:
    """One split of a ``save_to_disk`` folder (a single Dataset has just the one)."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001
        raise DataError(f"{label} could not be loaded: {first_line(str(err), type(err).__name__)}") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(f"{label}: split '{split}' not found (found: {', '.join(saved)})")
        return saved[split]
    return saved


def open_local(
    path: str,
    split: str,
    cache_dir: str,
    key: str = "data.path",
    data_dir: str | None = None,
    encoding: str = "utf-8",
) -> Source:
    """A local file (through its packaged builder), a save_to_disk folder, or a folder of data files. A text file is
    checked to decode in `encoding` first (pyarrow reads undecodable bytes into its strings without a word)."""
    check_local_path(key, path, data_dir)
    local = Path(path)
    if is_saved_dataset(local):
        return Source(load_saved(local, split, path), path)
    if local.is_dir():  # a folder of data files, read the way the hub reads a repository
        if data_dir and not (local / data_dir).is_dir():
            raise DataError(f"data.data_dir: {path} has no sub-folder '{data_dir}'")
        label = f"{path} ({data_dir})" if data_dir else path
        files_encoding = encoding if text_codec(encoding) != "utf-8-sig" else None
        rows = load_split(
            str(local), split, data_dir=data_dir, cache_dir=cache_dir, encoding=files_encoding, label=label
        )
        return Source(rows, label)
    builder = file_kind(local, key).builder  # datasets decompresses .gz, .bz2, ... from the name itself
    if builder != "parquet":
        scan_file(local, key, encoding, parse=False)
    rows = load_split(
        builder, "train", data_files=str(local), cache_dir=cache_dir, encoding=encoding, label=path, key=key
    )
    return Source(rows, path)


def open_sources(cfg: DataConfig, cache_dir: str) -> tuple[Source, Source | None]:
    """The training split and the optional held-out split that `cfg` names (None: split by fraction)."""
    if cfg.source == "hub":
        assert cfg.name is not None
        subset = ", ".join(x for x in (cfg.config_name, cfg.data_dir) if x)
        base = cfg.name + (f" ({subset})" if subset else "")

        def hub(split: str) -> Source:
            label = f"hub data set {base} split '{split}'"
            rows = load_split(
                cfg.name, split, config_name=cfg.config_name, data_dir=cfg.data_dir, revision=cfg.revision, label=label
            )
            return Source(rows, label)

        return hub(cfg.train_split), hub(cfg.eval_split) if cfg.eval_split else None
    assert cfg.path is not None
    if cfg.data_dir and not (Path(cfg.path).is_dir() and not is_saved_dataset(Path(cfg.path))):
        raise DataError(
            f"data.data_dir applies to hub data sets and folders of data files; data.path {cfg.path} is neither"
        )
    train = open_local(cfg.path, cfg.train_split, cache_dir, data_dir=cfg.data_dir, encoding=cfg.encoding)
    if cfg.eval_path:
        return train, open_local(cfg.eval_path, cfg.train_split, cache_dir, "data.eval_path", encoding=cfg.encoding)
    if cfg.eval_split:
        if not is_saved_dataset(Path(cfg.path)) and not Path(cfg.path).is_dir():
            raise DataError("data.eval_split applies to hub data sets and folders; use data.eval_path for a file")
        return train, open_local(cfg.path, cfg.eval_split, cache_dir, data_dir=cfg.data_dir, encoding=cfg.encoding)
    return train, None


def open_prompts(cfg: DataConfig, cache_dir: str) -> Source | None:
    """The separate prompt-only source (a hub data set or a local file/folder), when configured."""
    if cfg.prompts_name:
        base = cfg.prompts_name + (f" ({cfg.prompts_config_name})" if cfg.prompts_config_name else "")
        label = f"hub prompt data set {base} split '{cfg.prompts_split}'"
        rows = load_split(
            cfg.prompts_name,
            cfg.prompts_split,
            config_name=cfg.prompts_config_name,
            revision=cfg.prompts_revision,
            label=label,
        )
        return Source(rows, label)
    if not cfg.prompts_path:
        return None
    return open_local(cfg.prompts_path, cfg.prompts_split, cache_dir, "data.prompts_path", encoding=cfg.encoding)
