"""The prepare stage's length report: per stage limit, the share of prompts and pairs over it, checked against a
direct count on an HH-layout file; characters when there is no tokenizer; the limits are part of the cache key."""

from __future__ import annotations

import json
import random

import numpy as np
import pandas as pd
import pytest

from rlhf.config import load_config
from rlhf.data.lengths import LengthLimits, length_metrics
from rlhf.data.prepare import length_table, prepare_preferences
from rlhf.models.bootstrap import build_tokenizer
from rlhf.models.loading import load_tokenizer

WORDS = "the a film plot music was great dull superb long short story actor scene".split()


def hh_file(path, n: int = 50, seed: int = 0) -> str:
    """HH-RLHF layout: multi-turn "\\n\\nHuman:" / "\\n\\nAssistant:" transcripts, some long."""
    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = []
    for i in range(n):
        long = i % 5 == 0
        history = "".join(
            f"\n\nHuman: {say(rng.randint(3, 12))}\n\nAssistant: {say(rng.randint(3, 12))}"
            for _ in range(rng.randint(0, 4 if long else 1))
        )
        history += f"\n\nHuman: question {i} {say(rng.randint(20, 40) if long else rng.randint(2, 8))}\n\nAssistant:"
        chosen, rejected = say(rng.randint(2, 40)), say(rng.randint(2, 10))
        rows.append({"chosen": f"{history} {chosen}", "rejected": f"{history} {rejected}"})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer([" ".join(WORDS)] * 20, vocab_size=300).save_pretrained(folder)
    return str(folder)


def test_length_shares_match_a_direct_count(tmp_path, tokenizer_dir):
    path = hh_file(tmp_path / "hh.jsonl")
    config = load_config(
        None,
        ["data.source=local", f"data.path={path}", f"data.tokenizer={tokenizer_dir}", "ppo.max_prompt_tokens=40"]
        + ["reward.max_length=64", "sft.model=gpt2", "sft.finetune=true", "sft.max_length=60"],
    )
    assert config.data.tokenizer == tokenizer_dir  # set explicitly: sft.model does not replace it
    limits = LengthLimits.from_config(config)
    assert limits == LengthLimits(prompt_tokens=40, pair_tokens=64, sft_tokens=60)
    out = prepare_preferences(config.data, tmp_path / "out", limits)
    section = out.manifest["lengths"]
    assert section["unit"] == "tokens" and section["tokenizer"] == tokenizer_dir

    # a direct count over the written files with the tokenizer, as the stages encode the texts
    tok = load_tokenizer(tokenizer_dir)

    def n(texts) -> np.ndarray:
        return np.array([len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts])

    pairs = pd.concat([pd.read_parquet(out.train), pd.read_parquet(out.eval)])
    sft, prompts = pd.read_parquet(out.sft), pd.read_parquet(out.prompts)["prompt"]
    pair_len = n(pairs["prompt"]) + np.maximum(n(pairs["chosen"]), n(pairs["rejected"])) + 1
    demo_len = n(sft["prompt"]) + n(sft["response"]) + 1
    expected = {
        "ppo.max_prompt_tokens": (int((n(prompts) > 40).sum()), len(prompts)),
        "reward.max_length": (int((pair_len > 64).sum()), len(pairs)),
        "sft.max_length": (int((demo_len > 60).sum()), len(sft)),
    }
    found = {key: (item["over"], item["of"]) for key, item in section["over_limit"].items()}
    assert found == expected
    for key, (over, of) in expected.items():
        assert 0 < over < of  # the sample has both
        assert section["over_limit"][key]["fraction"] == pytest.approx(over / of, abs=1e-6)
    assert section["over_limit"]["reward.max_length"]["p90"] == pytest.approx(np.percentile(pair_len, 90), abs=0.05)
    assert section["prompt"]["p50"] == pytest.approx(np.percentile(n(pairs["prompt"]), 50), abs=0.05)
    responses = np.concatenate([n(pairs["chosen"]), n(pairs["rejected"])])
    assert section["response"]["p99"] == pytest.approx(np.percentile(responses, 99), abs=0.05)
    assert section["response"]["max"] == responses.max()

    # a warning per limit over data.length_warn_fraction (0.1 by default), in the manifest
    shares = {key: over / of for key, (over, of) in expected.items()}
    assert len(out.manifest["warnings"]) == sum(s > 0.1 for s in shares.values()) > 0
    reward_share = shares["reward.max_length"]
    assert f"{reward_share:.0%} of the preference pairs ({expected['reward.max_length'][0]} of {len(pairs)}) are " in (
        " ".join(out.manifest["warnings"])
    )
    quiet = config.data.model_copy(update={"length_warn_fraction": 1.0})
    assert prepare_preferences(quiet, tmp_path / "quiet", limits).manifest["warnings"] == []

    # the table artifact's rows and the MLflow metrics
    table = length_table(out.manifest)
    assert [r["limit"] for r in table[:3]] == [
        "ppo.max_prompt_tokens = 40",
        "reward.max_length = 64",
        "sft.max_length = 60",
    ]
    assert [r["length"] for r in table[3:]] == ["prompts", "responses"]
    metrics = length_metrics(out.manifest)
    assert metrics["data/over_reward_max_length_fraction"] == pytest.approx(reward_share, abs=1e-6)
    assert metrics["data/prompt_tokens_p50"] == section["prompt"]["p50"]


