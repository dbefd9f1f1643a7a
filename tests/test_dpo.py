"""DPO: a tiny GPT-2 trained on synthetic preference pairs; statistics, the saved policy, resume."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.checkpoints import is_complete, read_manifest
from rlhf.config import DPOConfig, RuntimeConfig, build_config
from rlhf.data import synthetic
from rlhf.errors import ConfigError, DataError, TrainingInterrupted
from rlhf.models.loading import load_tokenizer
from rlhf.ops import logprobs_from_logits
from rlhf.rollout.batching import encode_prompt_response
from rlhf.train.dpo import fit_pairs, frame_logps, pair_logps, train_dpo

RUNTIME = RuntimeConfig(device="cpu", progress=False, dtype="float32")  # float32 numerics: the tolerances below
STAT_KEYS = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margin",
    "rewards/accuracy",
    "logps/chosen",
    "logps/rejected",
]
# 16 training pairs in batches of 8: 2 steps an epoch, 8 steps in all; held-out statistics every 4 steps
CFG = DPOConfig(beta=0.1, epochs=4, batch_size=8, lr=2e-3, warmup_ratio=0.0, eval_every=4, save_every=2)


def _pairs(n: int, split: str) -> pd.DataFrame:
    rows = synthetic.preference_pairs(n, seed=0, label_noise=0.0, split=split)
    return pd.DataFrame([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in rows])


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dpo_pairs")
    paths = {"train": str(root / "train.parquet"), "eval": str(root / "eval.parquet")}
    _pairs(16, "train").assign(margin=None).to_parquet(paths["train"])
    _pairs(8, "eval").assign(margin=None).to_parquet(paths["eval"])
    return paths


@pytest.fixture(scope="module")
def full_run(tiny_checkpoints, pairs, tmp_path_factory):
    """One uninterrupted run: its result, output folder and logged steps."""
    out = tmp_path_factory.mktemp("dpo") / "full"
    logged: list[tuple[int, dict[str, float]]] = []
    result = train_dpo(
        CFG,
        RUNTIME,
        tiny_checkpoints["policy"],
        pairs["train"],
        pairs["eval"],
        out,
        0,
        lambda m, s: logged.append((s, m)),
    )
    return result, out, logged


def _params(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_pair_logps_are_the_response_log_probs(tiny_checkpoints, pairs):
    # the sliced forward (LM head on the response positions only) against the full model's logits, by hand
    tok = load_tokenizer(tiny_checkpoints["policy"])
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["policy"]).eval()
    rows = pd.read_parquet(pairs["train"]).iloc[:3]
    with torch.no_grad():
        out = pair_logps(model, tok, rows, CFG, torch.device("cpu"))
        mean = pair_logps(model, tok, rows, DPOConfig(loss_type="ipo"), torch.device("cpu"))
        for i, response in enumerate([*rows["chosen"], *rows["rejected"]]):
            batch = encode_prompt_response(tok, [rows["prompt"].iloc[i % 3]], [response], CFG.max_length)
            logps = logprobs_from_logits(model(batch.input_ids).logits[:, :-1], batch.input_ids[:, 1:])[0]
            target = batch.loss_mask[0, 1:].bool()  # the response tokens and the EOS
            expected = (out.chosen if i < 3 else out.rejected)[i % 3]
            torch.testing.assert_close(expected, logps[target].sum(), rtol=1e-5, atol=1e-5)
            expected_mean = (mean.chosen if i < 3 else mean.rejected)[i % 3]
            torch.testing.assert_close(expected_mean, logps[target].mean(), rtol=1e-5, atol=1e-5)


def test_dpo_trains_logs_and_saves_the_policy(full_run, tiny_checkpoints, pairs):
    result, out, logged = full_run
    steps = [s for s, m in logged if "dpo/loss" in m]
    assert steps == list(range(1, 9))  # every step, counted from 1
    by_step = {s: m for s, m in logged if "dpo/loss" in m}
    for step, stats in by_step.items():
        for key in [f"dpo/{k}" for k in STAT_KEYS] + ["dpo/lr", "dpo/grad_norm"]:
            assert math.isfinite(stats[key]), (step, key)
        has_eval = step in (4, 8)
        assert all((f"dpo/eval/{k}" in stats) == has_eval for k in STAT_KEYS), step
    # step 1: the policy is the reference (dropout off): h = 0, loss log 2, rewards 0
    first = by_step[1]
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert first["dpo/rewards/chosen"] == pytest.approx(0, abs=1e-4)
    assert first["dpo/rewards/margin"] == pytest.approx(0, abs=1e-4)
    assert first["dpo/rewards/accuracy"] == 0.0
    assert by_step[8]["dpo/loss"] < first["dpo/loss"]
    assert by_step[8]["dpo/rewards/margin"] > by_step[4]["dpo/rewards/margin"] > 0
    assert "dpo/dropped_too_long" in first  # once, with the first step
    assert "dpo/dropped_too_long" not in by_step[2]

    # the saved policy loads and ranks the training pairs better than the SFT model, by its implicit rewards
    assert result.path == str(out / "final" / "policy") and result.steps == 8
    assert is_complete(out / "final") and read_manifest(out / "final")["stage"] == "dpo"
    assert result.digest == read_manifest(out / "final")["digest"]
    assert not (out / "state").exists()
    cpu = torch.device("cpu")
    tok = load_tokenizer(result.path)
    train = pd.read_parquet(pairs["train"])
    policy = frame_logps(AutoModelForCausalLM.from_pretrained(result.path), tok, train, CFG, cpu, torch.float32)
    ref = frame_logps(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoints["policy"]), tok, train, CFG, cpu, torch.float32
    )
    margins = CFG.beta * ((policy.chosen - ref.chosen) - (policy.rejected - ref.rejected))  # (16,)
    assert margins.mean() > 0.1
    assert (margins > 0).float().mean() >= 0.9  # implicit reward accuracy on the training pairs, from 0
    assert result.metrics["dpo/eval/rewards/accuracy"] == by_step[8]["dpo/eval/rewards/accuracy"]
    assert math.isfinite(result.metrics["dpo/eval/loss"]) and result.metrics["time/dpo_reference"] > 0


def test_resume_after_an_interruption_gives_the_same_policy(full_run, tiny_checkpoints, pairs, tmp_path):
    result, _, logged = full_run
    out = tmp_path / "resumed"
    with pytest.raises(TrainingInterrupted):
        train_dpo(CFG, RUNTIME, tiny_checkpoints["policy"], pairs["train"], pairs["eval"], out, 0, lambda m, s: None, 3)
    assert (out / "state" / "model.safetensors").is_file()
    assert not (out / "final").exists()
    steps: dict[int, dict[str, float]] = {}
    resumed = train_dpo(
        CFG,
        RUNTIME,
        tiny_checkpoints["policy"],
        pairs["train"],
        pairs["eval"],
        out,
        0,
        lambda m, s: steps.setdefault(s, m),
    )
    assert min(steps) == 4  # continues after the saved step 3
    uninterrupted = {s: m for s, m in logged if "dpo/loss" in m}
    for step in (4, 8):  # the same batches, the same reference: the same statistics
        assert steps[step]["dpo/loss"] == pytest.approx(uninterrupted[step]["dpo/loss"], rel=1e-4, abs=1e-6)
    expected, again = _params(result.path), _params(resumed.path)
    for key, value in expected.items():
        torch.testing.assert_close(again[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("settings", [{"loss_type": "ipo"}, {"label_smoothing": 0.2}], ids=["ipo", "smoothing"])
def test_other_losses_train(tiny_checkpoints, pairs, tmp_path, settings):
    cfg = CFG.model_copy(update={"epochs": 2, "eval_every": 2, **settings})
    logged: dict[int, dict[str, float]] = {}
    train_dpo(
        cfg,
        RUNTIME,
        tiny_checkpoints["policy"],
        pairs["train"],
        pairs["eval"],
        tmp_path,
        0,
        lambda m, s: logged.setdefault(s, m),
    )
    first = logged[1]
    # the policy starts as the reference: sigmoid with smoothing still gives log 2, IPO (0 - 1 / (2 * 0.1))^2 = 25
    assert first["dpo/loss"] == pytest.approx(25.0 if cfg.loss_type == "ipo" else math.log(2), rel=1e-4)
    assert logged[4]["dpo/loss"] < first["dpo/loss"]
    assert logged[4]["dpo/rewards/margin"] > 0 and logged[4]["dpo/eval/rewards/margin"] > 0
    if cfg.loss_type == "ipo":  # log-probs per token: a mean, not a sum, of log-probs near -log(300) = -5.7
        assert -8 < first["dpo/logps/chosen"] < -3


def test_settings_and_inputs_are_checked(tiny_checkpoints, pairs, tmp_path):
    for bad, match in [
        ({"beta": 0.0}, r"dpo.beta"),
        ({"loss_type": "hinge"}, r"dpo.loss_type"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, r"dpo.label_smoothing applies to dpo.loss_type 'sigmoid'"),
        ({"label_smoothing": 0.5}, r"dpo.label_smoothing"),
        ({"truncation": "cut"}, r"dpo.truncation"),
        ({"max_length": 16, "min_prompt_tokens": 16}, r"dpo.min_prompt_tokens \(16\) must be less than"),
        ({"lr": float("inf")}, r"dpo.lr is inf, not a finite number"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_config({"dpo": bad})
    frame = pd.read_parquet(pairs["train"])
    with pytest.raises(DataError, match=r"the training pairs lack the column\(s\) rejected"):
        train_dpo(
            CFG,
            RUNTIME,
            tiny_checkpoints["policy"],
            frame.drop(columns="rejected"),
            frame,
            tmp_path,
            0,
            lambda m, s: None,
        )
    # every pair longer than max_length with truncation 'drop': one sentence before any model loads
    with pytest.raises(ConfigError, match=r"^dpo.max_length \(8 tokens\) is shorter than 16 of the 16 training"):
        train_dpo(DPOConfig(max_length=8, min_prompt_tokens=4), RUNTIME, tiny_checkpoints["policy"], frame, frame,
                  tmp_path, 0, lambda m, s: None)  # fmt: skip


def test_fit_pairs_drops_or_keeps_long_pairs(tiny_checkpoints):
    tok = load_tokenizer(tiny_checkpoints["policy"])
    train, evals = _pairs(8, "train"), _pairs(4, "eval")
    train.loc[::4, "chosen"] = train.loc[::4, "chosen"] + " and the music was great." * 20  # 2 of 8 too long
    kept_train, kept_eval, stats = fit_pairs(train, evals, tok, DPOConfig(max_length=64))
    assert (len(kept_train), len(kept_eval)) == (6, 4)
    assert stats["dpo/dropped_too_long"] == 2 and stats["dpo/dropped_too_long_fraction"] == pytest.approx(2 / 12)
    kept_train, _, stats = fit_pairs(train, evals, tok, DPOConfig(max_length=64, truncation="truncate"))
    assert len(kept_train) == 8 and stats["dpo/truncated_fraction"] == pytest.approx(2 / 12)
    with torch.no_grad():  # a cut pair is scored within max_length
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["policy"])
        cfg = DPOConfig(max_length=64, truncation="truncate")
        out = pair_logps(model, tok, kept_train.iloc[:2], cfg, torch.device("cpu"))
    assert torch.isfinite(out.chosen).all() and out.chosen[0] < out.chosen[1]  # the long one, cut, has more tokens
