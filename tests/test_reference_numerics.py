"""Numerics at identical weights: PPO's reference computes what the policy computes in every runtime dtype, so the
first update's KL is exactly 0 and its ratio exactly 1 (docs/models.md "Numerics at identical weights").

The policy holds float32 master weights and computes under autocast; a reference loaded in bfloat16 would round its
residual stream, norms and embeddings, which the policy keeps in float32 (first-update KL 0.014 per response
measured on SmolLM2-135M on a CPU, 0.072 on a GPU). The tests run on tiny random-weight Llamas shaped like SmolLM2
(tests/model_zoo.py) under runtime.dtype bfloat16 on the CPU (CPU autocast)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlhf.config import PPOConfig, RewardConfig, RuntimeConfig
from rlhf.models.device import torch_threads
from rlhf.models.loading import load_causal_lm
from rlhf.models.reference import autocast_lowered_parameters, load_reference_lm, match_autocast, reference_bytes
from rlhf.ppo import optimise as ppo_optimise
from rlhf.ppo import update as ppo_update
from rlhf.ppo.models import load_models
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import prompt_batch
from rlhf.ppo.state import load_state
from rlhf.ppo.trainer import generation_settings
from rlhf.ppo.update import compute_advantages, first_epoch_order, generate_and_score, refresh_kl
from rlhf.rollout.batching import encode_prompts
from rlhf.rollout.forwards import policy_forward
from tests.model_zoo import FAMILIES, build_family, build_smollm_like

CPU = torch.device("cpu")
BF16 = RuntimeConfig(device="cpu", progress=False, dtype="bfloat16")
REWARD = RewardConfig(source="function", function="rlhf.data.synthetic:gold_reward")
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name two prime numbers.", "Hi!"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny SmolLM2-like checkpoints, tied embeddings (SmolLM2's) and untied (a separate LM head)."""
    root = tmp_path_factory.mktemp("smollm-like")
    paths = {}
    for name, tied in (("tied", True), ("untied", False)):
        model, tokenizer = build_smollm_like(tie_word_embeddings=tied, seed=1)
        with torch.no_grad():  # logits of a trained model's size: the log-probs vary enough to show any rounding
            for module in {model.get_input_embeddings(), model.get_output_embeddings()}:
                module.weight.mul_(2.0)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def _cfg(**kw) -> PPOConfig:
    base = dict(
        total_episodes=4,
        batch_size=4,
        num_mini_batches=2,
        num_ppo_epochs=1,
        max_new_tokens=8,
        save_every=100,
        record_rollouts=False,
        temperature=0.7,
        forward_batch_size=3,  # the no-grad scoring chunks differ from the minibatches
    )
    return PPOConfig(**{**base, **kw})


