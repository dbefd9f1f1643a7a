"""A preference data source checked before anything loads (`check_source`: the pipeline's preflight), and the
content fingerprint of the local files it reads (`source_fingerprint`: part of the prepare stage's cache key)."""

from __future__ import annotations

from pathlib import Path

from rlhf.checkpoints import dir_digest, file_digest, text_digest
from rlhf.config import DataConfig
from rlhf.data import reasoning_gym, row_columns, scan, sources
from rlhf.data.formats import Plan, plan_columns
from rlhf.errors import DataError
from rlhf.rollout.reward_function import load_reward_function


def check_source(cfg: DataConfig, scan_limit: int = scan.PREFLIGHT_SCAN_BYTES) -> None:
    """Cheap checks that run before anything else: files exist and hold data (not Git LFS pointers), have an
    extension we read, and mapped columns exist where that is cheap to see. Local files up to `scan_limit` bytes are
    read through (`scan.scan_file`): a byte that does not decode, a line that is not JSON, a CSV line with the wrong
    number of fields, a Parquet file cut short, and more NaN or infinite scores than data.max_drop_fraction allows
    are one sentence naming the file and the line."""
    if cfg.source == "reasoning_gym":  # installed, a task it knows, settings its generator takes
        reasoning_gym.check_task(cfg.task)
    if cfg.source == "local":
        sources.check_local_path("data.path", cfg.path, cfg.data_dir)
        sources.check_local_path("data.eval_path", cfg.eval_path)
        names = sources.peek_columns(cfg.path, cfg.encoding) if cfg.path else None
        row_columns.check_files(cfg.row_columns, [cfg.path, cfg.eval_path], cfg.encoding)
        for role, column in cfg.columns.items():
            if names is not None and column not in names:
                raise DataError(
                    f"data.columns.{role}: column '{column}' is not in {cfg.path} (found: {', '.join(names)})"
                )
        sample = sources.peek_rows(cfg.path, encoding=cfg.encoding) if cfg.path else None
        plan = None
        if sample:  # the format and its columns, from the first rows: the same decision the full read makes
            plan = plan_columns(list(sample), sample, cfg.format, cfg.columns, str(cfg.path))
        _scan_pairs(cfg, plan, scan_limit)
    if cfg.gold_reward:  # a gold function that does not import stops the run now, not after training
        gold = load_reward_function(cfg.gold_reward, "data.gold_reward")
        row_columns.check_wanted(cfg.gold_reward, gold.fn, cfg.row_columns, "data.gold_reward")
    if cfg.source != "synthetic":
        sources.check_local_path("data.prompts_path", cfg.prompts_path)
        if _scannable(cfg.prompts_path, scan_limit):
            scan.scan_file(cfg.prompts_path, "data.prompts_path", cfg.encoding)


def _scannable(path: str | None, limit: int) -> bool:
    return bool(path) and Path(path).is_file() and Path(path).stat().st_size <= limit


def numeric_columns(plan: Plan) -> tuple[str, ...]:
    """The source columns a pair's margin is read from (formats._margin): both scores, else the margin column."""
    cols = plan.columns
    if "score_chosen" in cols and "score_rejected" in cols:
        return (cols["score_chosen"], cols["score_rejected"])
    return (cols["margin"],) if "margin" in cols else ()


def _scan_pairs(cfg: DataConfig, plan: Plan | None, limit: int) -> None:
    """Read the pair files through (those up to `limit` bytes): an empty one is refused, and so are files whose rows
    with a NaN or infinite score or margin, which preparation drops, are already more than data.max_drop_fraction of
    all their rows."""
    files = [(key, path) for key, path in (("data.path", cfg.path), ("data.eval_path", cfg.eval_path)) if path]
    numeric = numeric_columns(plan) if plan is not None and plan.format != "ranked" else ()
    found = []
    for key, path in files:
        if not _scannable(path, limit):
            return  # counted at preparation
        result = scan.scan_file(path, key, cfg.encoding, numeric=numeric)
        if result.rows == 0:
            raise DataError(f"{key}: {path} has no rows (an empty file); download or write it again")
        found.append(result)
    if numeric and all(f.rows is not None for f in found):  # every pair counted: preparation drops at least these
        first = next((f"{files[i][1]} {f.first_not_finite}" for i, f in enumerate(found) if f.first_not_finite), None)
        total = scan.Scan(sum(f.rows or 0 for f in found), sum(f.not_finite for f in found), first)
        label = " and ".join(path for _, path in files)
        scan.check_not_finite(total, files[0][0], label, cfg.max_drop_fraction)


def source_fingerprint(cfg: DataConfig) -> str:
    """Content digest of the local files a config reads (part of the prepare stage's cache key), so a file
    changed in place is prepared again; hub sources are identified by name, configuration and revision, and a
    reasoning_gym task (data.task) by reasoning-gym's version."""

    parts: list[str] = [reasoning_gym.version()] if cfg.source == "reasoning_gym" else []  # its generators' code
    for path in (cfg.path, cfg.eval_path, cfg.prompts_path):
        if cfg.source == "synthetic" or not path:
            continue
        p = Path(path)
        parts.append(dir_digest(p) if p.is_dir() else file_digest(p) if p.is_file() else f"missing:{path}")
    return text_digest(cfg.source, parts)
