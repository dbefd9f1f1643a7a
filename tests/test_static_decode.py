"""The static-cache decode modes (`ppo.generation.decode`) sample the tokens the dynamic cache samples: greedy and
seeded sampling, stop tokens mid-batch, left padding, GRPO's repeated prompts and the evaluation path, on tiny
random-weight models of several families (tests/model_zoo.py). Eager here; torch.compile once, in a slow test."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer
from rlhf.rollout.batching import pad_left
from rlhf.rollout.generation import GenerationSettings, Responses, sample_responses
from rlhf.rollout.static_decode import COMPILE_LOG, LENGTH_BUCKET, bucketed_length, resolve_decode

FAMILIES = ["llama", "qwen2", "gpt2", "gemma2", "gpt_neox"]  # gemma2: a sliding window shorter than the responses
PROMPTS = ["Review of The Silent River:", "Review of The Paper Horizon, a long one with more words:", "Hi"]


def _load(path) -> tuple:
    tok = load_tokenizer(str(path))
    model = load_causal_lm(str(path), torch.device("cpu")).eval()
    ids, mask = pad_left(tok(PROMPTS, add_special_tokens=False)["input_ids"], tok.pad_token_id or 0)
    assert (mask == 0).any()  # left padding in the batch
    return tok, model, ids, mask


def _both(model, ids, mask, settings: GenerationSettings, seed: int = 3, mode: str = "static") -> tuple:
    dynamic = sample_responses(model, ids, mask, settings, torch.Generator().manual_seed(seed))
    other = sample_responses(model, ids, mask, replace(settings, decode=mode), torch.Generator().manual_seed(seed))
    return dynamic, other


def _assert_same(a: Responses, b: Responses) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.mask, b.mask)
    assert torch.equal(a.contains_stop, b.contains_stop)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_samples_the_dynamic_caches_tokens(family_checkpoint, family):
    tok, model, ids, mask = _load(family_checkpoint(family))
    pad = tok.pad_token_id or 0
    greedy = GenerationSettings(24, top_k=1, pad_token_id=pad)
    _assert_same(*_both(model, ids, mask, greedy))
    sampled = GenerationSettings(24, temperature=0.7, top_p=0.95, pad_token_id=pad)
    a, b = _both(model, ids, mask, sampled)
    _assert_same(a, b)
    assert not torch.equal(a.tokens, _both(model, ids, mask, sampled, seed=4)[0].tokens)  # the seed matters
    # a stop token one row samples early and another row does not: that row stops mid-batch, the loop goes on
    stop = int(a.tokens[0, 2])
    assert (a.tokens[1:, :-1] != stop).any(1).all()
    stopped = replace(sampled, stop_token_ids=(stop,))
    a, b = _both(model, ids, mask, stopped)
    _assert_same(a, b)
    assert bool(a.contains_stop[0]) and int(a.mask[0].sum()) <= 3 and a.tokens.shape[1] > 3


@pytest.mark.parametrize("family", FAMILIES)
def test_static_logits_match_the_dynamic_caches_at_every_step(family_checkpoint, family):
    """Sampling by inverting the CDF keeps a token under small logit errors: the logits themselves, step by step, on
    the same forced tokens (a wrong cache position or mask shows here first)."""
    from rlhf.models.heads import position_ids_from_mask
    from rlhf.rollout.generation import _DynamicDecoder
    from rlhf.rollout.static_decode import StaticDecoder

    _, model, ids, mask = _load(family_checkpoint(family))
    forced = torch.randint(3, model.config.vocab_size, (len(ids), 12), generator=torch.Generator().manual_seed(0))
    decoders = _DynamicDecoder(model, mask), StaticDecoder(model, ids, mask, forced.shape[1], compiled=False)
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        steps = [[d.prefill(ids, pos) for d in decoders]]
        for t in range(forced.shape[1]):
            pos = pos[:, -1:] + 1
            steps.append([d.step(forced[:, t : t + 1], pos) for d in decoders])
    for dynamic, static in steps:
        torch.testing.assert_close(static, dynamic, atol=1e-5, rtol=1e-5)


def test_repeated_prompts_of_a_group_estimator(family_checkpoint):
    """GRPO's batches: each prompt 4 times in a row, each copy sampled on its own."""
    tok, model, ids, mask = _load(family_checkpoint("llama"))
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    a, b = _both(model, ids, mask, GenerationSettings(16, pad_token_id=tok.pad_token_id or 0))
    _assert_same(a, b)
    assert not torch.equal(a.tokens[0], a.tokens[1])