def _first_update(path: str, cfg: PPOConfig, runtime: RuntimeConfig, tmp_path):
    """The models, the first rollout (advantages computed) and the first minibatch's step, as the PPO stage runs
    them (reward function as the score, the value model from the checkpoint with gae)."""
    m = load_models(cfg, runtime, path, None, None if cfg.critic_free else path, CPU, REWARD)
    state = load_state(tmp_path / "no-state", m, cfg, 0, CPU)
    prompts = [
        m.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    ids = encode_prompts(m.tokenizer, prompts, cfg.max_prompt_tokens)
    batch = prompt_batch(ids, 0, cfg.batch_size, 0, m.tokenizer.pad_token_id, samples_per_prompt=cfg.samples_per_prompt)
    dtype = torch.bfloat16 if runtime.dtype == "bfloat16" else torch.float32
    settings = generation_settings(cfg, m)
    plan = ExecutionPlan.for_models(m, dtype)
    r = ppo_update.generate_and_score(m, batch, prompts, cfg, settings, state.sample_generator, plan)
    ppo_update.compute_advantages(r, cfg, state.kl_ctl.value)
    rows = torch.arange(cfg.mini_batch_size)
    step = ppo_optimise.minibatch_step(m, state, r, rows, cfg, plan)
    return m, r, step


@pytest.mark.parametrize(
    ("lora", "estimator", "samples"),
    [(False, "gae", 1), (False, "grpo", 2), (False, "reinforce_pp", 1), (True, "gae", 1), (True, "rloo", 2)],
)
def test_first_update_kl_is_zero_and_ratio_one_under_bf16(checkpoints, tmp_path, lora, estimator, samples):
    cfg = _cfg(lora={"enabled": lora}, advantage_estimator=estimator, samples_per_prompt=samples)
    m, r, step = _first_update(checkpoints["tied"], cfg, BF16, tmp_path)
    assert next(m.policy.parameters()).dtype == torch.float32  # master weights, under CPU autocast
    assert r.mask.sum() > 4 * 3  # real responses
    # identical weights: the reference's log-probs are the policy's, bit for bit, so the KL is exactly 0
    assert torch.equal(r.scored.logprobs, r.scored.ref_logprobs)
    assert torch.equal(r.kl, torch.zeros_like(r.kl))
    assert torch.equal(r.non_score_rewards, torch.zeros_like(r.non_score_rewards))
    assert step.ratios.numel() > 0 and torch.equal(step.ratios, torch.ones_like(step.ratios))
    assert step.stats["policy/approxkl"] == 0.0 and step.stats["policy/clipfrac"] == 0.0
    if lora:
        assert m.reference is None
        return
    # the reference: the matmul weights in bf16 (autocast casts them anyway), the tied embeddings and norms float32
    dtypes = {name: p.dtype for name, p in m.reference.named_parameters()}
    assert dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.norm.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.bfloat16
    # the control: a reference loaded in bf16 (the frozen models' runtime dtype) scores the same rollout otherwise
    bf16 = load_causal_lm(checkpoints["tied"], CPU, dtype=torch.bfloat16).eval()
    s = r.scored
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = policy_forward(bf16, s.query_responses, s.qr_mask, s.prompt_len, cfg.temperature).logprobs.float()
    assert not torch.equal(rounded * r.mask, s.ref_logprobs * r.mask)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    """A Llama with SmolLM2-135M's layer shapes (hidden 576, 9 heads over 3 KV heads, MLP 1536) in 2 layers and a
    tiny vocabulary: there this CPU's bf16 matmul kernels give results that depend on how many rows they multiply at
    once (blocks of the sum chosen by the shape), as they do on SmolLM2-135M itself."""
    shape = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    model, tokenizer = build_smollm_like(seed=2, **shape)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2.0)
    path = tmp_path_factory.mktemp("wide")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    ("estimator", "threads", "lora"),
    [
        ("dr_grpo", 2, False),
        ("gae", 2, False),
        ("dr_grpo", 2, True),
        # 20 to 30 s each where bf16 is emulated (AVX2): `make test-long`
        pytest.param("dr_grpo", 1, False, marks=pytest.mark.long),
        pytest.param("grpo", 2, False, marks=pytest.mark.long),
        pytest.param("reinforce_pp", 1, False, marks=pytest.mark.long),
    ],
)
def test_the_trainer_s_first_update_is_exact_under_bf16(wide, tmp_path, estimator, threads, lora):
    """The first update as the PPO stage runs it (`rlhf.ppo.trainer`): the first epoch's order drawn before sampling,
    the rollout's policy and reference forwards of the first minibatch on the rows, columns and threads of its
    forwards (`ExecutionPlan.rollout_groups`; the first minibatch's old log-probs deferred to the optimisation where
    the KL is in the loss; under bf16 a critic-free micro-batch whole, on every torch thread; with LoRA the
    reference is the policy with its adapters off). Every row's KL is exactly 0 and the first minibatch's ratio
    exactly 1. Before, the deferred rows' reference log-probs came from forwards of other rows on other threads (a
    first-update KL of 0.08 per response on SmolLM2-135M under bf16; here up to 9e-4)."""
    critic_free = estimator != "gae"
    cfg = _cfg(
        advantage_estimator=estimator, samples_per_prompt=2 if critic_free else 1, batch_size=16, total_episodes=16,
        num_mini_batches=2, max_new_tokens=24, forward_batch_size=None, lora={"enabled": lora},
    )  # fmt: skip
    with torch_threads(threads):
        m = load_models(cfg, BF16, wide, None, None if critic_free else wide, CPU, REWARD)
        state = load_state(tmp_path / "no-state", m, cfg, 0, CPU)
        prompts = [
            m.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in QUESTIONS
        ]
        ids = encode_prompts(m.tokenizer, prompts, cfg.max_prompt_tokens)
        batch = prompt_batch(
            ids, 0, cfg.batch_size, 0, m.tokenizer.pad_token_id, samples_per_prompt=cfg.samples_per_prompt
        )
        plan = ExecutionPlan.for_models(m, torch.bfloat16)
        assert not plan.split_policy  # under bf16 a critic-free micro-batch runs whole, on every thread
        order = first_epoch_order(cfg, state.shuffle_generator, len(batch.indices))
        r = generate_and_score(m, batch, prompts, cfg, generation_settings(cfg, m), state.sample_generator, plan, order)
        compute_advantages(r, cfg, state.kl_ctl.value)
        result = ppo_optimise.optimize(m, state, r, cfg, plan)
        refresh_kl(r, cfg)
    assert r.mask.sum() > 16 * 8  # real responses
    assert torch.equal(r.kl, torch.zeros_like(r.kl)), (r.kl * r.mask).sum(1)
    first = result.minibatch_stats[0]
    assert first["policy/ratio_mean"] == 1.0 and first["policy/ratio_var"] == 0.0, first
    assert first["policy/approxkl"] == 0.0 and first["policy/clipfrac"] == 0.0