def test_without_a_tokenizer_lengths_are_characters(tmp_path):
    path = hh_file(tmp_path / "hh.jsonl", n=20)
    config = load_config(None, ["data.source=local", f"data.path={path}"])  # the bootstrap model: no tokenizer
    limits = LengthLimits.from_config(config)
    assert limits.sft_key == "sft.bootstrap.n_positions" and limits.sft_tokens == config.sft.bootstrap.n_positions
    out = prepare_preferences(config.data, tmp_path / "out", limits)
    section = out.manifest["lengths"]
    assert section["unit"] == "characters" and "no data.tokenizer" in section["note"]
    assert all(item["fraction"] is None and item["over"] is None for item in section["over_limit"].values())
    pairs = pd.concat([pd.read_parquet(out.train), pd.read_parquet(out.eval)])
    assert section["prompt"]["max"] == pairs["prompt"].str.len().max()
    assert out.manifest["warnings"] == [] and "data/over_reward_max_length_fraction" not in length_metrics(out.manifest)
    # a model used as it is does not train on the demonstrations: no SFT limit
    as_is = LengthLimits.from_config(load_config(None, ["sft.model=gpt2"]))
    assert as_is.sft_tokens is None
    # a reward function scores (conf/real-rlvr.yaml): no reward model trains on the pairs, so no reward.max_length
    # share and no warning about it; DPO keeps the reward stage (its held-out pairs are scored)
    function = ["reward.source=function", "reward.function=rlhf.data.verifiers:ifeval_strict"]
    assert LengthLimits.from_config(load_config(None, function)).pair_tokens is None
    assert LengthLimits.from_config(load_config(None, ["algorithm=dpo"])).pair_tokens == config.reward.max_length


def test_synthetic_task_has_a_length_report(tmp_path):
    config = load_config(
        None, [f"data.synthetic.{k}={v}" for k, v in (("n_sft", 20), ("n_train_pairs", 20), ("n_eval_pairs", 8))]
    )
    out = prepare_preferences(config.data, tmp_path / "out", LengthLimits.from_config(config))
    assert out.manifest["lengths"]["unit"] == "characters"
    assert out.manifest["lengths"]["over_limit"]["sft.bootstrap.n_positions"]["of"] == 20


def test_the_limits_are_part_of_the_prepare_cache_key(tmp_path):
    from rlhf.config import RuntimeConfig
    from tasks.caching import stage_dir

    config = load_config()
    params = {"data_cfg": config.data, "source_digest": "d", "runtime": RuntimeConfig(output_dir=str(tmp_path))}
    base = stage_dir("prepare_preferences", {**params, "lengths": LengthLimits.from_config(config)})
    again = stage_dir("prepare_preferences", {**params, "lengths": LengthLimits.from_config(config)})
    changed = LengthLimits.from_config(load_config(None, ["ppo.max_prompt_tokens=128"]))
    assert base == again != stage_dir("prepare_preferences", {**params, "lengths": changed})
