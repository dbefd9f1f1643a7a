"""The real tier's instruction task: each constraint's check by hand, the checker reading a rendered chat prompt,
the generated prompts, the shipped pairs, and data.gold_reward through preparation and its errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from rlhf.config import DataConfig
from rlhf.data import instructions
from rlhf.data.prepare import check_source, gold_scorer, prepare_preferences
from rlhf.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CHATML = (  # SmolLM2's template around one user turn
    "<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.mark.parametrize(
    ("constraint", "response", "ok"),
    [
        (instructions.lowercase(), "the sea is calm today.", True),
        (instructions.lowercase(), "The sea is calm today.", False),
        (instructions.lowercase(), "123 ...", False),  # no letters: not an answer in lowercase letters
        (instructions.word_limit(5), "one two three four", True),  # 4 words < 5
        (instructions.word_limit(5), "one two three four five", False),  # 5 is not fewer than 5
        (instructions.word_limit(5), "", False),  # an empty answer is no answer
        (instructions.keyword("river"), "A River runs by.", True),  # case does not matter
        (instructions.keyword("river"), "Rivers run by.", False),  # the word, not a longer one
        (instructions.end_phrase("The end."), "It was fun. The end.  \n", True),  # trailing space is fine
        (instructions.end_phrase("The end."), "The end. It was fun.", False),
        (instructions.bullets(2), "* one\n* two", True),
        (instructions.bullets(2), "Intro:\n- one\n- two\n- three", False),  # 3 bullets
        (instructions.no_commas(), "No commas here.", True),
        (instructions.no_commas(), "Well, yes.", False),
        (instructions.start_word("Well"), "Well I think so.", True),
        (instructions.start_word("Well"), "Wellness matters.", False),  # the word, not a prefix
        (instructions.quoted(), '"All of it."', True),
        (instructions.quoted(), '"Half" of it.', False),
    ],
)
def test_each_constraint_checks_what_its_sentence_says(constraint, response, ok):
    assert constraint.check(response) is ok


def test_the_gold_score_is_the_share_of_the_prompts_constraints_read_from_the_rendered_prompt():
    prompt = "Describe the moon. " + instructions.lowercase().sentence + " " + instructions.keyword("quiet").sentence
    rendered = CHATML.format(prompt)  # the chat template wraps the prompt: the sentences are still found
    assert [c.name for c in instructions.constraints_of(rendered)] == ["lowercase", "keyword"]
    assert instructions.gold_score(rendered, "the moon is quiet.") == 1.0
    assert instructions.gold_score(rendered, "The moon is quiet.") == 0.5  # keyword yes, lowercase no
    assert instructions.gold_score(rendered, "The Moon.") == 0.0
    assert instructions.gold_score(CHATML.format("Describe the moon."), "anything") == 0.0  # no constraint
    assert instructions.gold_reward([rendered, rendered], ["the moon is quiet.", "The Moon."]) == [1.0, 0.0]


def test_prompts_are_deterministic_distinct_and_never_combine_conflicting_constraints():
    train = instructions.make_prompts(300, seed=0, split="train")
    assert train == instructions.make_prompts(300, seed=0, split="train")
    assert len(set(train)) == 300
    assert not set(train) & set(instructions.make_prompts(300, seed=0, split="eval"))
    counts = {1: 0, 2: 0}
    for prompt in train:
        names = [c.name for c in instructions.constraints_of(prompt)]
        counts[len(names)] += 1
        assert len(set(names)) == len(names)
        assert frozenset(names) not in instructions._CONFLICTS
    assert counts[1] > 50 and counts[2] > 50  # both kinds are drawn


def test_the_shipped_pairs_are_the_real_models_samples_labelled_by_the_checker():
    rows = {}
    for split in ("train", "eval"):
        with gzip.open(ROOT / "data" / "instructions" / f"{split}.jsonl.gz", "rt") as f:
            rows[split] = [json.loads(line) for line in f]
    assert len(rows["train"]) >= 300 and len(rows["eval"]) >= 60
    assert not {r["prompt"] for r in rows["train"]} & {r["prompt"] for r in rows["eval"]}  # no held-out leak

    def margin(row):
        chosen, rejected = row["chosen"][-1]["content"], row["rejected"][-1]["content"]
        return instructions.gold_score(row["prompt"], chosen) - instructions.gold_score(row["prompt"], rejected)

    assert all(margin(r) > 0 for r in rows["eval"])  # held-out labels are the checker's
    flipped = sum(margin(r) < 0 for r in rows["train"]) / len(rows["train"])
    assert 0.03 < flipped < 0.2  # 10% label noise on the training pairs
    assert all(r["chosen"][0] == {"role": "user", "content": r["prompt"]} for r in rows["train"])


def test_data_gold_reward_is_the_manifests_gold_scorer(tmp_path):
    rows = [
        {
            "prompt": f"Tell me about bees {i}. {instructions.no_commas().sentence}",
            "chosen": "Bees hum.",
            "rejected": "Bees, yes.",
        }
        for i in range(20)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(source="local", path=str(path), gold_reward=instructions.GOLD_REWARD)
    manifest = prepare_preferences(cfg, tmp_path / "prepared").manifest
    assert manifest["gold_reward"] == instructions.GOLD_REWARD and manifest["gold_reward_digest"]
    gold = gold_scorer(manifest)
    assert gold(rows[0]["prompt"], "Bees hum.") == 1.0 and gold(rows[0]["prompt"], "Bees, yes.") == 0.0
    plain = prepare_preferences(DataConfig(source="local", path=str(path)), tmp_path / "plain").manifest
    assert gold_scorer(plain) is None


def test_a_gold_reward_that_does_not_import_is_refused_before_anything_is_read(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    cfg = DataConfig(source="local", path=str(path), gold_reward="rlhf.data.instructions:no_such_checker")
    with pytest.raises(ConfigError, match="data.gold_reward: module 'rlhf.data.instructions' has no attribute"):
        check_source(cfg)
    with pytest.raises(ValueError, match="data.gold_reward applies to 'local' and 'hub' sources"):
        DataConfig(source="synthetic", gold_reward=instructions.GOLD_REWARD)
