"""Chat data rendered with the policy's tokenizer: data.tokenizer defaults to sft.model, and the SFT demonstrations,
the reward pairs and the PPO prompts all carry the chat template's text."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from rlhf.config import load_config
from rlhf.data.prepare import prepare_preferences
from rlhf.models.bootstrap import build_tokenizer

QWEN_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEN = "<|im_start|>assistant\n"  # the template's generation prompt
END = "<|im_end|>\n"  # the template's end of a turn


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    """A tiny byte-level BPE tokenizer with a Qwen-style chat template, saved to a folder."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["user assistant system hello good bad question"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=specials[1:]
    )
    fast.chat_template = QWEN_TEMPLATE
    folder = tmp_path_factory.mktemp("chat-tok")
    fast.save_pretrained(folder)
    return str(folder)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def prepare(tmp_path, rows: list[dict], tokenizer: str | None, *overrides: str):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    model = [f"sft.model={tokenizer}"] if tokenizer else []
    config = load_config(
        None, ["data.source=local", f"data.path={path}", "data.eval_fraction=0.25", *model, *overrides]
    )
    out = prepare_preferences(config.data, tmp_path / "out")
    read = pd.read_parquet
    return out, read(out.train), read(out.eval), read(out.sft), read(out.prompts)["prompt"].tolist()


def rendered(*messages: dict) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}{END}" for m in messages) + GEN


def test_data_tokenizer_defaults_to_the_policy_model(chat_tokenizer):
    config = load_config(None, [f"sft.model={chat_tokenizer}", "sft.revision=v1"])
    assert config.data.tokenizer == chat_tokenizer and config.data.tokenizer_revision == "v1"
    other = load_config(None, [f"sft.model={chat_tokenizer}", "data.tokenizer=gpt2"])
    assert other.data.tokenizer == "gpt2" and other.data.tokenizer_revision is None  # overridable
    assert load_config().data.tokenizer is None  # the bootstrap model: no tokenizer before the SFT stage
    again = type(config).model_validate(config.model_dump())
    assert again.data == config.data


def check_everywhere(train, evals, sft, prompts, expected: dict[str, tuple[str, str, str]]):
    """Every pair, demonstration and PPO prompt carries the rendered text of its source row."""
    pairs = pd.concat([train, evals])
    assert len(pairs) == len(expected)
    for row in pairs.itertuples():
        assert (row.prompt, row.chosen, row.rejected) == expected[row.prompt]
        assert row.prompt.endswith(GEN) and row.chosen.endswith(END) and row.rejected.endswith(END)
    assert list(sft.itertuples(index=False, name=None)) == [(p, c) for p, c, _ in train.values[:, :3]]
    assert sorted(prompts) == sorted(set(train["prompt"])) and all(p.endswith(GEN) for p in prompts)


def test_ultrafeedback_layout_rendered_with_the_chat_template(tmp_path, chat_tokenizer):
    rows = [
        {"prompt": f"question {i}", "chosen": [user(f"question {i}"), assistant(f"good {i}")],
         "rejected": [user(f"question {i}"), assistant("bad")], "score_chosen": 8.0, "score_rejected": 3.0}
        for i in range(8)
    ]  # fmt: skip
    out, train, evals, sft, prompts = prepare(tmp_path, rows, chat_tokenizer)
    assert out.manifest["format"] == "conversational"
    expected = {
        rendered(user(f"question {i}")): (rendered(user(f"question {i}")), f"good {i}{END}", f"bad{END}")
        for i in range(8)
    }
    check_everywhere(train, evals, sft, prompts, expected)
    assert train["margin"].eq(5.0).all()


def test_trl_layout_rendered_with_the_chat_template(tmp_path, chat_tokenizer):
    system = {"role": "system", "content": "be brief"}
    rows = [
        {"prompt": [system, user(f"question {i}")], "chosen": [assistant(f"good {i}")], "rejected": [assistant("bad")]}
        for i in range(8)
    ]
    out, train, evals, sft, prompts = prepare(tmp_path, rows, chat_tokenizer)
    prompt = [rendered(system, user(f"question {i}")) for i in range(8)]
    check_everywhere(train, evals, sft, prompts, {p: (p, f"good {i}{END}", f"bad{END}") for i, p in enumerate(prompt)})
    # a separate prompt source of plain strings: rendered as a user turn, like the pairs' prompts
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"new {i}"}) for i in range(3)))
    *_, prompts = prepare(tmp_path, rows, chat_tokenizer, f"data.prompts_path={tmp_path / 'prompts.jsonl'}")
    assert prompts == [rendered(user(f"new {i}")) for i in range(3)]


def test_hh_transcripts_rendered_with_the_chat_template(tmp_path, chat_tokenizer):
    rows = []
    for i in range(8):
        history = f"\n\nHuman: hi {i}\n\nAssistant: hello\n\nHuman: what is {i} + 1?\n\nAssistant:"
        rows.append({"chosen": history + f" It is {i + 1}.", "rejected": history + " No idea."})
    # the answers diverge before the last turn: a response that goes on with another turn is malformed
    rows.append(
        {
            "chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d",
            "rejected": "\n\nHuman: a\n\nAssistant: x",
        }
    )
    out, train, evals, sft, prompts = prepare(tmp_path, rows, chat_tokenizer)
    assert out.manifest["format"] == "implicit" and out.manifest["dropped"]["malformed"] == 1
    expected = {}
    for i in range(8):
        prompt = rendered(user(f"hi {i}"), assistant("hello"), user(f"what is {i} + 1?"))
        expected[prompt] = (prompt, f"It is {i + 1}.{END}", f"No idea.{END}")
    check_everywhere(train, evals, sft, prompts, expected)
    # the policy has no chat template (the tiny GPT-2): HH text is used as it is, the documented plain fallback
    plain = build_tokenizer(["hello world"] * 10, vocab_size=300)
    plain.save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "config.json").write_text("{}")
    _, train, *_ = prepare(tmp_path, rows[:8], None, f"data.tokenizer={tmp_path / 'plain'}")
    assert train["prompt"].str.endswith("?\n\nAssistant:").all() and train["rejected"].eq(" No idea.").all()
