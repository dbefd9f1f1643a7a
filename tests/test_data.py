from __future__ import annotations

import json

import pandas as pd
import pytest

from rlhf.checkpoints import is_complete, read_manifest
from rlhf.config import DataConfig
from rlhf.data import synthetic
from rlhf.data.prepare import prepare_preferences
from rlhf.errors import DataError


def test_gold_reward_examples():
    # mean valence of well-formed clauses: (superb 1.0 + dull -0.6) / 2 = 0.2
    assert synthetic.gold_reward("p", " the plot was superb and the music was dull.") == pytest.approx(0.2)
    # unfinished sentence: 0.8 (great) - 0.5 penalty = 0.3
    assert synthetic.gold_reward("p", " the plot was great") == pytest.approx(0.3)
    # no well-formed clause
    assert synthetic.gold_reward("p", " great great great.") == -1.0


def test_synthetic_task_is_deterministic_and_labelled_by_gold():
    a = synthetic.preference_pairs(50, seed=3, label_noise=0.0, split="eval")
    b = synthetic.preference_pairs(50, seed=3, label_noise=0.0, split="eval")
    assert a == b
    assert all(p.gold_chosen > p.gold_rejected for p in a)
    noisy = synthetic.preference_pairs(2000, seed=3, label_noise=0.2, split="train")
    flipped = sum(p.gold_chosen < p.gold_rejected for p in noisy) / len(noisy)
    assert 0.15 < flipped < 0.25


def test_prepare_synthetic_writes_parquet_and_manifest(tmp_path):
    cfg = DataConfig(synthetic={"n_sft": 40, "n_train_pairs": 30, "n_eval_pairs": 10})
    out = prepare_preferences(cfg, tmp_path / "data")
    assert set(pd.read_parquet(out.train).columns) >= {"prompt", "chosen", "rejected", "margin", "gold_chosen"}
    manifest = read_manifest(out.folder)
    assert manifest["rows"] == {"train": 30, "eval": 10, "sft": 40}
    assert manifest["gold_reward"] == synthetic.GOLD_REWARD_NAME
    assert is_complete(out.folder)
    again = prepare_preferences(cfg, tmp_path / "again")
    assert again.digest == out.digest  # deterministic content digest


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_prepare_local_file(tmp_path, suffix):
    rows = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(20)]
    rows.append({"prompt": "q", "chosen": "same", "rejected": "same"})  # dropped: identical
    rows.append({"prompt": "", "chosen": "a", "rejected": "b"})  # dropped: empty prompt
    path = tmp_path / f"pairs.{suffix}"
    frame = pd.DataFrame(rows)
    if suffix == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        frame.to_parquet(path)
    out = prepare_preferences(DataConfig(source="local", path=str(path), eval_fraction=0.25), tmp_path / "out")
    assert out.manifest["rows"]["train"] + out.manifest["rows"]["eval"] == 20
    assert out.manifest["rows"]["eval"] == 5
    assert out.manifest["gold_reward"] is None


def test_missing_column_names_the_file_and_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b"}))
    with pytest.raises(DataError, match=r"bad.jsonl has no column 'rejected'"):
        prepare_preferences(DataConfig(source="local", path=str(path)), tmp_path / "out")


def test_missing_file_is_one_sentence(tmp_path):
    with pytest.raises(DataError, match=r"data.path: file .*nope.jsonl does not exist"):
        prepare_preferences(DataConfig(source="local", path=str(tmp_path / "nope.jsonl")), tmp_path / "out")
    assert not (tmp_path / "out").exists()