def test_static_cache_is_reused_and_zeroed_between_calls(family_checkpoint):
    """A second call on the same (bucketed) shape reuses the cache: nothing of the first call's keys leaks."""
    tok, model, ids, mask = _load(family_checkpoint("qwen2"))
    settings = GenerationSettings(12, decode="static", pad_token_id=tok.pad_token_id or 0)
    first = sample_responses(model, ids, mask, settings, torch.Generator().manual_seed(1))
    other = torch.flip(ids, [0]), torch.flip(mask, [0])
    sample_responses(model, *other, settings, torch.Generator().manual_seed(2))
    again = sample_responses(model, ids, mask, settings, torch.Generator().manual_seed(1))
    _assert_same(first, again)


def test_the_evaluation_path_scores_the_same_responses(tiny_checkpoints):
    """The evaluation stage and PPO's periodic evaluation (`generate_and_score_prompts`): the same table."""
    from rlhf.eval.responses import generate_and_score_prompts
    from rlhf.rollout.scoring import ScoringModels

    tok = load_tokenizer(tiny_checkpoints["policy"])
    policy = load_causal_lm(tiny_checkpoints["policy"], torch.device("cpu")).eval()
    reward = load_reward_model(tiny_checkpoints["reward"], torch.device("cpu")).eval()
    models = ScoringModels(policy, policy, reward, tok, tok, same_tokenizer=True)
    settings = GenerationSettings(
        10, temperature=0.9, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id
    )
    prompts = PROMPTS * 3

    def table(decode: str):
        run = replace(settings, decode=decode)
        return generate_and_score_prompts(models, prompts, run, 32, 4, torch.Generator().manual_seed(0), torch.float32)

    dynamic, static = table("dynamic"), table("static")
    assert dynamic["response"].tolist() == static["response"].tolist()
    assert dynamic["score"].tolist() == pytest.approx(static["score"].tolist(), abs=1e-6)


def test_decode_modes_resolve_by_device():
    assert resolve_decode("auto", torch.device("cuda")) == "compiled"
    assert resolve_decode("auto", torch.device("cpu")) == "dynamic"
    assert resolve_decode("static", torch.device("cpu")) == "static"
    with pytest.raises(ValueError, match="decode mode"):
        resolve_decode("graph", torch.device("cpu"))
    assert bucketed_length(16, 32) == LENGTH_BUCKET and bucketed_length(40, 32) == 2 * LENGTH_BUCKET


@pytest.mark.slow
def test_compiled_decode_samples_the_same_tokens(family_checkpoint):
    """torch.compile of the one-token step (inductor on the CPU), once: the tokens of the dynamic cache, and the
    warm-up is logged once per shape."""
    tok, model, ids, mask = _load(family_checkpoint("gpt2"))
    settings = GenerationSettings(8, temperature=0.8, pad_token_id=tok.pad_token_id or 0)
    before = COMPILE_LOG.count
    _assert_same(*_both(model, ids, mask, settings, mode="compiled"))
    _assert_same(*_both(model, ids, mask, settings, seed=5, mode="compiled"))
    assert COMPILE_LOG.count == before + 1 and COMPILE_LOG.seconds > 0