def test_float32_runs_keep_a_float32_reference(checkpoints, tmp_path):
    float32 = RuntimeConfig(device="cpu", progress=False, dtype="float32")
    m, r, step = _first_update(checkpoints["untied"], _cfg(), float32, tmp_path)
    assert {p.dtype for p in m.reference.parameters()} == {torch.float32}
    assert torch.equal(r.scored.logprobs, r.scored.ref_logprobs)
    assert torch.equal(step.ratios, torch.ones_like(step.ratios))
    # float16 on a CPU runs without autocast (the policy computes in float32): so does the reference
    fp16 = load_reference_lm(checkpoints["untied"], RuntimeConfig(device="cpu", dtype="float16"), CPU)
    assert {p.dtype for p in fp16.parameters()} == {torch.float32}


def test_reference_of_an_untied_model_matches_the_policy_forward(checkpoints):
    """The untied LM head's weight is a matmul weight (bf16 in the reference); the log-probs stay the policy's."""
    path = checkpoints["untied"]
    policy = load_causal_lm(path, CPU).eval()
    reference = load_reference_lm(path, BF16, CPU).eval()
    assert reference.lm_head.weight.dtype == torch.bfloat16
    assert reference.model.embed_tokens.weight.dtype == torch.float32
    ids = torch.randint(5, policy.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours = policy_forward(policy, ids, mask, 8, 0.7, with_entropy=True)
        theirs = policy_forward(reference, ids, mask, 8, 0.7, with_entropy=True)
    assert torch.equal(ours.logprobs, theirs.logprobs)
    assert torch.equal(ours.entropy, theirs.entropy)


def test_lowered_parameters_leave_tied_embeddings_and_head_biases_in_float32(tmp_path):
    tied, _ = build_smollm_like(tie_word_embeddings=True)
    names = set(autocast_lowered_parameters(tied))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" not in names  # one tensor, looked up
    assert not any("norm" in name for name in names)
    linear = {n for n, mod in tied.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"}
    assert names == {f"{n}.weight" for n in linear}
    untied, _ = build_smollm_like(tie_word_embeddings=False)
    assert "lm_head.weight" in autocast_lowered_parameters(untied)
    # GPT-2's Conv1D layers are matmuls too (addmm); Phi's LM head bias is added in float32 by the fused CPU head
    gpt2 = AutoModelForCausalLM.from_pretrained(build_family("gpt2", tmp_path / "gpt2"))
    gpt2_names = set(autocast_lowered_parameters(gpt2))
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"} <= gpt2_names
    assert not any(n.startswith(("transformer.wte", "transformer.wpe", "transformer.ln")) for n in gpt2_names)
    phi = AutoModelForCausalLM.from_pretrained(build_family("phi", tmp_path / "phi"))
    phi_names = set(autocast_lowered_parameters(phi))
    assert "lm_head.weight" in phi_names and "lm_head.bias" not in phi_names
    match_autocast(phi, torch.bfloat16)
    assert phi.lm_head.bias.dtype == torch.float32 and phi.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("tied", [True, False])
def test_reference_bytes_from_a_meta_model_are_those_loaded(checkpoints, tied):
    """`reference_bytes` of a meta-device model's counts (what a memory estimate has) is the loaded reference's size."""
    path = checkpoints["tied" if tied else "untied"]
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    loaded = load_reference_lm(path, BF16, CPU)
    actual = sum(p.numel() * p.element_size() for p in loaded.parameters())
    n = sum(p.numel() for p in meta.parameters())
    lowered = sum(p.numel() for p in autocast_lowered_parameters(meta).values())
    assert reference_bytes(n, lowered, 2) == actual
    assert 2 * n < actual < 4 * n  # between an all-bf16 and an all-float32 copy
    assert reference_bytes(n, lowered, 4) == 4 * n


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_s_reference_computes_the_policy_s_log_probs(family_checkpoint, family):
    """Gemma's (1 + w) norms, OPT's projected embeddings, Phi's LM-head bias, Gemma-2's soft-cap, GPT-2's Conv1D:
    under bf16 autocast the reference's log-probs and entropies are the float32 policy's, bit for bit."""
    path = str(family_checkpoint(family))
    policy = load_causal_lm(path, CPU).eval()
    reference = load_reference_lm(path, BF16, CPU).eval()
    assert any(p.dtype == torch.bfloat16 for p in reference.parameters())
    ids = torch.randint(10, policy.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours = policy_forward(policy, ids, mask, 6, 1.0, with_entropy=True)
        theirs = policy_forward(reference, ids, mask, 6, 1.0, with_entropy=True)
    assert torch.equal(ours.logprobs, theirs.logprobs)
    assert torch.equal(ours.entropy, theirs.entropy)
