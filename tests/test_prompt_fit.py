"""Prompts that keep their template: a chat prompt over ppo.max_prompt_tokens keeps its template's head (system
prompt and first user header) and its last turns, the oldest dropped whole; plain prompts are left-truncated as
before. And logged responses show the special tokens inside them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import PPOConfig
from rlhf.data.formats import ChatRenderer, Markers, transcript_messages
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.records import rollout_records
from rlhf.ppo.trainer import truncated_prompts
from rlhf.rollout.batching import encode_prompts, keep_last
from rlhf.rollout.generation import Responses, response_texts
from rlhf.rollout.prompt_fit import chat_layout, fit_prompts
from tests.model_zoo import SMOLLM2_STYLE, SPECS, build_tokenizer

DIST = DistContext(device=torch.device("cpu"))
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
HEAD = SYSTEM + "<|im_start|>user\n"  # the SmolLM2 template's head: system prompt and first user header
GEN = "<|im_start|>assistant\n"  # its generation prompt
HH = Markers("\n\nHuman:", "\n\nAssistant:")


@pytest.fixture(scope="module")
def smol():
    """A SmolLM2-like tokenizer: ChatML with a default system prompt."""
    return build_tokenizer(SMOLLM2_STYLE)


def hh(*turns: str) -> str:
    """An HH-RLHF transcript prompt: alternating Human / Assistant turns, ending with the assistant's slot."""
    text = "".join(f"{HH.user if i % 2 == 0 else HH.assistant} {t}" for i, t in enumerate(turns))
    return text + HH.assistant


def rendered(tok, transcript: str) -> str:
    """The prompt as data preparation renders an HH transcript with the policy's chat template."""
    return ChatRenderer(tok).prompt(transcript_messages(transcript, HH))


@pytest.mark.parametrize(
    "family, header",
    [
        ("smollm2", "<|im_end|>\n<|im_start|>user\n"),  # the system turn's end is part of what precedes user 1
        ("qwen2", "<|im_start|>user\n"),
        ("llama", "<|start_header_id|>user<|end_header_id|>\n\n"),
        ("gemma", "<start_of_turn>user\n"),
        ("mistral", "[INST] "),
        ("phi3", "<|user|>\n"),
        ("gpt2", None),  # no chat template: plain prompts
    ],
)
def test_the_user_header_is_found_from_the_template(family, header):
    style = SMOLLM2_STYLE if family == "smollm2" else SPECS[family].style
    layout = chat_layout(build_tokenizer(style))
    assert (layout.user_header if layout else None) == header


def test_a_long_hh_prompt_keeps_its_template_head_and_its_last_turns(smol):
    q = "the plot was good and the cast was great and the music was superb."
    turns = [f"question {i}: {q}" if i % 2 == 0 else f"answer {i}: {q}" for i in range(6)]  # 3 user, 3 assistant
    prompt = rendered(smol, hh(*turns, f"question 6: {q} {q} {q}"))  # a long last question
    assert prompt.startswith(HEAD) and prompt.endswith(GEN)
    full = encode_prompts(smol, [prompt])[0]
    # by hand: the prompt from its 2nd, 3rd, 4th user turn on, behind the head (1, 2, 3 exchanges dropped)
    later = prompt.removeprefix(HEAD).split("<|im_start|>user\n")[1:]
    by_turns = [HEAD + "<|im_start|>user\n".join(later[k:]) for k in range(len(later))]
    lengths = [len(encode_prompts(smol, [text])[0]) for text in by_turns]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] < len(full)
    head = len(encode_prompts(smol, [HEAD])[0])
    assert lengths[-1] > 2 * head  # so that a cut inside the last question keeps the head (at most half the budget)
    for limit in (len(full) - 1, lengths[0], lengths[0] - 1, lengths[-1], lengths[-1] - 1, 2 * head):
        fit = fit_prompts(smol, [prompt], limit)
        (ids,) = fit.ids
        text = smol.decode(ids)
        assert len(ids) <= limit and fit.truncated == 1 and fit.head_kept == 1
        assert text.startswith(HEAD) and text.endswith(GEN), text  # in its template from start to end
        expected = next((t for t, n in zip(by_turns, lengths, strict=True) if n <= limit), None)
        if expected is not None:  # the oldest exchanges dropped whole, as few as make it fit
            assert text == expected
        else:  # even the last question does not fit: the head, then the last tokens of that question
            assert len(ids) == limit and by_turns[-1].endswith(text.removeprefix(HEAD))
            assert not text.removeprefix(HEAD).startswith("question")


