"""SFT: fine-tuning an existing model on the demonstrations, resumable like the other trainers."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.checkpoints import read_manifest
from rlhf.config import RuntimeConfig, SFTConfig, load_config
from rlhf.data import synthetic
from rlhf.errors import ConfigError, TrainingInterrupted
from rlhf.train.sft import finetune_sft

RUNTIME = RuntimeConfig(device="cpu", progress=False, dtype="float32")  # float32 numerics: the tolerances below


@pytest.fixture
def demos(tmp_path):
    path = tmp_path / "sft.parquet"
    pd.DataFrame([{"prompt": d.prompt, "response": d.response} for d in synthetic.demonstrations(64, 0)]).to_parquet(
        path
    )
    return path


def _cfg(model: str, **overrides) -> SFTConfig:
    # max_length 200 is more than the tiny model's 64 positions: fine-tuning caps it instead of failing
    base = dict(model=model, finetune=True, steps=8, batch_size=8, lr=3e-3, warmup_ratio=0, save_every=2)
    return SFTConfig(**{**base, "max_length": 200, **overrides})


def _params(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_finetune_trains_the_given_model_and_resumes_exactly(tiny_checkpoints, demos, tmp_path):
    base = tiny_checkpoints["policy"]
    logged: dict[int, dict[str, float]] = {}
    full = finetune_sft(
        _cfg(base), RUNTIME, demos, tmp_path / "full", 0, lambda m, s: logged.setdefault(s, {}).update(m)
    )
    assert full.trained and full.path == str(tmp_path / "full")
    assert sorted(logged) == [1, 8]  # steps counted from 1: the first and the last of 8
    assert logged[8]["sft/final_loss"] < logged[1]["sft/loss"]  # it learned
    tuned, original = _params(full.path), _params(base)
    assert any(not torch.equal(tuned[k], original[k]) for k in original)
    assert AutoTokenizer.from_pretrained(full.path).get_vocab() == AutoTokenizer.from_pretrained(base).get_vocab()
    assert read_manifest(full.path)["base_model"] == base
    assert not (tmp_path / "full" / "state").exists()  # the resume state goes once the checkpoint is written

    # a run stopped after 4 steps, restarted: continues from the saved state, logs only later steps, same weights
    out = tmp_path / "resumed"
    with pytest.raises(TrainingInterrupted):
        finetune_sft(_cfg(base), RUNTIME, demos, out, 0, lambda m, s: None, stop_after=4)
    assert (out / "state" / "model.safetensors").is_file()
    steps: list[int] = []
    resumed = finetune_sft(_cfg(base), RUNTIME, demos, out, 0, lambda m, s: steps.append(s))
    assert min(steps) > 4
    again = _params(resumed.path)
    for key, value in tuned.items():
        torch.testing.assert_close(again[key], value, rtol=1e-5, atol=1e-6)


def test_finetune_needs_a_model():
    with pytest.raises(ConfigError, match=r"sft.finetune needs sft.model"):
        load_config(None, ["sft.finetune=true"])
