"""Where preference rows come from: one loader for hub ids, local files and ``save_to_disk`` folders.

Every source becomes a ``datasets.Dataset`` (Arrow, memory-mapped), so later steps work in batches and memory
stays bounded. Hub ids and local files go through the same call, ``datasets.load_dataset(builder, config_name,
data_files=..., revision=..., split=...)``: a local file only picks the packaged builder from its extension
("json", "parquet" or "csv") and passes itself as ``data_files``. A folder written by ``save_to_disk`` is opened
with ``datasets.load_from_disk``. Any failure inside ``datasets`` becomes one :class:`DataError` sentence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pandas as pd

from rlhf.config import DataConfig
from rlhf.errors import DataError, first_line

if TYPE_CHECKING:
    from datasets import Dataset

# Extension -> packaged `datasets` builder.
BUILDERS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class Source(NamedTuple):
    """One split of a source: the rows and a label that names it in messages."""

    rows: Dataset
    label: str


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a small local JSONL / JSON / Parquet / CSV file into a frame, with one clear error when it cannot."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix in (".jsonl", ".ndjson"):
            return pd.read_json(path, lines=True)
        if suffix == ".json":
            return pd.read_json(path)
        if suffix == ".parquet":
            return pd.read_parquet(path)
        if suffix == ".csv":
            return pd.read_csv(path)
    except ValueError as err:
        raise DataError(f"data file {path} could not be parsed as {suffix[1:]}: {err}") from None
    raise DataError(f"data file {path} has an unsupported extension '{suffix}' (use .jsonl, .json, .parquet or .csv)")


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def check_local_path(key: str, path: str | None) -> None:
    """The file or folder named by config `key` exists and is a kind we can read (one sentence otherwise)."""
    if not path:
        return
    local = Path(path)
    if not local.exists():
        raise DataError(f"{key}: file {path} does not exist")
    if local.is_file() and local.suffix.lower() not in BUILDERS:
        raise DataError(
            f"{key}: {path} has an unsupported extension '{local.suffix}' (use .jsonl, .json, .parquet, .csv "
            "or a save_to_disk folder)"
        )


def peek_columns(path: str | Path) -> list[str] | None:
    """Column names of a local source when they are cheap to read (Parquet schema, CSV header, first JSONL line)."""
    local = Path(path)
    suffix = local.suffix.lower()
    try:
        if is_saved_dataset(local):
            info = next(local.rglob("dataset_info.json"), None)
            return list(json.loads(info.read_text()).get("features", {})) if info else None
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return list(pq.read_schema(local).names)
        if suffix == ".csv":
            with open(local, newline="") as f:
                return pd.read_csv(f, nrows=0).columns.tolist()
        if suffix in (".jsonl", ".ndjson"):
            with open(local) as f:
                first = f.readline()
            row = json.loads(first) if first.strip() else None
            return list(row) if isinstance(row, dict) else None
    except (OSError, ValueError):
        return None  # the full load reports the problem with its own sentence
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
    label: str,
) -> Dataset:
    """``datasets.load_dataset`` for one split: the same call serves hub ids and local files."""
    import datasets

    try:
        rows = datasets.load_dataset(
            builder,
            config_name,
            data_files=data_files,
            data_dir=data_dir,
            revision=revision,
            split=split,
            cache_dir=cache_dir,
        )
    except Exception as err:  # noqa: BLE001 (any library failure becomes one sentence)
        raise DataError(f"{label} could not be loaded: {first_line(str(err), type(err).__name__)}") from None
    return rows


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


def open_local(path: str, split: str, cache_dir: str, key: str = "data.path", data_dir: str | None = None) -> Source:
    """A local file (through its packaged builder), a save_to_disk folder, or a folder of data files."""
    check_local_path(key, path)
    local = Path(path)
    if is_saved_dataset(local):
        return Source(load_saved(local, split, path), path)
    if local.is_dir():  # a folder of data files, read the way the hub reads a repository
        if data_dir and not (local / data_dir).is_dir():
            raise DataError(f"data.data_dir: {path} has no sub-folder '{data_dir}'")
        label = f"{path} ({data_dir})" if data_dir else path
        return Source(load_split(str(local), split, data_dir=data_dir, cache_dir=cache_dir, label=label), label)
    builder = BUILDERS[local.suffix.lower()]
    return Source(load_split(builder, "train", data_files=str(local), cache_dir=cache_dir, label=path), path)


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
    train = open_local(cfg.path, cfg.train_split, cache_dir, data_dir=cfg.data_dir)
    if cfg.eval_path:
        return train, open_local(cfg.eval_path, cfg.train_split, cache_dir, "data.eval_path")
    if cfg.eval_split:
        if not is_saved_dataset(Path(cfg.path)) and not Path(cfg.path).is_dir():
            raise DataError("data.eval_split applies to hub data sets and folders; use data.eval_path for a file")
        return train, open_local(cfg.path, cfg.eval_split, cache_dir, data_dir=cfg.data_dir)
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
    return open_local(cfg.prompts_path, cfg.prompts_split, cache_dir, "data.prompts_path")
