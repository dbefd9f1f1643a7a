"""Preference layouts: each format is detected from its columns, and each can be mapped from other column names."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rlhf.config import DataConfig
from rlhf.data.formats import ChatRenderer, plan_columns
from rlhf.data.prepare import prepare_preferences
from rlhf.errors import DataError
from rlhf.models.bootstrap import build_tokenizer


def prepare(tmp_path, rows: list[dict], **cfg):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = prepare_preferences(DataConfig(source="local", path=str(path), eval_fraction=0.25, **cfg), tmp_path / "out")
    both = pd.concat([pd.read_parquet(out.train), pd.read_parquet(out.eval)]).sort_values("prompt")
    return out.manifest, both.reset_index(drop=True)


def hh(i: int) -> dict:
    # two turns; the pair differs only in the last assistant turn
    history = f"\n\nHuman: hi {i}\n\nAssistant: hello\n\nHuman: tell me about {i}?\n\nAssistant:"
    return {"chosen": history + f" Sure, {i} is prime.", "rejected": history + " Sure, no."}


def messages(user: str, assistant: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def test_explicit_detected_and_mapped(tmp_path):
    manifest, rows = prepare(tmp_path, [{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(4)])
    assert manifest["format"] == "explicit" and rows.loc[0, ["prompt", "chosen", "rejected"]].tolist() == [
        "q0",
        "a",
        "b",
    ]
    # StackExchange-paired layout, mapped by hand
    rows_in = [{"question": f"q{i}", "response_j": "good", "response_k": "bad"} for i in range(4)]
    mapping = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    manifest, rows = prepare(tmp_path, rows_in, columns=mapping)
    assert manifest["format"] == "explicit" and manifest["columns"] == mapping
    assert rows.loc[0, ["prompt", "chosen", "rejected"]].tolist() == ["q0", "good", "bad"]


def test_implicit_prompt_is_the_common_prefix_up_to_the_last_assistant_marker(tmp_path):
    manifest, rows = prepare(tmp_path, [hh(i) for i in range(4)])
    assert manifest["format"] == "implicit"
    assert rows.loc[0, "prompt"] == "\n\nHuman: hi 0\n\nAssistant: hello\n\nHuman: tell me about 0?\n\nAssistant:"
    # the common prefix " Sure, " is not part of the prompt: it ends at the marker
    assert rows.loc[0, ["chosen", "rejected"]].tolist() == [" Sure, 0 is prime.", " Sure, no."]


def test_implicit_mapped_and_custom_marker(tmp_path):
    rows_in = [{"good": f"USER: q{i} BOT: yes", "bad": f"USER: q{i} BOT: no"} for i in range(4)]
    manifest, rows = prepare(
        tmp_path, rows_in, format="implicit", columns={"chosen": "good", "rejected": "bad"}, assistant_marker="BOT:"
    )
    assert manifest["format"] == "implicit"
    assert rows.loc[0, ["prompt", "chosen", "rejected"]].tolist() == ["USER: q0 BOT:", " yes", " no"]


def test_conversational_detected_with_plain_template_and_score_margin(tmp_path):
    # UltraFeedback-binarized: prompt string, chosen/rejected include the user turn, scores per response
    rows_in = [
        {
            "prompt": f"q{i}",
            "chosen": messages(f"q{i}", "good"),
            "rejected": messages(f"q{i}", "bad"),
            "score_chosen": 8.0,
            "score_rejected": 5.5 if i else None,
        }
        for i in range(4)
    ]
    manifest, rows = prepare(tmp_path, rows_in)
    assert manifest["format"] == "conversational"
    assert rows.loc[0, ["prompt", "chosen", "rejected"]].tolist() == ["\n\nUser: q0\n\nAssistant:", " good", " bad"]
    assert pd.isna(rows.loc[0, "margin"]) and rows.loc[1, "margin"] == pytest.approx(2.5)  # 8.0 - 5.5


def test_conversational_mapped_with_prompt_messages(tmp_path):
    # TRL layout: a prompt message list, chosen/rejected hold only the assistant turn; mapped column names
    rows_in = [
        {
            "context": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}],
            "win": [{"role": "assistant", "content": "yes"}],
            "lose": [{"role": "assistant", "content": "no"}],
            "chosen_rating": 5,
            "rejected_rating": 2,
        }
        for i in range(4)
    ]
    manifest, rows = prepare(tmp_path, rows_in, columns={"prompt": "context", "chosen": "win", "rejected": "lose"})
    assert manifest["format"] == "conversational"
    assert rows.loc[0, "prompt"] == "\n\nSystem: be brief\n\nUser: q0\n\nAssistant:"
    assert rows.loc[0, "margin"] == 3.0  # the chosen_rating / rejected_rating alias


def test_conversational_uses_the_tokenizer_chat_template(tmp_path):
    tok = build_tokenizer(["hello world"] * 10, vocab_size=300)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    rows_in = [{"chosen": messages(f"q{i}", "good"), "rejected": messages(f"q{i}", "bad")} for i in range(4)]
    manifest, rows = prepare(tmp_path, rows_in, tokenizer=str(tmp_path / "tok"))
    assert rows.loc[0, ["prompt", "chosen", "rejected"]].tolist() == ["<user>q0</s><assistant>", "good</s>", "bad</s>"]


def test_ranked_detected_best_versus_each_other(tmp_path):
    rows_in = [{"prompt": f"q{i}", "responses": ["a", "b", "c"], "scores": [1.0, 3.0, 2.0]} for i in range(4)]
    manifest, rows = prepare(tmp_path, rows_in)
    assert manifest["format"] == "ranked" and manifest["rows_in"] == 8  # 4 rows x (3 - 1) pairs
    first = rows[rows["prompt"] == "q0"].sort_values("rejected")
    # best is "b" (3.0): pairs b>a with margin 3-1 = 2, b>c with margin 3-2 = 1
    assert first[["chosen", "rejected", "margin"]].values.tolist() == [["b", "a", 2.0], ["b", "c", 1.0]]


def test_ranked_mapped_with_ranks(tmp_path):
    rows_in = [{"instruction": f"q{i}", "completions": ["x", "y"], "rank": [2, 1]} for i in range(4)]
    mapping = {"prompt": "instruction", "responses": "completions", "ranks": "rank"}
    manifest, rows = prepare(tmp_path, rows_in, columns=mapping)
    assert manifest["format"] == "ranked"
    assert rows.loc[0, ["chosen", "rejected"]].tolist() == ["y", "x"] and pd.isna(rows.loc[0, "margin"])


def test_explicit_margin_column_is_kept(tmp_path):
    rows_in = [{"prompt": f"q{i}", "chosen": "a", "rejected": "b", "margin": 0.5 * i} for i in range(4)]
    _, rows = prepare(tmp_path, rows_in)
    assert rows["margin"].tolist() == [0.0, 0.5, 1.0, 1.5]


def test_forced_format_with_missing_role_names_the_column():
    with pytest.raises(DataError, match=r"src has no column 'scores' or 'ranks' for the ranked format"):
        plan_columns(["prompt", "responses"], {}, "ranked", {}, "src")
    with pytest.raises(DataError, match=r"src has no column 'prompt' for the explicit format"):
        plan_columns(["chosen", "rejected"], {}, "explicit", {}, "src")


def test_plain_template_renders_roles():
    chat = ChatRenderer()
    context = [{"role": "user", "content": "hi"}]
    prompt = chat.prompt(context)
    assert prompt == "\n\nUser: hi\n\nAssistant:"
    assert chat.response(context, prompt, {"role": "assistant", "content": "hello"}) == " hello"
