"""Prepare preference data: read a source, validate it, write train/eval Parquet with a manifest.

Sources (``data.source``): the built-in ``synthetic`` task; ``local`` files (JSONL, JSON, Parquet, CSV) or
``save_to_disk`` folders; ``hub`` data sets (see sources.py); a ``reasoning_gym`` task, written as local files
(reasoning_gym.py). Formats and column mapping: formats.py. Drop rules and reasons: validate.py.

Output folder layout (the fixed schema every later stage reads):
- ``train.parquet``, ``eval.parquet``: prompt, chosen, rejected (strings), margin (float, null when unknown),
  gold_chosen, gold_rejected (float, null unless the source has a gold reward); written in a seeded shuffled
  order; eval is a seeded ``eval_fraction`` of the kept pairs (whole prompts, with ``split_by_prompt``) unless
  the source has its own eval split/file;
- ``sft.parquet``: prompt, response demonstrations (synthetic task: its demonstrations; otherwise the chosen
  responses of the training pairs);
- ``prompts.parquet``: prompt, the PPO rollout prompts (``data.prompts_path`` or ``data.prompts_name`` when set,
  else the distinct training prompts in training order);
- ``manifest.json``: source, revision, format, column mapping, row counts, drops per reason with an example row,
  the length report against the later stages' limits (``lengths``, see lengths.py) and its ``warnings``, gold
  reward name and the folder's content digest.

The checks of a source before anything loads, and its content fingerprint: source_checks.py.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlhf.checkpoints import atomic_dir, write_manifest
from rlhf.config import DataConfig
from rlhf.data import output, reasoning_gym, row_columns, sources, synthetic, validate
from rlhf.data.formats import ChatRenderer, Markers, Plan, plan_columns
from rlhf.data.lengths import LengthLimits, length_report, length_table
from rlhf.data.output import PAIR_COLUMNS
from rlhf.data.source_checks import check_source
from rlhf.data.sources import read_table
from rlhf.data.validate import Checked, Limits, text_lengths
from rlhf.errors import ConfigError, DataError, first_line
from rlhf.rollout.reward_function import function_digest, load_reward_function
from rlhf.rollout.rows import RowColumns

__all__ = ["PAIR_COLUMNS", "PreparedData", "drop_report", "gold_scorer", "prepare_preferences"]
__all__ += ["LengthLimits", "length_table", "read_table"]
LENS = ("prompt_len", "chosen_len", "rejected_len")


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

    @property
    def prompts(self) -> Path:
        return Path(self.folder) / "prompts.parquet"


def _synthetic(cfg: DataConfig, tmp: Path, limits: LengthLimits) -> dict[str, Any]:
    task = cfg.synthetic
    train = pd.DataFrame(
        synthetic.preference_pairs(
            task.n_train_pairs, task.seed, task.label_noise, "train", task.length_bias, task.max_clauses
        )
    )
    # Held-out pairs are labelled by the gold reward without noise (or length bias), so accuracy measures the true
    # preference.
    evals = pd.DataFrame(
        synthetic.preference_pairs(task.n_eval_pairs, task.seed, 0.0, "eval", max_clauses=task.max_clauses)
    )
    sft = pd.DataFrame(synthetic.demonstrations(task.n_sft, task.seed, task.sft_max_clauses or task.max_clauses))
    for frame in (train, evals):
        frame["margin"] = None
    prompts = pd.DataFrame({"prompt": list(dict.fromkeys(train["prompt"]))})
    rows = {
        "train": output.write_frame(train, tmp / "train.parquet", output.PAIR_SCHEMA),
        "eval": output.write_frame(evals, tmp / "eval.parquet", output.PAIR_SCHEMA),
        "sft": output.write_frame(sft, tmp / "sft.parquet", output.SFT_SCHEMA),
        "prompts": output.write_frame(prompts, tmp / "prompts.parquet", output.PROMPT_SCHEMA),
    }
    tokenizer = _load_tokenizer(cfg)
    pairs = pd.concat([train, evals])
    lengths, warnings = length_report(
        *(np.asarray(text_lengths(pairs[k].tolist(), tokenizer)) for k in ("prompt", "chosen", "rejected")),
        np.asarray(text_lengths(sft["prompt"].tolist(), tokenizer))
        + np.asarray(text_lengths(sft["response"].tolist(), tokenizer)),
        np.asarray(text_lengths(prompts["prompt"].tolist(), tokenizer)),
        limits,
        "tokens" if tokenizer is not None else "characters",
        cfg.length_warn_fraction,
    )
    lengths["tokenizer"] = cfg.tokenizer
    return dict(
        source="synthetic",
        format="explicit",
        rows=rows,
        rows_in=len(train) + len(evals),
        lengths=lengths,
        warnings=warnings,
    )


def _load_tokenizer(cfg: DataConfig) -> Any:
    if cfg.tokenizer is None:
        if cfg.max_length_tokens is not None:
            raise ConfigError(
                "data.max_length_tokens needs data.tokenizer (it defaults to sft.model); or use data.max_length_chars"
            )
        return None
    from rlhf.models.loading import load_tokenizer  # heavy: torch and transformers, only for a chat template

    try:
        return load_tokenizer(cfg.tokenizer, cfg.tokenizer_revision, False, cfg.tokenizer_gguf_file)
    except Exception as err:  # noqa: BLE001 (one sentence, not a traceback from transformers)
        why = first_line(str(err), type(err).__name__)
        raise DataError(f"data.tokenizer: could not load tokenizer '{cfg.tokenizer}': {why}") from None


def _check(src: sources.Source, fn: Any, kwargs: dict[str, Any], cfg: DataConfig, scratch: str, tag: str) -> Checked:
    """Run a validation function over a source as a batched, optionally parallel ``Dataset.map``."""
    import datasets

    features = {"prompt": "string", "chosen": "string", "rejected": "string", "margin": "float64"}
    features |= {"row": "int64", "reason": "string", "key": "int64", "prompt_key": "int64"}
    features |= {"prompt_len": "int32", "chosen_len": "int32", "rejected_len": "int32"}
    if fn is validate.validate_prompts:
        drop = ("chosen", "rejected", "margin", "chosen_len", "rejected_len")
        features = {k: v for k, v in features.items() if k not in drop}
    rows = src.rows
    checked = rows.map(
        fn,
        with_indices=True,
        batched=True,
        batch_size=cfg.batch_size,
        writer_batch_size=10_000,  # fewer, larger record batches: cheaper to gather rows from when writing
        remove_columns=rows.column_names,
        features=datasets.Features({k: datasets.Value(v) for k, v in features.items()}),
        fn_kwargs=kwargs,
        num_proc=cfg.num_proc if cfg.num_proc and cfg.num_proc > 1 and len(rows) > cfg.batch_size else None,
        cache_file_name=str(Path(scratch) / f"{tag}.arrow"),
        load_from_cache_file=False,
        new_fingerprint=f"rlhf-validate-{tag}",
        desc=f"validate {tag}",
    )
    return Checked(checked.data.table, src.label)


def _plan(src: sources.Source, cfg: DataConfig, fmt: str) -> Plan:
    sample = src.rows.select(range(min(100, len(src.rows))))[:]
    return plan_columns(list(src.rows.column_names), sample, fmt, cfg.columns, src.label)


def _prepare_pairs(cfg: DataConfig, tmp: Path, scratch: str, length_limits: LengthLimits) -> dict[str, Any]:
    tokenizer = _load_tokenizer(cfg)
    chat = ChatRenderer(tokenizer)
    limits = Limits(cfg.max_length_tokens, cfg.max_length_chars)
    train_src, eval_src = sources.open_sources(cfg, scratch)
    plan = _plan(train_src, cfg, cfg.format)
    markers = Markers(cfg.user_marker, cfg.assistant_marker)
    kwargs = dict(plan=plan, chat=chat, markers=markers, limits=limits, tokenizer=tokenizer)
    checked = [_check(train_src, validate.validate_batch, kwargs, cfg, scratch, "train")]
    if eval_src is not None:
        eval_kwargs = {**kwargs, "plan": _plan(eval_src, cfg, plan.format)}
        checked.append(_check(eval_src, validate.validate_batch, eval_kwargs, cfg, scratch, "eval"))
    outcome = validate.tally(checked)
    validate.check_drops(outcome, cfg.max_drop_fraction, train_src.label)
    train_table = checked[0].table
    if eval_src is None:
        kept = outcome.kept[0]
        keys = train_table.column("prompt_key").to_numpy()[kept] if cfg.split_by_prompt else None
        train_pos, eval_pos = output.split_positions(kept, cfg.eval_fraction, cfg.split_seed, keys)
        eval_table = train_table
    else:
        train_pos = output.shuffled(outcome.kept[0], cfg.split_seed)
        eval_pos, eval_table = outcome.kept[1], checked[1].table
        if not len(eval_pos):
            raise DataError(f"{eval_src.label}: no usable held-out pairs remain after validation")
    kept = cfg.row_columns
    _check_row_columns(cfg, train_src, eval_src)
    eval_rows = train_src.rows if eval_src is None else eval_src.rows
    rows = {
        "train": output.write_rows(train_table, train_pos, tmp / "train.parquet", "pairs", train_src.rows, kept),
        "eval": output.write_rows(eval_table, eval_pos, tmp / "eval.parquet", "pairs", eval_rows, kept),
        "sft": output.write_rows(train_table, train_pos, tmp / "sft.parquet", "sft"),
    }
    prompt_info, prompt_table, prompt_pos = _write_prompts(
        cfg, chat, plan.format, tmp, scratch, train_table, train_pos, tokenizer, train_src.rows
    )
    rows["prompts"] = prompt_info.pop("rows")

    def column(table, name: str, positions) -> np.ndarray:
        return table.column(name).to_numpy()[positions].astype(np.int64)

    pairs = [np.concatenate([column(train_table, k, train_pos), column(eval_table, k, eval_pos)]) for k in LENS]
    demos = column(train_table, "prompt_len", train_pos) + column(train_table, "chosen_len", train_pos)
    ppo_prompts = column(prompt_table, "prompt_len", prompt_pos)
    unit = "tokens" if tokenizer is not None else "characters"
    lengths, warnings = length_report(*pairs, demos, ppo_prompts, length_limits, unit, cfg.length_warn_fraction)
    return dict(
        source=cfg.name if cfg.source == "hub" else str(cfg.path),
        source_kind=cfg.source,
        config_name=cfg.config_name,
        data_dir=cfg.data_dir,
        revision=cfg.revision,
        splits={"train": train_src.label, "eval": eval_src.label if eval_src else _split_label(cfg)},
        format=plan.format,
        columns=plan.columns,
        rows=rows,
        rows_in=outcome.n_in,
        dropped=outcome.dropped,
        drop_examples=outcome.examples,
        length_limit={"tokens": cfg.max_length_tokens, "chars": cfg.max_length_chars, "tokenizer": cfg.tokenizer},
        lengths={**lengths, "tokenizer": cfg.tokenizer},
        warnings=warnings,
        **prompt_info,
    )


def _split_label(cfg: DataConfig) -> str:
    return f"{cfg.eval_fraction} of train" + (", by prompt" if cfg.split_by_prompt else "")


def _check_row_columns(cfg: DataConfig, *srcs: sources.Source | None) -> None:
    """data.row_columns in each source, and every row's values checked by the gold reward's own `check_row`."""
    gold = load_reward_function(cfg.gold_reward).fn if cfg.gold_reward and cfg.row_columns else None
    for src in filter(None, srcs):
        row_columns.check_source_columns(cfg.row_columns, src.rows.column_names, src.label)
        if gold is not None:
            row_columns.check_rows(gold, cfg.row_columns, src.rows, src.label)


def _write_prompts(
    cfg: DataConfig,
    chat: ChatRenderer,
    fmt: str,
    tmp: Path,
    scratch: str,
    train_table,
    train_pos,
    tokenizer: Any,
    train_rows: Any,
) -> tuple[dict, Any, np.ndarray]:
    """Write prompts.parquet; returns its manifest fields, and the checked table and positions it was written from."""
    path = tmp / "prompts.parquet"
    src = sources.open_prompts(cfg, scratch)
    if src is None:
        positions = output.first_prompt_positions(train_table, train_pos, train_rows, cfg.row_columns)
        n = output.write_rows(train_table, positions, path, "prompts", train_rows, cfg.row_columns)
        return {"rows": n, "prompts_source": "train"}, train_table, positions
    _check_row_columns(cfg, src)
    if cfg.prompts_column not in src.rows.column_names:
        raise DataError(
            f"data.prompts_column: column '{cfg.prompts_column}' is not in {src.label} "
            f"(found: {', '.join(src.rows.column_names)})"
        )
    markers = Markers(cfg.user_marker, cfg.assistant_marker)
    kwargs = dict(column=cfg.prompts_column, chat=chat, fmt=fmt, markers=markers, tokenizer=tokenizer)
    checked = _check(src, validate.validate_prompts, kwargs, cfg, scratch, "prompts")
    outcome = validate.tally([checked])
    validate.check_drops(outcome, cfg.max_drop_fraction, src.label)
    n = output.write_rows(checked.table, outcome.kept[0], path, "prompts", src.rows, cfg.row_columns)
    info = {"rows": n, "prompts_source": src.label, "prompts_dropped": outcome.dropped}
    info |= {"prompts_revision": cfg.prompts_revision} if cfg.prompts_name else {}
    return info, checked.table, outcome.kept[0]


def prepare_preferences(cfg: DataConfig, out_dir: str | Path, limits: LengthLimits | None = None) -> PreparedData:
    """Read, validate and write the preference data set; atomic (a crash leaves no half-written folder).

    `limits`: the later stages' length limits (``LengthLimits.from_config``) that the manifest's length report
    measures the data against; None measures lengths only.
    """
    check_source(cfg)
    limits = limits or LengthLimits()
    with tempfile.TemporaryDirectory(prefix="rlhf-prepare-") as scratch, atomic_dir(out_dir) as tmp:
        if cfg.source == "synthetic":
            fields = _synthetic(cfg, tmp, limits)
            gold = synthetic.GOLD_REWARD_NAME
            fields["dropped"] = dict.fromkeys(validate.REASONS, 0)  # generated valid: nothing to drop
        else:
            local = reasoning_gym.local_source(cfg, scratch) if cfg.source == "reasoning_gym" else cfg
            fields, gold = _prepare_pairs(local, tmp, scratch, limits), cfg.gold_reward
            fields |= reasoning_gym.manifest_fields(cfg.task) if local is not cfg else {}
            if gold:  # its source file's digest: a changed checker is a changed data set
                fields["gold_reward_digest"] = function_digest(gold)
        manifest = write_manifest(tmp, gold_reward=gold, **fields)
    return PreparedData(str(out_dir), manifest["digest"], manifest)


def drop_report(manifest: dict) -> list[dict[str, Any]]:
    """One row per drop reason: count, share of the input rows, an example row and what the reason means."""
    n_in = max(int(manifest.get("rows_in") or 0), 1)
    examples = manifest.get("drop_examples", {})
    return [
        {
            "reason": reason,
            "count": count,
            "fraction": round(count / n_in, 6),
            "example": examples.get(reason, ""),
            "meaning": validate.REASON_TEXT.get(reason, ""),
        }
        for reason, count in manifest.get("dropped", {}).items()
    ]


def gold_scorer(manifest: dict, folder: str | Path | None = None):
    """The gold score of one (prompt, response, row key) of the data set whose manifest is given: the synthetic
    task's, or the data.gold_reward function's (called one pair at a time, its checks on the returned values
    applied, given the row columns of the prepared `folder`'s prompts and held-out pairs, by the row's key); None
    when the data set has no gold reward."""
    name = manifest.get("gold_reward")
    if name == synthetic.GOLD_REWARD_NAME:
        return synthetic.gold_score
    if not name:
        return None
    columns = None
    if folder is not None:
        columns = RowColumns.read(Path(folder) / "eval.parquet", Path(folder) / "prompts.parquet")
    function = load_reward_function(name, "data.gold_reward").with_columns(columns)
    return lambda prompt, response, row=None: function([prompt], [response], None if row is None else [row])[0]
