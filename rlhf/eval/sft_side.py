"""The SFT policy's side of the evaluation, kept for the next run that shares it.

The evaluation stage samples the SFT policy and the trained one on the same prompts with the same seed. The SFT side
(its scored responses to the held-out prompts and its answers to each of eval.benchmarks) is the same for every run
that shares the SFT checkpoint, the scorer, the prompts and the sampling settings: another seed of the policy stage,
another objective, a sweep's trials. The task layer names a folder by the content digest of exactly those inputs
(`tasks.caching.sft_side_dir`); the first evaluation writes the side there, whole or not at all, and later ones read it
instead of sampling the SFT policy again (about half of the stage's time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rlhf.checkpoints import atomic_dir, is_complete, write_manifest

PROMPTS_FILE = "prompts.parquet"  # the scored responses to the held-out prompts (`generate_and_score_prompts`)


@dataclass
class SFTSide:
    """The SFT policy's scored responses to the held-out prompts (one row per prompt) and its answers to each
    benchmark by name (`benchmark_responses`)."""

    responses: pd.DataFrame
    answers: dict[str, pd.DataFrame]


def read_sft_side(folder: str | Path | None, benchmarks: list[str]) -> SFTSide | None:
    """The side written at `folder` for these `benchmarks`; None where there is none yet (or it is incomplete)."""
    if folder is None or not is_complete(folder):
        return None
    folder = Path(folder)
    files = {name: folder / f"benchmark-{name}.parquet" for name in benchmarks}
    if not all(path.is_file() for path in files.values()):
        return None
    answers = {name: pd.read_parquet(path) for name, path in files.items()}
    return SFTSide(pd.read_parquet(folder / PROMPTS_FILE), answers)


def write_sft_side(folder: str | Path, side: SFTSide) -> None:
    """Write `side` to `folder` atomically, with a manifest (another run may be reading or writing it too)."""
    with atomic_dir(folder) as tmp:
        side.responses.to_parquet(tmp / PROMPTS_FILE, index=False)
        for name, frame in side.answers.items():
            frame.to_parquet(tmp / f"benchmark-{name}.parquet", index=False)
        write_manifest(tmp, stage="evaluate-sft-side")
