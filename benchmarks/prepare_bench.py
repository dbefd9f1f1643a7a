"""Benchmark the prepare stage: N synthetic short pairs in a local file, prepared; prints time and peak memory.

    .venv/bin/python -m benchmarks.prepare_bench --rows 1000000
    .venv/bin/python -m benchmarks.prepare_bench --rows 1000000 --format parquet --num-proc 2 --tokenize

The generated file has a few bad rows on purpose (about 1% duplicates, 0.5% identical pairs, 0.5% empty
prompts) so every step of validation does real work. ``--tokenize`` trains a small byte-level BPE tokenizer,
saves it and sets ``data.max_length_tokens`` so lengths are measured by batched tokenization. Peak memory is
``resource.getrusage(...).ru_maxrss`` of this process and, separately, of its worker processes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never wait on the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def make_row(i: int, rng: random.Random) -> dict[str, str]:
    """A short pair; a few rows are duplicates, identical or empty on purpose."""
    roll = rng.random()
    j = rng.randrange(max(i, 1)) if roll < 0.01 else i  # ~1%: a copy of an earlier row
    prompt = f"Question {j % 50_000}: how would you describe item {j}?"
    chosen = f" Item {j} is useful, sturdy and well made."
    rejected = chosen if 0.01 <= roll < 0.015 else f" Item {j} is {rng.choice(['bad', 'dull', 'broken'])}."
    return {"prompt": "" if 0.015 <= roll < 0.02 else prompt, "chosen": chosen, "rejected": rejected}


def generate(path: Path, rows: int, seed: int = 0, chunk: int = 100_000) -> None:
    """Write `rows` pairs to a JSONL or Parquet file, streaming (constant memory)."""
    rng = random.Random(seed)
    if path.suffix == ".jsonl":
        with open(path, "w") as f:
            for i in range(rows):
                f.write(json.dumps(make_row(i, rng)) + "\n")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("prompt", pa.string()), ("chosen", pa.string()), ("rejected", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, chunk):
            writer.write_table(pa.Table.from_pylist([make_row(i, rng) for i in range(start, min(rows, start + chunk))]))


def save_tokenizer(folder: Path) -> str:
    """A small byte-level BPE tokenizer trained on a sample of the generated text."""
    from rlhf.models.bootstrap import build_tokenizer  # heavy: tokenizers, only with --tokenize

    rng = random.Random(1)
    texts = [" ".join(make_row(i, rng).values()) for i in range(2000)]
    build_tokenizer(texts, vocab_size=512).save_pretrained(folder)
    return str(folder)


def _peak_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="pairs to generate")
    parser.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="file type to generate")
    parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc (processes for validation)")
    parser.add_argument("--batch-size", type=int, default=1000, help="data.batch_size")
    parser.add_argument("--tokenize", action="store_true", help="measure lengths in tokens (max_length_tokens=64)")
    args = parser.parse_args(argv)

    # heavy: pandas, pyarrow and the config models, after the arguments parse (`--help` stays instant)
    from rlhf.config import DataConfig
    from rlhf.data.prepare import prepare_preferences

    with tempfile.TemporaryDirectory(prefix="rlhf-bench-") as tmp:
        root = Path(tmp)
        source = root / f"pairs.{args.format}"
        start = time.perf_counter()
        generate(source, args.rows)
        generated = time.perf_counter() - start
        limits = {"max_length_chars": 400}
        if args.tokenize:
            limits = {"max_length_tokens": 64, "tokenizer": save_tokenizer(root / "tok")}
        cfg = DataConfig(source="local", path=str(source), num_proc=args.num_proc, batch_size=args.batch_size, **limits)
        rss_before = _peak_mib(resource.RUSAGE_SELF)
        start = time.perf_counter()
        out = prepare_preferences(cfg, root / "prepared")
        elapsed = time.perf_counter() - start
        size = source.stat().st_size / 2**20
        manifest = out.manifest
    dropped = {k: v for k, v in manifest["dropped"].items() if v}
    print(f"rows: {args.rows:,} ({args.format}, {size:.0f} MiB, generated in {generated:.1f} s)")
    print(f"settings: num_proc={args.num_proc or 1}, batch_size={args.batch_size}, {next(iter(limits))}")
    print(f"kept: train {manifest['rows']['train']:,}, eval {manifest['rows']['eval']:,}; dropped: {dropped}")
    print(f"prepare time: {elapsed:.1f} s ({args.rows / elapsed:,.0f} rows/s)")
    print(f"peak RSS: this process {_peak_mib(resource.RUSAGE_SELF):.0f} MiB (before prepare {rss_before:.0f} MiB)")
    print(f"          worker processes {_peak_mib(resource.RUSAGE_CHILDREN):.0f} MiB (largest one)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
