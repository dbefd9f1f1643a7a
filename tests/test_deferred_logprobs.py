"""The rollout's policy forward skipped where the optimisation's first minibatch can supply its own old log-probs
(`rlhf.ppo.update.defers_old_logprobs`): the same update, to float tolerance, with fewer forwards."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
import torch

from rlhf.config import DataConfig, PPOConfig, RewardConfig, RuntimeConfig, SFTConfig
from rlhf.data.prepare import prepare_preferences
from rlhf.ppo import optimise as ppo_optimise
from rlhf.ppo import update as ppo_update
from rlhf.ppo.models import load_models
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import prompt_batch
from rlhf.ppo.state import load_state
from rlhf.ppo.trainer import generation_settings
from rlhf.rollout import scoring
from rlhf.rollout.batching import encode_prompts
from rlhf.train.sft import bootstrap_sft

RUNTIME = RuntimeConfig(device="cpu", progress=False, dtype="float32")  # float32 numerics (tolerances below)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A tiny bootstrapped SFT policy on the synthetic task and its prompts (a few seconds)."""
    root = tmp_path_factory.mktemp("deferred")
    data = prepare_preferences(
        DataConfig(synthetic={"n_sft": 200, "n_train_pairs": 120, "n_eval_pairs": 20}), root / "data"
    )
    sft_cfg = SFTConfig(steps=20, batch_size=32, bootstrap={"n_layer": 2, "n_embd": 32, "vocab_size": 320})
    sft = bootstrap_sft(sft_cfg, RUNTIME, data.sft, data.train, root / "sft", 0, lambda m, s: None)
    return {"root": root, "sft": sft.path, "prompts": sorted(set(pd.read_parquet(data.train)["prompt"]))}


def response_length_mod_5(prompts, responses):
    """A reward function whose scores differ within a group."""
    return [float(len(r) % 5) for r in responses]


REWARD = RewardConfig(source="function", function=f"{__name__}:response_length_mod_5")


def _update(stack, cfg: PPOConfig, defer: bool, split: bool, monkeypatch):
    """One update from the SFT policy (`split`: a critic-free micro-batch as two halves in two threads); returns
    (models, rollout, optimisation result, rows the rollout's policy forward scored)."""
    models = load_models(cfg, RUNTIME, stack["sft"], None, None, torch.device("cpu"), reward_cfg=REWARD)
    state = load_state(stack["root"] / "no-state", models, cfg, 0, torch.device("cpu"))
    ids = encode_prompts(models.tokenizer, stack["prompts"], cfg.max_prompt_tokens)
    batch = prompt_batch(ids, 0, cfg.batch_size, 0, models.tokenizer.pad_token_id, 0, 1, cfg.samples_per_prompt)
    plan = replace(ExecutionPlan.for_models(models, torch.float32), split_policy=split)
    scored_rows = []
    original = scoring.policy_forward

    def counting(model, query_responses, *args, **kwargs):
        if model is models.policy:
            scored_rows.append(len(query_responses))
        return original(model, query_responses, *args, **kwargs)

    monkeypatch.setattr(scoring, "policy_forward", counting)
    order = ppo_update.first_epoch_order(cfg, state.shuffle_generator, cfg.batch_size) if defer else None
    settings = generation_settings(cfg, models)
    rollout = ppo_update.generate_and_score(
        models, batch, stack["prompts"], cfg, settings, state.sample_generator, plan, order
    )
    monkeypatch.setattr(scoring, "policy_forward", original)
    ppo_update.compute_advantages(rollout, cfg, state.kl_ctl.value)
    result = ppo_optimise.optimize(models, state, rollout, cfg, plan)
    ppo_update.refresh_kl(rollout, cfg)
    return models, rollout, result, sum(scored_rows)


@pytest.mark.parametrize(
    ("estimator", "mini_batches", "epochs", "split"),
    [("dr_grpo", 1, 1, False), ("grpo", 2, 2, False), ("dr_grpo", 2, 1, True)],
)
def test_deferred_first_minibatch_is_the_same_update(stack, monkeypatch, estimator, mini_batches, epochs, split):
    cfg = PPOConfig(
        advantage_estimator=estimator, total_episodes=16, batch_size=16, samples_per_prompt=4, max_new_tokens=10,
        num_mini_batches=mini_batches, num_ppo_epochs=epochs, forward_batch_size=5, kl_coef=0.1, lr=1e-3,
        record_rollouts=False,
    )  # fmt: skip
    base_models, base, base_result, base_rows = _update(stack, cfg, False, split, monkeypatch)
    models, rollout, result, rows = _update(stack, cfg, True, split, monkeypatch)
    mini = cfg.batch_size // mini_batches
    assert base_rows == cfg.batch_size and rows == cfg.batch_size - mini  # the first minibatch's forward is saved
    assert torch.equal(base.scored.resp.tokens, rollout.scored.resp.tokens)  # the same samples
    mask = rollout.mask.bool()
    # every row's old log-probs are there after the optimisation, the deferred ones from its first pass
    assert torch.allclose(rollout.scored.logprobs[mask], base.scored.logprobs[mask], atol=1e-5)
    assert torch.allclose(rollout.kl[mask], base.kl[mask], atol=1e-5)
    assert rollout.scored.deferred is None
    assert result.minibatch_stats[0]["policy/ratio_mean"] == 1.0 and result.minibatch_stats[0]["policy/clipfrac"] == 0
    for key in ("policy/loss", "policy/kl_loss", "policy/grad_norm"):
        assert result.stats[key] == pytest.approx(base_result.stats[key], rel=1e-4, abs=1e-6), key
    for (name, p), q in zip(models.policy.named_parameters(), base_models.policy.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), name  # the same weights after the update


def test_no_deferral_where_the_rollout_needs_the_log_probs():
    # PPO and RLOO keep the KL in the reward: the advantages need every row's log-probs before the optimisation; the
    # first epoch's order is still drawn before sampling (the rollout's forwards take its rows)
    for estimator in ("gae", "rloo"):
        cfg = PPOConfig(advantage_estimator=estimator, samples_per_prompt=4)
        assert not ppo_update.defers_old_logprobs(cfg)
        assert ppo_update.first_epoch_order(cfg, torch.Generator(), 8) is not None
    assert ppo_update.defers_old_logprobs(PPOConfig(advantage_estimator="grpo", samples_per_prompt=4))
    # dynamic sampling merges rollouts: the rows of the first epoch are not known before sampling
    cfg = PPOConfig(advantage_estimator="dapo", samples_per_prompt=4)
    assert ppo_update.first_epoch_order(cfg, torch.Generator(), 8) is None
    generator = torch.Generator().manual_seed(3)
    order = ppo_update.first_epoch_order(PPOConfig(advantage_estimator="grpo", samples_per_prompt=4), generator, 8)
    assert sorted(order.tolist()) == list(range(8))  # a permutation, drawn from the optimisation's generator
    assert torch.equal(order, torch.randperm(8, generator=torch.Generator().manual_seed(3)))
