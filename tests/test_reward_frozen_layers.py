"""reward.frozen_layers: the embeddings and the lowest blocks of the reward model stay as initialised, the top blocks
and the head train, and a count past the model's blocks is one sentence."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from rlhf.config import RewardConfig, RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.models.loading import load_reward_model
from rlhf.models.sharding import transformer_blocks
from rlhf.models.training import freeze_lower_layers
from rlhf.train import reward as reward_module
from tests.model_zoo import build_smollm_like


@pytest.fixture(scope="module")
def smollm_like(tmp_path_factory):
    """A tiny SmolLM2-architecture checkpoint (Llama, tied embeddings, 2 blocks) and its ChatML tokenizer."""
    folder = tmp_path_factory.mktemp("smollm-like")
    model, tokenizer = build_smollm_like()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_frozen_blocks_get_no_gradient_and_the_top_ones_do(smollm_like):
    model = load_reward_model(smollm_like, torch.device("cpu"))
    blocks = transformer_blocks(model)
    assert len(blocks) == 2
    everything = sum(p.numel() for p in model.parameters())
    trainable = freeze_lower_layers(model, 1)
    embed = model.get_input_embeddings().weight
    assert trainable == everything - embed.numel() - sum(p.numel() for p in blocks[0].parameters())
    model(input_ids=torch.tensor([[1, 5, 7, 9]])).logits.sum().backward()
    assert embed.grad is None and all(p.grad is None for p in blocks[0].parameters())
    assert all(p.grad is not None for p in blocks[1].parameters()) and model.score.weight.grad is not None
    with pytest.raises(ConfigError, match=r"reward.frozen_layers \(2\) must be less than the model's 2 transformer"):
        freeze_lower_layers(load_reward_model(smollm_like, torch.device("cpu")), 2)


def test_a_reward_model_trained_with_frozen_layers_keeps_them_as_initialised(smollm_like, tmp_path):
    rows = [
        {"prompt": f"Say something {i}.", "chosen": " yes indeed", "rejected": " no", "margin": None} for i in range(16)
    ]
    train, evals = tmp_path / "train.parquet", tmp_path / "eval.parquet"
    pd.DataFrame(rows[:12]).to_parquet(train)
    pd.DataFrame(rows[12:]).to_parquet(evals)
    cfg = RewardConfig(frozen_layers=1, batch_size=4, epochs=1, lr=1e-2, eval_every=3, max_length=32)
    logged = {}
    result = reward_module.train_reward_model(
        cfg, RuntimeConfig(device="cpu", progress=False), smollm_like, train, evals, tmp_path / "rm", 0,
        lambda metrics, step: logged.update(metrics),
    )  # fmt: skip
    before = load_reward_model(smollm_like, torch.device("cpu")).state_dict()
    after = load_reward_model(result.path, torch.device("cpu")).state_dict()
    changed = {name for name, value in after.items() if name in before and not torch.equal(value, before[name])}
    assert changed and all(
        name.startswith(("model.layers.1.", "model.norm")) for name in changed if "score" not in name
    )
    assert not any(name.startswith(("model.embed_tokens", "model.layers.0.")) for name in changed)
    assert logged["reward/train/trainable_parameters"] < sum(v.numel() for v in before.values())


def test_the_memory_estimate_counts_frozen_layers_as_weights_only():
    from rlhf.config import load_config
    from rlhf.memory import ModelShape, estimate

    # 1000 reward-model parameters over 4 blocks, embeddings 10 x 2 = 20; 2 blocks frozen: 20 + 980 * 2 / 4 = 510
    # frozen, 490 trained (16 bytes each: weights, gradients, AdamW's two moments; on a CPU 4 more for the best
    # copy), the frozen ones 4 bytes each
    shape = ModelShape(2000, 1000, layers=4, hidden=2, intermediate=4, kv_dim=2, vocab=10, positions=64,
                       linear_in_out=24)  # fmt: skip
    config = load_config(None, ["runtime.device=cpu", "runtime.dtype=float32"])
    frozen = load_config(None, ["runtime.device=cpu", "runtime.dtype=float32", "reward.frozen_layers=2"])
    (full,) = [e for e in estimate(config, shape, "cpu") if e.stage == "reward"]
    (part,) = [e for e in estimate(frozen, shape, "cpu") if e.stage == "reward"]
    assert full.persistent == 16 * 1000 + 4 * 1000
    assert part.persistent == 16 * 490 + 4 * 510 + 4 * 490
    assert part.transient == full.transient / 2  # activations of the 2 trained blocks only


def test_the_reported_accuracy_is_the_saved_models_on_the_held_out_pairs(smollm_like, tmp_path):
    """The stage reports the kept (best) checkpoint's accuracy as measured when it was kept, without evaluating it
    again: the saved model, evaluated afresh, has exactly that accuracy, the best of the periodic evaluations."""
    rows = [
        {"prompt": f"Say something {i}.", "chosen": " yes indeed" * (1 + i % 3), "rejected": " no", "margin": None}
        for i in range(24)
    ]
    train, evals = tmp_path / "train.parquet", tmp_path / "eval.parquet"
    pd.DataFrame(rows[:16]).to_parquet(train)
    pd.DataFrame(rows[16:]).to_parquet(evals)
    cfg = RewardConfig(batch_size=4, epochs=2, lr=3e-2, eval_every=1, max_length=32)
    history: list[float] = []

    def log(metrics, step):
        if "reward/eval/accuracy" in metrics:
            history.append(metrics["reward/eval/accuracy"])

    result = reward_module.train_reward_model(
        cfg, RuntimeConfig(device="cpu", progress=False), smollm_like, train, evals, tmp_path / "rm", 0, log
    )  # fmt: skip
    from rlhf.models.loading import load_tokenizer

    saved = load_reward_model(result.path, torch.device("cpu"))
    fresh = reward_module.evaluate_pairs(
        saved, load_tokenizer(result.path), pd.read_parquet(evals), cfg, torch.device("cpu")
    )["reward/eval/accuracy"]
    assert len(history) > 1 and result.metrics["reward/best_eval_accuracy"] == max(history) == fresh
