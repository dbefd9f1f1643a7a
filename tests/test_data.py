"""Preference data preparation: the synthetic task, every source kind, the output files and one-sentence errors."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pandas as pd
import pytest

from rlhf.checkpoints import is_complete, read_manifest
from rlhf.config import ConfigError, DataConfig, load_config
from rlhf.data import synthetic
from rlhf.data.prepare import prepare_preferences
from rlhf.data.source_checks import check_source
from rlhf.errors import DataError


def pairs(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(start, start + n)]


def write(path, rows: list[dict]):
    frame = pd.DataFrame(rows)
    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".parquet":
        frame.to_parquet(path)
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def test_gold_reward_examples():
    # mean valence of well-formed clauses: (superb 1.0 + dull -0.6) / 2 = 0.2
    assert synthetic.gold_score("p", " the plot was superb and the music was dull.") == pytest.approx(0.2)
    # unfinished sentence: 0.8 (great) - 0.5 penalty = 0.3
    assert synthetic.gold_score("p", " the plot was great") == pytest.approx(0.3)
    # no well-formed clause
    assert synthetic.gold_score("p", " great great great.") == -1.0
    # the same scores as a reward function, a batch at a time (reward.function: rlhf.data.synthetic:gold_reward)
    assert synthetic.gold_reward(["p", "q"], [" the plot was great", " great great great."]) == pytest.approx(
        [0.3, -1.0]
    )


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
    train = pd.read_parquet(out.train)
    assert list(train.columns) == ["prompt", "chosen", "rejected", "margin", "gold_chosen", "gold_rejected"]
    # the synthetic pairs are written exactly as generated, gold scores included
    expected = synthetic.preference_pairs(30, seed=0, label_noise=0.1, split="train")
    assert train[["prompt", "chosen", "rejected", "gold_chosen", "gold_rejected"]].values.tolist() == [
        list(p) for p in expected
    ]
    manifest = read_manifest(out.folder)
    assert {k: manifest["rows"][k] for k in ("train", "eval", "sft")} == {"train": 30, "eval": 10, "sft": 40}
    assert pd.read_parquet(out.prompts)["prompt"].tolist() == list(dict.fromkeys(train["prompt"]))
    assert manifest["gold_reward"] == synthetic.GOLD_REWARD_NAME
    assert is_complete(out.folder)
    again = prepare_preferences(cfg, tmp_path / "again")
    assert again.digest == out.digest  # deterministic content digest


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ""])
def test_prepare_local_file_or_saved_dataset(tmp_path, suffix):
    rows = pairs(20)
    rows.append({"prompt": "q", "chosen": "same", "rejected": "same"})  # dropped: identical
    rows.append({"prompt": " ", "chosen": "a", "rejected": "b"})  # dropped: empty prompt
    path = write(tmp_path / f"pairs{suffix or '_saved'}", rows)
    out = prepare_preferences(DataConfig(source="local", path=path, eval_fraction=0.25), tmp_path / "out")
    assert out.manifest["rows"]["train"] + out.manifest["rows"]["eval"] == 20
    assert out.manifest["rows"]["eval"] == 5
    assert out.manifest["rows_in"] == 22
    assert out.manifest["dropped"]["identical"] == 1 and out.manifest["dropped"]["missing"] == 1
    assert out.manifest["gold_reward"] is None and out.manifest["format"] == "explicit"
    train, evals = pd.read_parquet(out.train), pd.read_parquet(out.eval)
    assert not set(train["prompt"]) & set(evals["prompt"])
    sft = pd.read_parquet(out.sft)
    assert list(sft.columns) == ["prompt", "response"] and sft["response"].tolist() == train["chosen"].tolist()
    assert sorted(pd.read_parquet(out.prompts)["prompt"]) == sorted(train["prompt"])
    assert train["margin"].isna().all() and train["gold_chosen"].isna().all()


def test_split_is_seeded_and_digest_ignores_the_path(tmp_path):
    a = write(tmp_path / "a.jsonl", pairs(40))
    b = write(tmp_path / "b.parquet", pairs(40))
    first = prepare_preferences(DataConfig(source="local", path=a), tmp_path / "1")
    same = prepare_preferences(DataConfig(source="local", path=b), tmp_path / "2")
    other = prepare_preferences(DataConfig(source="local", path=a, split_seed=1), tmp_path / "3")
    assert first.digest == same.digest  # same content, another file: same digest
    assert first.digest != other.digest
    assert pd.read_parquet(first.eval)["prompt"].tolist() != pd.read_parquet(other.eval)["prompt"].tolist()


def test_num_proc_gives_the_same_result(tmp_path):
    path = write(tmp_path / "p.jsonl", pairs(300) + pairs(20))  # 20 duplicates across the process shards
    one = prepare_preferences(DataConfig(source="local", path=path, batch_size=50), tmp_path / "1")
    two = prepare_preferences(DataConfig(source="local", path=path, batch_size=50, num_proc=2), tmp_path / "2")
    assert one.digest == two.digest and two.manifest["dropped"]["duplicate"] == 20


def test_eval_file_and_saved_dataset_dict_splits(tmp_path):
    train, held = write(tmp_path / "t.jsonl", pairs(12)), write(tmp_path / "e.jsonl", pairs(4, start=100))
    out = prepare_preferences(DataConfig(source="local", path=train, eval_path=held), tmp_path / "a")
    assert out.manifest["rows"]["train"] == 12 and out.manifest["rows"]["eval"] == 4
    assert pd.read_parquet(out.eval)["prompt"].tolist() == ["q100", "q101", "q102", "q103"]  # source order
    with pytest.raises(DataError, match=r"data.eval_split applies to hub data sets and folders; use data.eval_path"):
        prepare_preferences(DataConfig(source="local", path=train, eval_split="test"), tmp_path / "x")
    saved = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(pairs(12)), "test": datasets.Dataset.from_list(pairs(3, start=50))}
    ).save_to_disk(str(saved))
    cfg = DataConfig(source="local", path=str(saved), eval_split="test")
    out = prepare_preferences(cfg, tmp_path / "b")
    assert out.manifest["rows"]["eval"] == 3
    with pytest.raises(DataError, match=r"split 'validation' not found \(found: train, test\)"):
        prepare_preferences(DataConfig(source="local", path=str(saved), eval_split="validation"), tmp_path / "c")


def test_data_dir_picks_a_subset_of_a_folder_as_of_a_hub_repository(tmp_path):
    """Anthropic/hh-rlhf keeps its subsets in folders (helpful-base/, harmless-base/, ...), each with train and test
    files; `data_dir` picks one. A local folder laid out like the hub repository goes through the same call."""
    for subset, start in (("helpful-base", 0), ("harmless-base", 100)):
        folder = tmp_path / "hh" / subset
        folder.mkdir(parents=True)
        for split, n in (("train", 8), ("test", 3)):
            rows = pairs(n, start=start + (50 if split == "test" else 0))
            (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = DataConfig(source="local", path=str(tmp_path / "hh"), data_dir="harmless-base", eval_split="test")
    out = prepare_preferences(cfg, tmp_path / "out")
    assert out.manifest["rows"]["train"] == 8 and out.manifest["rows"]["eval"] == 3
    assert out.manifest["data_dir"] == "harmless-base"
    assert set(pd.read_parquet(out.train)["prompt"]) == {r["prompt"] for r in pairs(8, start=100)}
    with pytest.raises(DataError, match=r"data.data_dir: .*hh has no sub-folder 'red-team'"):
        prepare_preferences(cfg.model_copy(update={"data_dir": "red-team"}), tmp_path / "x")
    single = tmp_path / "one.jsonl"
    single.write_text(json.dumps(pairs(1)[0]))
    with pytest.raises(DataError, match=r"data.data_dir applies to hub data sets and folders of data files"):
        prepare_preferences(DataConfig(source="local", path=str(single), data_dir="x"), tmp_path / "y")


def test_hub_source_goes_through_load_dataset(tmp_path, monkeypatch):
    """The hub path is the same load_dataset call as local builders: only the arguments differ."""
    saved = tmp_path / "hub"
    hub = {"train": datasets.Dataset.from_list(pairs(10)), "test": datasets.Dataset.from_list(pairs(2, start=50))}
    datasets.DatasetDict(hub).save_to_disk(str(saved))
    calls = []
    real = datasets.load_dataset

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs["data_dir"], kwargs["revision"], kwargs["split"]))
        return datasets.load_from_disk(str(saved))[kwargs["split"]]  # no network: serve the "hub" set from disk

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(
        source="hub", name="org/prefs", config_name="default", data_dir="sub", revision="abc123", eval_split="test"
    )
    out = prepare_preferences(cfg, tmp_path / "out")
    assert calls == [("org/prefs", "default", "sub", "abc123", s) for s in ("train", "test")]
    assert out.manifest["source"] == "org/prefs" and out.manifest["revision"] == "abc123"
    assert out.manifest["rows"]["train"] == 10 and out.manifest["rows"]["eval"] == 2
    monkeypatch.setattr(datasets, "load_dataset", real)
    with pytest.raises(DataError, match=r"hub data set no-such/dataset split 'train' could not be loaded"):
        prepare_preferences(DataConfig(source="hub", name="no-such/dataset"), tmp_path / "x")


def test_hub_prompt_source_goes_through_load_dataset(tmp_path, monkeypatch):
    """A prompt-only hub data set (the UltraFeedback-prompt layout: message lists) for the PPO rollouts."""
    local = tmp_path / "prefs.jsonl"
    local.write_text("\n".join(json.dumps(r) for r in pairs(10)))
    prompts = [{"prompt": [{"role": "user", "content": f"question {i % 3}"}]} for i in range(5)]
    saved = tmp_path / "prompt-hub"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(prompts)}).save_to_disk(str(saved))
    calls = []
    real = datasets.load_dataset

    def fake_load_dataset(path, name=None, **kwargs):
        if path != "org/prompts":  # the local preference file: the packaged json builder
            return real(path, name, **kwargs)
        calls.append((path, name, kwargs["revision"], kwargs["split"]))
        return datasets.load_from_disk(str(saved))[kwargs["split"]]  # no network: serve the "hub" set from disk

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(
        source="local", path=str(local), prompts_name="org/prompts", prompts_revision="c0ffee", prompts_split="test"
    )
    out = prepare_preferences(cfg, tmp_path / "out")
    assert calls == [("org/prompts", None, "c0ffee", "test")]
    kept = pd.read_parquet(out.prompts)["prompt"].tolist()
    assert len(kept) == 3 and all("question" in p for p in kept)  # rendered; the duplicates dropped
    assert out.manifest["prompts_dropped"]["duplicate"] == 2
    assert out.manifest["prompts_source"] == "hub prompt data set org/prompts split 'test'"
    assert out.manifest["prompts_revision"] == "c0ffee"

    monkeypatch.undo()  # the real load_dataset: no such data set (offline), one sentence naming it
    with pytest.raises(DataError, match=r"hub prompt data set org/prompts split 'nope' could not be loaded"):
        prepare_preferences(cfg.model_copy(update={"prompts_split": "nope"}), tmp_path / "x")
    with pytest.raises(ConfigError, match=r"data.prompts_path and data.prompts_name both name a prompt source"):
        load_config(
            None, ["data.source=local", f"data.path={local}", "data.prompts_path=a.jsonl", "data.prompts_name=b"]
        )
    with pytest.raises(ConfigError, match=r"apply to 'local' and 'hub' sources"):
        load_config(None, ["data.prompts_name=org/prompts"])


def test_missing_column_names_the_file_and_column(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b"}))
    with pytest.raises(DataError, match=r"bad.jsonl has no column 'rejected'"):
        prepare_preferences(DataConfig(source="local", path=str(path)), tmp_path / "out")


def test_missing_file_is_one_sentence(tmp_path):
    with pytest.raises(DataError, match=r"data.path: file .*nope.jsonl does not exist"):
        prepare_preferences(DataConfig(source="local", path=str(tmp_path / "nope.jsonl")), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=r"data.prompts_path: file .*p.jsonl does not exist"):
        check_source(DataConfig(source="hub", name="x/y", prompts_path=str(tmp_path / "p.jsonl")))


def test_unsupported_extension_and_unparsable_file(tmp_path):
    (tmp_path / "d.txt").write_text("hello")
    with pytest.raises(DataError, match=r"data.path: .*d.txt has an unsupported extension '.txt'"):
        check_source(DataConfig(source="local", path=str(tmp_path / "d.txt")))
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"data.path: .*broken.parquet is not a readable Parquet file"):
        prepare_preferences(DataConfig(source="local", path=str(tmp_path / "broken.parquet")), tmp_path / "out")


def test_unknown_mapped_column_is_caught_early(tmp_path):
    path = write(tmp_path / "p.parquet", pairs(5))
    cfg = DataConfig(source="local", path=path, columns={"prompt": "question"})
    with pytest.raises(
        DataError, match=r"data.columns.prompt: column 'question' is not in .*p.parquet \(found: prompt"
    ):
        check_source(cfg)  # before anything is loaded: the Parquet schema is enough
    with pytest.raises(DataError, match=r"data.columns.prompt: column 'question' is not in"):
        prepare_preferences(cfg, tmp_path / "out")


def test_unrecognisable_format_is_one_sentence(tmp_path):
    path = write(tmp_path / "p.jsonl", [{"text": "hello", "label": 1}] * 3)
    with pytest.raises(DataError, match=r"p.jsonl has no recognisable preference format \(found columns: text, label"):
        prepare_preferences(DataConfig(source="local", path=path), tmp_path / "out")


def test_data_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"data.path must name"):
        load_config(None, ["data.source=local"])
    with pytest.raises(ConfigError, match=r"data.name must name a hub data set"):
        load_config(None, ["data.source=hub"])
    with pytest.raises(ConfigError, match=r"data.columns: unknown role 'question'"):
        load_config(None, ["data.columns={question: q}"])
    with pytest.raises(ConfigError, match=r"data.max_length_tokens needs data.tokenizer"):
        load_config(None, ["data.max_length_tokens=512"])
    with pytest.raises(ConfigError, match=r"data.format: Input should be 'auto'"):
        load_config(None, ["data.format=pairs"])
    with pytest.raises(ConfigError, match=r"data.max_drop_fraction: Input should be less than or equal to 1"):
        load_config(None, ["data.max_drop_fraction=2"])


@pytest.mark.parametrize("name", ["hh-rlhf", "ultrafeedback"])
def test_hub_example_configs_are_valid(name):
    from tests.conftest import REPO

    cfg = load_config(REPO / "conf" / "examples" / f"{name}.yaml")  # validation only: nothing is downloaded
    assert cfg.data.source == "hub" and cfg.data.tokenizer == cfg.sft.model


def test_source_fingerprint_follows_file_content(tmp_path):
    from rlhf.data.source_checks import source_fingerprint

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n')
    cfg = DataConfig(source="local", path=str(path))
    before = source_fingerprint(cfg)
    assert source_fingerprint(cfg) == before
    path.write_text('{"prompt": "q", "chosen": "a", "rejected": "c"}\n')  # same path, new content
    assert source_fingerprint(cfg) != before
    assert source_fingerprint(DataConfig()) == source_fingerprint(DataConfig())  # synthetic: config only


def test_split_by_prompt_holds_out_whole_prompts():
    from rlhf.data.output import split_positions

    # 10 prompts answered 1..10 times: 55 pairs; 20% -> 11 pairs wanted in eval
    keys = np.repeat(np.arange(10), np.arange(1, 11))
    kept = np.arange(100, 155)  # positions in the source table, one per key
    train, evals = split_positions(kept, 0.2, seed=0, prompt_keys=keys)
    assert sorted(np.concatenate([train, evals])) == list(kept)  # every pair lands once
    prompt_of = dict(zip(kept, keys, strict=True))
    assert not {prompt_of[p] for p in train} & {prompt_of[p] for p in evals}  # no prompt on both sides
    assert 11 <= len(evals) < 11 + 10  # whole prompts until at least 11 pairs: at most one prompt over
    again = split_positions(kept, 0.2, seed=0, prompt_keys=keys)
    assert [list(a) for a in again] == [list(train), list(evals)]  # seeded
    other = split_positions(kept, 0.2, seed=1, prompt_keys=keys)
    assert sorted(other[1]) != sorted(evals)
    by_pair = split_positions(kept, 0.2, seed=0)  # split_by_prompt=false: exactly 11 pairs, prompts shared
    assert len(by_pair[1]) == 11
    with pytest.raises(DataError, match=r"the 5 usable pairs have 1 distinct prompt\(s\): too few"):
        split_positions(np.arange(5), 0.2, seed=0, prompt_keys=np.zeros(5, dtype=np.int64))


def test_ranked_rows_never_straddle_the_split(tmp_path):
    """A ranked row becomes several pairs with one prompt: they go to train or to eval together."""
    path = tmp_path / "ranked.jsonl"
    rows = [{"prompt": f"q{i}", "responses": ["a", "b", "c", "d"], "scores": [4.0, 3.0, 2.0, 1.0]} for i in range(30)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = prepare_preferences(DataConfig(source="local", path=str(path), eval_fraction=0.2), tmp_path / "out")
    train, evals = pd.read_parquet(out.train), pd.read_parquet(out.eval)
    assert len(train) + len(evals) == 90  # 30 rows x (4 - 1) pairs
    assert not set(train["prompt"]) & set(evals["prompt"])
    assert len(evals) == 18 and out.manifest["splits"]["eval"] == "0.2 of train, by prompt"