def test_a_models_static_cache_goes_with_the_model(family_checkpoint):
    """The caches (and compiled steps) live on the model: a sweep's finished variants are freed. A compiled step
    refers to its model; a stand-in that does too takes its place here (no compile in the quick tests)."""
    import gc
    import weakref

    from rlhf.rollout import static_decode

    tok, model, ids, mask = _load(family_checkpoint("llama"))
    sample_responses(model, ids, mask, GenerationSettings(4, decode="static", pad_token_id=tok.pad_token_id or 0))
    (slot,) = getattr(model, static_decode._SLOTS_ATTR).values()
    slot.step = model.forward  # a bound method: refers to the model, as a compiled step does
    gone = weakref.ref(model)
    del model, slot
    gc.collect()
    assert gone() is None


def test_a_failed_compile_decodes_uncompiled_with_a_warning(family_checkpoint, monkeypatch, caplog):
    """No compiler or triton on the machine: the run goes on over the static cache, says so, and samples the same."""
    from rlhf.rollout import static_decode

    def no_compiler(*args, **kwargs):
        def step(*a, **k):
            raise RuntimeError("no C++ compiler")

        return step

    monkeypatch.setattr(static_decode, "_compiled_step", no_compiler)
    tok, model, ids, mask = _load(family_checkpoint("qwen2"))
    failures = len(COMPILE_LOG.failures)
    _assert_same(*_both(model, ids, mask, GenerationSettings(10, pad_token_id=tok.pad_token_id or 0), mode="compiled"))
    assert len(COMPILE_LOG.failures) == failures + 1 and "no C++ compiler" in COMPILE_LOG.failures[-1]
    assert "decoding uncompiled" in caplog.text


def test_the_evaluation_table_carries_the_reference_s_surprisal_at_the_response_tokens(tiny_checkpoints):
    """`ref_nll` is -log p_ref summed over the response's tokens (stop token included, padding not) at the sampling
    temperature (as the KL's log-probs), as a forward of the reference over the prompt and the sampled tokens gives
    it (the tokens drawn again with the same seed: a random model's byte tokens do not survive a trip through text)."""
    from rlhf.eval.responses import generate_and_score_prompts
    from rlhf.rollout.batching import pad_left
    from rlhf.rollout.prompt_fit import fit_prompts
    from rlhf.rollout.scoring import ScoringModels, generate_and_score

    tok = load_tokenizer(tiny_checkpoints["policy"])
    policy = load_causal_lm(tiny_checkpoints["policy"], torch.device("cpu")).eval()
    reference = load_causal_lm(tiny_checkpoints["policy"], torch.device("cpu")).eval()
    with torch.no_grad():  # a reference that is not the policy
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    reward = load_reward_model(tiny_checkpoints["reward"], torch.device("cpu")).eval()
    models = ScoringModels(policy, reference, reward, tok, tok, same_tokenizer=True)
    settings = GenerationSettings(
        10, temperature=0.9, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id
    )
    prompts = PROMPTS[:4]
    generator = torch.Generator().manual_seed(0)
    frame = generate_and_score_prompts(models, prompts, settings, 32, 4, generator, torch.float32)
    query, mask = pad_left(fit_prompts(tok, prompts, 32).ids, tok.pad_token_id)
    drawn = generate_and_score(models, query, mask, prompts, settings, torch.Generator().manual_seed(0), torch.float32)
    assert frame["kl"].abs().min() > 1e-3  # the reference differs
    for i, row in enumerate(frame.to_dict("records")):
        n = int(drawn.resp.mask[i].sum())
        assert row["tokens"] == n == row["length"] + row["stopped"]
        prompt_ids = [t for t, m in zip(query[i].tolist(), mask[i].tolist(), strict=True) if m]
        ids = torch.tensor([prompt_ids + drawn.resp.tokens[i, :n].tolist()])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt_ids) - 1 : -1].float() / 0.9
        nll = -torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt_ids) :, None]).sum()
        assert row["ref_nll"] == pytest.approx(float(nll), rel=1e-4)
