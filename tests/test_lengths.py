"""Lengths in the training stages: fitting prompt + response into a budget (never silently losing the prompt), the
reward model's drop/truncate policy, and the truncation shares SFT and PPO measure and log."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
import torch

from rlhf.config import PPOConfig, RewardConfig, RuntimeConfig, SFTConfig, load_config
from rlhf.errors import ConfigError
from rlhf.models.loading import load_tokenizer
from rlhf.rollout.batching import Fit, encode_and_measure, encode_prompt_response, fit_lengths, pair_lengths
from rlhf.train import reward as reward_module

RUNTIME = RuntimeConfig(device="cpu", progress=False)


@pytest.mark.parametrize(
    "prompt, response, max_length, min_prompt, expected",
    [
        (10, 5, 20, 8, Fit(10, 5)),  # fits: nothing cut
        (10, 5, 15, 8, Fit(10, 5)),  # exactly fits
        (10, 3, 12, 8, Fit(9, 3)),  # the response fits whole: the prompt loses its first token
        (10, 5, 12, 8, Fit(8, 4)),  # the response would leave 7 prompt tokens: 8 survive, the response loses 1
        (10, 5, 12, 0, Fit(7, 5)),  # min 0: the response first, as SFT wants it
        (10, 20, 12, 8, Fit(8, 4)),  # a response longer than the budget: still 8 prompt tokens
        (10, 20, 12, 0, Fit(0, 12)),  # ... without a minimum the prompt vanishes (the old behaviour)
        (3, 20, 12, 8, Fit(3, 9)),  # a prompt shorter than the minimum survives whole
        (10, 20, 6, 8, Fit(5, 1)),  # a minimum at or over the budget keeps one token for the response
        (0, 20, 12, 8, Fit(0, 12)),  # an empty prompt
    ],
)
def test_fit_lengths_by_hand(prompt, response, max_length, min_prompt, expected):
    fit = fit_lengths(prompt, response, max_length, min_prompt)
    assert fit == expected and fit.prompt + fit.response <= max_length


@pytest.fixture(scope="module")
def tok(tiny_checkpoints):
    return load_tokenizer(tiny_checkpoints["policy"])


def test_encode_keeps_the_prompt_end_and_the_response_start(tok):
    prompt, response = "the plot was superb and the music was dull.", " the film was great and the acting was fine."
    p, r = tok(prompt, add_special_tokens=False)["input_ids"], tok(response, add_special_tokens=False)["input_ids"]
    r_eos = [*r, tok.eos_token_id]
    budget = len(r) + 3  # the response (without its EOS) and 3 prompt tokens fit with min 3
    batch, cut = encode_and_measure(tok, [prompt], [response], budget, min_prompt_tokens=3)
    fit = fit_lengths(len(p), len(r_eos), budget, 3)
    assert fit == Fit(3, len(r))
    assert batch.input_ids[0].tolist() == p[-3:] + r_eos[: len(r)]  # last 3 prompt tokens, response cut on the right
    assert batch.loss_mask[0].tolist() == [0] * 3 + [1] * len(r)
    assert cut == (1, 1, 1, 1, 0)  # rows, truncated, prompt truncated, response truncated, prompt lost
    # without a minimum the old rule: the response (+ EOS) fills the budget and the prompt is gone
    batch, cut = encode_and_measure(tok, [prompt], [response], len(r_eos), min_prompt_tokens=0)
    assert batch.input_ids[0].tolist() == r_eos and cut.prompt_lost == 1
    assert encode_prompt_response(tok, [prompt], [response], 512).input_ids[0].tolist() == p + r_eos  # fits
    assert pair_lengths(tok, [prompt], [response], ["no."]).tolist() == [len(p) + len(r_eos)]


def test_a_response_that_did_not_end_gets_no_eos_to_learn(tok):
    """Per-row `add_eos`: a sample cut at its token limit (the warm start's `stopped` False) is trained without the
    EOS, so the fine-tuned policy does not learn to stop where the sampler cut it."""
    prompt, response = "the plot was superb.", " the film was great and the acting was"
    p, r = tok(prompt, add_special_tokens=False)["input_ids"], tok(response, add_special_tokens=False)["input_ids"]
    batch, _ = encode_and_measure(tok, [prompt, prompt], [response, response], 512, add_eos=[True, False])
    ended, cut = batch.input_ids.tolist()
    assert ended[: len(p) + len(r) + 1] == p + r + [tok.eos_token_id]
    assert cut[: len(p) + len(r)] == p + r and batch.attention_mask[1].sum() == len(p) + len(r)
    assert batch.loss_mask.sum(1).tolist() == [len(r) + 1, len(r)]


def write_pairs(path, n: int, long_every: int, start: int = 0) -> str:
    """Pairs of the synthetic vocabulary; every `long_every`-th has a long chosen response."""
    rows = []
    for i in range(start, start + n):
        chosen = " the plot was superb." + " the music was great." * (12 if i % long_every == 0 else 0)
        rows.append({"prompt": f"review {i}: the film", "chosen": chosen, "rejected": " the plot was dull."})
    frame = pd.DataFrame(rows).assign(margin=None)
    frame.to_parquet(path)
    return str(path)


def spy_encodings(monkeypatch) -> list:
    """Record every batch the reward model scores (prompt ids, the encoded rows)."""
    seen = []
    real = reward_module.encode_prompt_response

    def spy(tokenizer, prompts, responses, max_length, add_eos=True, min_prompt_tokens=0):
        batch = real(tokenizer, prompts, responses, max_length, add_eos, min_prompt_tokens)
        seen.append((tokenizer(prompts, add_special_tokens=False)["input_ids"], batch, max_length))
        return batch

    monkeypatch.setattr(reward_module, "encode_prompt_response", spy)
    return seen


def test_reward_drop_leaves_over_length_pairs_out_and_counts_them(tiny_checkpoints, tok, tmp_path, monkeypatch):
    train, evals = write_pairs(tmp_path / "t.parquet", 24, 4), write_pairs(tmp_path / "e.parquet", 8, 4, start=100)
    cfg = RewardConfig(max_length=48, batch_size=8, epochs=1, eval_every=2, min_prompt_tokens=4)
    frames = [pd.read_parquet(f) for f in (train, evals)]
    over = [
        int((pair_lengths(tok, f["prompt"].tolist(), f["chosen"].tolist(), f["rejected"].tolist()) > 48).sum())
        for f in frames
    ]
    assert over == [6, 2]  # every 4th pair is too long, the others fit
    seen, logged = spy_encodings(monkeypatch), {}
    result = reward_module.train_reward_model(
        cfg, RUNTIME, tiny_checkpoints["policy"], train, evals, tmp_path / "rm", 0, lambda m, s: logged.update(m)
    )
    assert result.metrics["reward/dropped_too_long"] == logged["reward/dropped_too_long"] == 8
    assert result.metrics["reward/dropped_too_long_fraction"] == pytest.approx(8 / 32)
    assert (result.metrics["reward/train_dropped_too_long"], result.metrics["reward/eval_dropped_too_long"]) == (6, 2)
    assert result.metrics["reward/truncated_fraction"] == 0
    # every scored row is the whole prompt and the whole response: nothing was cut
    for prompt_ids, batch, _ in seen:
        lengths = batch.attention_mask.sum(1).tolist()
        assert max(lengths) <= 48
        for i, ids in enumerate(prompt_ids):  # the prompts of the chosen, then the rejected rows
            assert batch.loss_mask[i].tolist().index(1) == len(ids) > 0
    assert len(pd.read_parquet(train)) == 24  # the data is not changed, only what this stage trains on

    # more than half too long: one sentence naming reward.max_length and the share, before any training
    with pytest.raises(ConfigError, match=r"^reward.max_length \(12 tokens\) is shorter than 24 of the 24 training"):
        reward_module.train_reward_model(
            cfg.model_copy(update={"max_length": 12}), RUNTIME, tiny_checkpoints["policy"], train, evals,
            tmp_path / "x", 0, lambda m, s: None,
        )  # fmt: skip


def test_reward_truncate_keeps_pairs_and_the_prompt(tiny_checkpoints, tmp_path, monkeypatch):
    train, evals = write_pairs(tmp_path / "t.parquet", 16, 2), write_pairs(tmp_path / "e.parquet", 8, 2, start=100)
    cfg = RewardConfig(max_length=40, batch_size=8, epochs=1, eval_every=2, truncation="truncate", min_prompt_tokens=5)
    seen = spy_encodings(monkeypatch)
    result = reward_module.train_reward_model(
        cfg, RUNTIME, tiny_checkpoints["policy"], train, evals, tmp_path / "rm", 0, lambda m, s: None
    )
    assert result.metrics["reward/dropped_too_long"] == 0
    assert result.metrics["reward/truncated_fraction"] == pytest.approx(12 / 24)  # every 2nd pair: 8 + 4 of 24
    cut_rows = 0
    for prompt_ids, batch, _ in seen:
        for i, ids in enumerate(prompt_ids):  # the prompts of the chosen, then the rejected rows
            kept_prompt = batch.loss_mask[i].tolist().index(1)
            assert kept_prompt >= min(len(ids), 5) > 0  # no response is scored without its prompt
            assert batch.input_ids[i, :kept_prompt].tolist() == ids[len(ids) - kept_prompt :]  # the prompt's end
            cut_rows += kept_prompt < len(ids) or int(batch.attention_mask[i].sum()) == 40
    assert cut_rows > 0


def test_reward_config_fields():
    cfg = load_config()
    assert cfg.reward.truncation == "drop" and cfg.reward.min_prompt_tokens == 8
    assert load_config(None, ["reward.truncation=truncate"]).reward.truncation == "truncate"
    with pytest.raises(ConfigError, match=r"reward.truncation: Input should be 'drop' or 'truncate'"):
        load_config(None, ["reward.truncation=cut"])
    with pytest.raises(ConfigError, match=r"reward.min_prompt_tokens \(200\) must be less than reward.max_length"):
        load_config(None, ["reward.min_prompt_tokens=200"])
    assert load_config().data.length_warn_fraction == 0.1
    with pytest.raises(ConfigError, match=r"data.length_warn_fraction: Input should be less than or equal to 1"):
        load_config(None, ["data.length_warn_fraction=2"])


def test_sft_measures_and_logs_its_truncation(tiny_checkpoints, tok, tmp_path):
    from rlhf.train.sft import finetune_sft

    rows = [
        {"prompt": f"Review {i}:" + " the film" * (1 + 4 * (i % 3 == 0)), "response": " the plot was superb."}
        for i in range(12)
    ]
    path = tmp_path / "sft.parquet"
    pd.DataFrame(rows).to_parquet(path)
    lengths = [
        len(tok(r["prompt"] + "", add_special_tokens=False)["input_ids"])
        + len(tok(r["response"], add_special_tokens=False)["input_ids"])
        + 1
        for r in rows
    ]
    expected = sum(n > 24 for n in lengths) / len(rows)
    assert 0 < expected < 1
    logged = []
    cfg = SFTConfig(
        model=tiny_checkpoints["policy"], finetune=True, steps=2, warmup_ratio=1.0, batch_size=4, max_length=24
    )
    result = finetune_sft(cfg, RUNTIME, path, tmp_path / "out", 0, lambda m, s: logged.append(m))
    assert result.metrics["sft/truncated_fraction"] == pytest.approx(expected)
    assert result.metrics["sft/response_truncated_fraction"] == 0  # the response keeps its tokens first
    assert sum("sft/truncated_fraction" in m for m in logged) == 2  # once with the first step, once in the result


def test_ppo_prompt_truncation_share_and_warning(tok, caplog):
    from rlhf.ppo.distributed import DistContext
    from rlhf.ppo.trainer import truncated_prompts
    from rlhf.rollout.batching import encode_prompts, keep_last

    prompts = ["the plot", "the plot was superb and the music was dull.", "the film was great", "the cast was fine."]
    encoded = encode_prompts(tok, prompts)  # no chat template: plain prompts
    limit = sorted(map(len, encoded))[1]  # two of the four are longer
    dist = DistContext(device=torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="rlhf.ppo.trainer"):
        ids, stats = truncated_prompts(tok, prompts, PPOConfig(max_prompt_tokens=limit), dist)
    assert ids == [row[-limit:] for row in encoded]  # left-truncated: the last tokens
    # a BOS (here id 9) is kept in front and counts toward the limit
    assert keep_last([9, 1, 1, 1], 1, 5) == [9, 1, 1, 1] and keep_last([9, *[2] * 10], 1, 5) == [9, 2, 2, 2, 2]
    assert stats == {"ppo/prompts_truncated_fraction": 0.5}
    assert f"50% of the PPO prompts are longer than ppo.max_prompt_tokens ({limit})" in caplog.text
    assert "lose their start (cut on the left)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlhf.ppo.trainer"):
        truncated_prompts(tok, prompts, PPOConfig(max_prompt_tokens=max(map(len, encoded))), dist)
    assert not caplog.text
