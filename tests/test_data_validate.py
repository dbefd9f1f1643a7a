"""Validation rules: every drop reason is counted, the drop-fraction stop, length limits, the prompt source."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from rlhf.config import DataConfig, RuntimeConfig
from rlhf.data.lengths import LengthLimits
from rlhf.data.prepare import drop_report, prepare_preferences
from rlhf.errors import DataError
from rlhf.models.bootstrap import build_tokenizer


def good(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(start, start + n)]


def prepare(tmp_path, rows: list[dict], name: str = "data.jsonl", **cfg):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return prepare_preferences(DataConfig(source="local", path=str(path), **cfg), tmp_path / "out")


def drops(out) -> dict[str, int]:
    return {k: v for k, v in out.manifest["dropped"].items() if v}


def test_missing_or_empty_fields_are_dropped(tmp_path):
    bad = [
        {"prompt": None, "chosen": "a", "rejected": "b"},
        {"prompt": "q", "chosen": "", "rejected": "b"},
        {"prompt": "q", "chosen": "a", "rejected": "  \n"},
        {"prompt": "q", "chosen": "a"},  # no value at all in this row
    ]
    out = prepare(tmp_path, good(10) + bad)
    assert drops(out) == {"missing": 4}
    assert out.manifest["drop_examples"]["missing"].startswith("row 10 of")  # first bad row, 0-based
    assert out.manifest["rows"]["train"] + out.manifest["rows"]["eval"] == 10


def test_non_string_content_is_dropped(tmp_path):
    bad = [{"prompt": "q", "chosen": 5, "rejected": "b"}, {"prompt": ["q"], "chosen": "a", "rejected": "b"}]
    assert drops(prepare(tmp_path, good(10) + bad)) == {"not_string": 2}


def test_identical_chosen_and_rejected_are_dropped(tmp_path):
    out = prepare(tmp_path, good(10) + [{"prompt": "q", "chosen": "same", "rejected": "same"}])
    assert drops(out) == {"identical": 1}
    transcript = "\n\nHuman: hi\n\nAssistant: yes"
    implicit = [
        {"chosen": f"\n\nHuman: {i}\n\nAssistant: a", "rejected": f"\n\nHuman: {i}\n\nAssistant: b"} for i in range(9)
    ]
    out = prepare(tmp_path, implicit + [{"chosen": transcript, "rejected": transcript}], name="hh.jsonl")
    assert drops(out) == {"identical": 1}


def test_exact_duplicates_are_removed_and_eval_repeats_of_train_too(tmp_path):
    out = prepare(tmp_path, good(10) + good(3) + [{"prompt": "q1", "chosen": "good 1", "rejected": "other"}])
    assert drops(out) == {"duplicate": 3}  # the last row differs in rejected: kept
    assert out.manifest["drop_examples"]["duplicate"].startswith("row 10 of")
    held = tmp_path / "eval.jsonl"
    held.write_text("\n".join(json.dumps(r) for r in good(2) + good(3, start=50)))
    out = prepare(tmp_path, good(10), eval_path=str(held))
    assert drops(out) == {"duplicate": 2} and out.manifest["rows"]["eval"] == 3


def test_malformed_structures_are_dropped(tmp_path):
    def msgs(*turns):
        return [{"role": r, "content": c} for r, c in turns]

    rows = [
        {"chosen": msgs(("user", f"q{i}"), ("assistant", "a")), "rejected": msgs(("user", f"q{i}"), ("assistant", "b"))}
        for i in range(10)
    ]
    rows += [
        {
            "chosen": msgs(("user", "q"), ("user", "a")),
            "rejected": msgs(("user", "q"), ("assistant", "b")),
        },  # not assistant last
        {"chosen": msgs(("user", "q"), ("assistant", "a")), "rejected": msgs(("user", "other"), ("assistant", "b"))},
        {"chosen": [{"content": "no role"}], "rejected": msgs(("user", "q"), ("assistant", "b"))},
        {"chosen": msgs(("user", "q"), ("assistant", None)), "rejected": msgs(("user", "q"), ("assistant", "b"))},
        {"chosen": msgs(("user", "q"), ("assistant", 7)), "rejected": msgs(("user", "q"), ("assistant", "b"))},
    ]
    assert drops(prepare(tmp_path, rows)) == {"malformed": 3, "missing": 1, "not_string": 1}
    implicit = [
        {"chosen": f"\n\nHuman: {i}\n\nAssistant: a", "rejected": f"\n\nHuman: {i}\n\nAssistant: b"} for i in range(9)
    ]
    implicit.append({"chosen": "no markers here: a", "rejected": "no markers here: b"})
    assert drops(prepare(tmp_path, implicit, name="hh.jsonl")) == {"malformed": 1}


def test_ranked_ties_and_mismatched_scores(tmp_path):
    rows = [{"prompt": f"q{i}", "responses": ["a", "b"], "scores": [1, 2]} for i in range(10)]
    rows.append({"prompt": "t", "responses": ["a", "b", "c"], "scores": [2, 2, 1]})  # b ties with a: 1 tie, 1 pair
    rows.append({"prompt": "m", "responses": ["a", "b"], "scores": [1]})  # one score for two responses
    out = prepare(tmp_path, rows)
    assert drops(out) == {"tie": 1, "malformed": 1}
    assert out.manifest["rows_in"] == 10 + 2 + 1


def test_length_limit_in_characters(tmp_path):
    rows = good(10) + [{"prompt": "q", "chosen": "x" * 50, "rejected": "short"}]
    # "q" + 50 characters = 51 > 40; the good rows are at most "q9" + "good 9" = 8
    assert drops(prepare(tmp_path, rows, max_length_chars=40)) == {"too_long": 1}


def test_length_limit_in_tokens_uses_the_tokenizer(tmp_path):
    tok = build_tokenizer(["good bad hello world"] * 20, vocab_size=300)
    tok.save_pretrained(tmp_path / "tok")
    long_text = " ".join(["hello"] * 30)
    rows = good(10) + [{"prompt": "q", "chosen": "fine", "rejected": long_text}]
    n_tokens = len(tok("q" + long_text)["input_ids"])
    assert n_tokens > 20 >= max(len(tok(r["prompt"] + r["chosen"])["input_ids"]) for r in good(10))
    out = prepare(tmp_path, rows, max_length_tokens=20, tokenizer=str(tmp_path / "tok"))
    assert drops(out) == {"too_long": 1}
    with pytest.raises(DataError, match=r"data.tokenizer: could not load tokenizer"):
        prepare(tmp_path, rows, max_length_tokens=20, tokenizer=str(tmp_path / "no-such-tokenizer"))


def test_too_many_drops_stop_with_the_dominant_reason_and_an_example(tmp_path):
    rows = (
        good(4)
        + [{"prompt": "q", "chosen": "s", "rejected": "s"}] * 5
        + [{"prompt": None, "chosen": "a", "rejected": "b"}]
    )
    with pytest.raises(
        DataError,
        match=r"6 of 10 pairs \(60%\) were dropped, more than data.max_drop_fraction \(0.5\), "
        r"mostly identical: identical chosen and rejected \(5 rows, e.g. row 4 of .*data.jsonl\)",
    ):
        prepare(tmp_path, rows)
    assert not (tmp_path / "out").exists()
    out = prepare(tmp_path, rows, max_drop_fraction=0.7)
    assert drops(out) == {"identical": 5, "missing": 1}  # identical comes before duplicate: each row counts once


def test_nothing_usable_is_one_sentence(tmp_path):
    rows = [{"prompt": "q", "chosen": f"s{i}", "rejected": f"s{i}"} for i in range(3)]
    with pytest.raises(DataError, match=r"no usable preference pairs, all 3 were dropped, mostly identical"):
        prepare(tmp_path, rows, max_drop_fraction=1.0)


def test_separate_prompt_source(tmp_path):
    prompts = tmp_path / "prompts.csv"
    pd.DataFrame({"text": ["p1", "p2", "p1", None, "p3"]}).to_csv(prompts, index=False)
    out = prepare(tmp_path, good(10), prompts_path=str(prompts), prompts_column="text")
    assert pd.read_parquet(out.prompts)["prompt"].tolist() == ["p1", "p2", "p3"]
    assert {k: v for k, v in out.manifest["prompts_dropped"].items() if v} == {"missing": 1, "duplicate": 1}
    with pytest.raises(DataError, match=r"data.prompts_column: column 'prompt' is not in .*prompts.csv"):
        prepare(tmp_path, good(10), prompts_path=str(prompts))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}))
    out = prepare(tmp_path, good(10), prompts_path=str(chats))
    assert pd.read_parquet(out.prompts)["prompt"].tolist() == ["\n\nUser: hi\n\nAssistant:"]


def test_prepare_task_logs_drops_to_mlflow(tmp_path, harness):
    from mlflow.tracking import MlflowClient
    from prefect import flow
    from prefect.results import ResultStore

    from rlhf.tracking.client import Tracker
    from tasks.outputs import PreparedData
    from tasks.stages import prepare_preferences as prepare_task
    from tasks.tracking import TrackingContext

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in good(10) + good(2)))
    build_tokenizer(["good bad q"] * 20, vocab_size=300).save_pretrained(tmp_path / "tok")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "t", str(tmp_path / "artifacts"))
    ctx = TrackingContext(
        uri=uri, experiment="t", artifact_location=str(tmp_path / "artifacts"), parent_run_id=tracker.start_run("p")
    )

    @flow
    def prepare_only() -> PreparedData:  # a task run in a flow run: its folder and its table artifact need them
        return prepare_task(
            DataConfig(source="local", path=str(path), tokenizer=str(tmp_path / "tok")),
            "digest",
            RuntimeConfig(output_dir=str(tmp_path / "o")),
            ctx,
            LengthLimits(prompt_tokens=1, pair_tokens=64, sft_tokens=64),
        )

    result = prepare_only()
    # the folder the task wrote is named by the key Prefect cached its result under
    assert ResultStore().read(Path(result.path).name).result == result
    assert (
        isinstance(result, PreparedData)
        and Path(result.path).parent == (tmp_path / "o").resolve() / "prepare_preferences"
    )
    metrics = MlflowClient(uri).get_run(result.mlflow_run_id).data.metrics
    assert metrics["data/dropped_duplicate"] == 2 and metrics["data/dropped_missing"] == 0
    assert metrics["data/rows_prompts"] == 9  # the distinct training prompts (one of 10 pairs is held out)
    table = drop_report(result.manifest)
    assert {"reason": "duplicate", "count": 2}.items() <= table[-1].items()
    # the length report: every prompt ("q0".."q9", 2 tokens or more) is over 1 token, no pair over 64
    assert metrics["data/over_ppo_max_prompt_tokens_fraction"] == 1.0
    assert metrics["data/over_reward_max_length_fraction"] == 0.0
    assert result.manifest["warnings"][0].startswith("100% of the PPO prompts (9 of 9) are longer than")
    names = [a.path for a in MlflowClient(uri).list_artifacts(result.mlflow_run_id, "data")]
    assert {"data/dropped.json", "data/lengths.json", "data/prompts.parquet"} <= set(names)


def test_token_lengths_match_the_tokenizer_call():
    from rlhf.data.validate import token_lengths

    tok = build_tokenizer(["good bad hello world"] * 20, vocab_size=300)
    texts = ["hello world", "good", "ünïcödé 😀 \n\nAssistant: x", ""]
    expected = [len(ids) for ids in tok(texts)["input_ids"]]
    assert token_lengths(tok, texts) == expected  # the fast backend path
    tok.backend_tokenizer.enable_truncation(2)  # a saved truncation: the plain call is used (it never truncates)
    assert token_lengths(tok, texts) == expected