def test_a_prompt_that_fits_and_plain_prompts_are_as_before(smol, tiny_checkpoints):
    from rlhf.models.loading import load_tokenizer

    prompt = rendered(smol, hh("hi", "hello", "the plot was good"))
    assert fit_prompts(smol, [prompt], 500).ids == encode_prompts(smol, [prompt])  # fits: untouched
    plain = hh("the plot was good and the cast was great", "yes", "and the music was superb and the film long")
    for tok, text in ((smol, plain), (load_tokenizer(tiny_checkpoints["policy"]), plain)):  # no template in them
        fit = fit_prompts(tok, [text], 10)
        assert fit.ids == [keep_last(encode_prompts(tok, [text])[0], 0, 10)] and fit.head_kept == 0
    # a head that would take more than half of the budget: the plain cut
    long = rendered(smol, hh("the plot was good " * 10))
    head = len(smol(HEAD)["input_ids"])
    assert fit_prompts(smol, [long], 2 * head - 1).ids == [encode_prompts(smol, [long])[0][-(2 * head - 1) :]]


def test_ppo_reports_the_share_cut_and_says_how(smol, caplog):
    q = "the plot was good and the cast was great and the music was superb."
    prompts = [rendered(smol, hh(q, q, q)), rendered(smol, hh("hi")), rendered(smol, hh(q, q, q, q, q))]
    limit = len(encode_prompts(smol, [prompts[0]])[0]) - 1
    with caplog.at_level(logging.WARNING, logger="rlhf.ppo.trainer"):
        ids, stats = truncated_prompts(smol, prompts, PPOConfig(max_prompt_tokens=limit), DIST)
    assert stats == {"ppo/prompts_truncated_fraction": pytest.approx(2 / 3)}
    assert all(smol.decode(row).startswith(HEAD) and smol.decode(row).endswith(GEN) for row in ids)
    assert "67% of the PPO prompts are longer than ppo.max_prompt_tokens" in caplog.text
    assert "lose their oldest turns (the chat template's head and the last turns kept)" in caplog.text


def test_logged_responses_show_special_tokens_inside_them(smol):
    the = smol("the plot was good")["input_ids"]
    end, start = smol.convert_tokens_to_ids("<|im_end|>"), smol.convert_tokens_to_ids("<|im_start|>")
    rows = [
        the + [end],  # a clean answer: reads as before
        the + [start] + smol("assistant\nmore")["input_ids"] + [end],  # the policy wrote the next turn's header
        the + [start],  # cut at max_new_tokens right after a leaked token: it stays
    ]
    width = max(map(len, rows))
    tokens = torch.full((3, width), smol.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    resp = Responses(tokens, mask, torch.tensor([True, True, False]))
    texts = response_texts(smol, resp)
    assert texts == [
        "the plot was good",
        "the plot was good<|im_start|>assistant\nmore",
        "the plot was good<|im_start|>",
    ]
    hidden = smol.batch_decode(tokens.masked_fill(mask == 0, smol.pad_token_id), skip_special_tokens=True)
    assert texts[0] == hidden[0] and "<|im_start|>" not in hidden[1]  # what the old decoding logged
    # the rollout records carry them
    rollout = SimpleNamespace(
        scored=SimpleNamespace(resp=resp, scores=torch.zeros(3)),
        indices=[0, 1, 2],
        shaped_scores=torch.zeros(3),
        kl=torch.zeros(3, width),
        non_score_rewards=torch.zeros(3, width),
    )
    records = rollout_records(SimpleNamespace(tokenizer=smol), 0, ["p0", "p1", "p2"], rollout, None)
    assert records["response"].tolist() == texts
