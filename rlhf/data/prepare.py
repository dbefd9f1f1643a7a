"""Prepare preference data: read a source, validate it, write train/eval Parquet with a manifest.

Output folder layout (the fixed schema every later stage reads):
- ``train.parquet``, ``eval.parquet``: prompt, chosen, rejected (strings), margin (float, null when unknown),
  gold_chosen, gold_rejected (float, null unless the source has a gold reward);
- ``sft.parquet``: prompt, response demonstrations (synthetic task: its demonstrations; otherwise the chosen
  responses of the training pairs);
- ``manifest.json``: source, format, row counts, gold reward name and the folder's content digest.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlhf.checkpoints import atomic_dir, write_manifest
from rlhf.config import DataConfig
from rlhf.data import synthetic
from rlhf.errors import DataError

PAIR_COLUMNS = ["prompt", "chosen", "rejected", "margin", "gold_chosen", "gold_rejected"]


@dataclass
class PreparedData:
    folder: str
    digest: str
    manifest: dict

    @property
    def train(self) -> Path:
        return Path(self.folder) / "train.parquet"

    @property
    def eval(self) -> Path:
        return Path(self.folder) / "eval.parquet"

    @property
    def sft(self) -> Path:
        return Path(self.folder) / "sft.parquet"


def _synthetic_frames(cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    task = cfg.synthetic
    train = pd.DataFrame(synthetic.preference_pairs(task.n_train_pairs, task.seed, task.label_noise, "train"))
    # Held-out pairs are labelled by the gold reward without noise, so accuracy measures the true preference.
    evals = pd.DataFrame(synthetic.preference_pairs(task.n_eval_pairs, task.seed, 0.0, "eval"))
    sft = pd.DataFrame(synthetic.demonstrations(task.n_sft, task.seed))
    for frame in (train, evals):
        frame["margin"] = None
    return train, evals, sft


def read_table(path: str | Path) -> pd.DataFrame:
    """Read a local JSONL / JSON / Parquet / CSV file into a frame, with one clear error when it cannot."""
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


def validate_pairs(frame: pd.DataFrame, source: str) -> pd.DataFrame:
    """Check columns, drop unusable rows; raise when nothing usable remains."""
    missing = [c for c in ("prompt", "chosen", "rejected") if c not in frame.columns]
    if missing:
        raise DataError(
            f"{source} has no column {', '.join(repr(c) for c in missing)} "
            f"(found: {', '.join(map(str, frame.columns))})"
        )
    ok = pd.Series(True, index=frame.index)
    for col in ("prompt", "chosen", "rejected"):
        ok &= frame[col].map(lambda v: isinstance(v, str) and v.strip() != "")
    ok &= frame["chosen"] != frame["rejected"]
    kept = frame[ok]
    if kept.empty:
        first_bad = int(frame.index[0]) if len(frame) else 0
        raise DataError(
            f"{source}: no usable preference pairs (row {first_bad} is empty, non-string or has "
            "identical chosen and rejected)"
        )
    out = pd.DataFrame({c: kept[c] if c in kept.columns else None for c in PAIR_COLUMNS})
    return out.drop_duplicates(subset=["prompt", "chosen", "rejected"]).reset_index(drop=True)


def split(frame: pd.DataFrame, eval_fraction: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic seeded split."""
    order = list(range(len(frame)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, int(round(len(frame) * eval_fraction)))
    return frame.iloc[order[n_eval:]].reset_index(drop=True), frame.iloc[order[:n_eval]].reset_index(drop=True)


def _local_frames(cfg: DataConfig) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    assert cfg.path is not None
    pairs = validate_pairs(read_table(cfg.path), cfg.path)
    if cfg.eval_path:
        train, evals = pairs, validate_pairs(read_table(cfg.eval_path), cfg.eval_path)
    else:
        train, evals = split(pairs, cfg.eval_fraction, cfg.split_seed)
    sft = pd.DataFrame({"prompt": train["prompt"], "response": train["chosen"]})
    return train, evals, sft


def check_source(cfg: DataConfig) -> None:
    """Cheap checks that run before anything else (missing files are reported before any model loads)."""
    for key, path in (("data.path", cfg.path), ("data.eval_path", cfg.eval_path)):
        if cfg.source == "local" and path and not Path(path).exists():
            raise DataError(f"{key}: file {path} does not exist")


def prepare_preferences(cfg: DataConfig, out_dir: str | Path) -> PreparedData:
    """Read, validate and write the preference data set; atomic (a crash leaves no half-written folder)."""
    check_source(cfg)
    if cfg.source == "synthetic":
        train, evals, sft = _synthetic_frames(cfg)
        gold = synthetic.GOLD_REWARD_NAME
    else:
        train, evals, sft = _local_frames(cfg)
        gold = None
    for frame in (train, evals):
        for col in ("margin", "gold_chosen", "gold_rejected"):
            frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("float64")
    with atomic_dir(out_dir) as tmp:
        train[PAIR_COLUMNS].to_parquet(tmp / "train.parquet", index=False)
        evals[PAIR_COLUMNS].to_parquet(tmp / "eval.parquet", index=False)
        sft[["prompt", "response"]].to_parquet(tmp / "sft.parquet", index=False)
        manifest = write_manifest(
            tmp,
            source=cfg.source if cfg.source == "synthetic" else str(cfg.path),
            format="prompt/chosen/rejected",
            rows={"train": len(train), "eval": len(evals), "sft": len(sft)},
            gold_reward=gold,
        )
    return PreparedData(str(out_dir), manifest["digest"], manifest)


def gold_scorer(manifest: dict):
    """The gold reward function named in a manifest, or None when the data set has none."""
    if manifest.get("gold_reward") == synthetic.GOLD_REWARD_NAME:
        return synthetic.gold_reward
    return None
