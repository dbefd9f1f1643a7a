"""Shared fixtures: an isolated Prefect home, no telemetry, and tiny but real transformers models."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Before prefect is imported anywhere: a private home (results, DB) and no network.
_HOME = tempfile.mkdtemp(prefix="rlhf-tests-prefect-")
os.environ["PREFECT_HOME"] = _HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import pytest  # noqa: E402
import torch  # noqa: E402

from rlhf import models  # noqa: E402
from rlhf.data import synthetic  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """A tiny GPT-2 policy and a scalar-head model from it, saved and loadable with the Auto classes."""
    root = tmp_path_factory.mktemp("tiny")
    texts = [d.prompt + d.response for d in synthetic.demonstrations(200, seed=0)]
    tok = models.build_tokenizer(texts, vocab_size=300)
    policy = models.build_tiny_gpt2(tok, n_layer=1, n_head=2, n_embd=32, n_positions=64, seed=0)
    policy.save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    reward = models.load_reward_model(str(root / "policy"), torch.device("cpu"))
    torch.nn.init.normal_(reward.score.weight, std=0.5)  # a non-trivial head, so scores differ
    reward.save_pretrained(root / "reward")
    tok.save_pretrained(root / "reward")
    return {"policy": str(root / "policy"), "reward": str(root / "reward")}
