"""Generation, truncation and log-prob invariants on a tiny real GPT-2."""

from __future__ import annotations

import warnings

import torch

from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.ops import logprobs_from_logits
from rlhf.rollout.batching import pad_left
from rlhf.rollout.forwards import policy_forward
from rlhf.rollout.generation import GenerationSettings, filter_logits, sample_responses, truncate_at_stop


def test_truncate_at_stop_keeps_the_stop_token_and_pads_after():
    tokens = torch.tensor([[5, 9, 2, 7], [5, 6, 7, 8]])
    out = truncate_at_stop(tokens, stop_token_ids=(2,), pad_token_id=0)
    assert out.tokens.tolist() == [[5, 9, 2, 0], [5, 6, 7, 8]]
    assert out.mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert out.contains_stop.tolist() == [True, False]


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=None)).tolist() == [[False, False, True, True]]
    # nucleus 0.7: 0.5 < 0.7 keeps the second token (cumulative 0.8 crosses), drops the rest
    assert torch.isinf(filter_logits(logits, top_k=None, top_p=0.7)).tolist() == [[False, False, True, True]]


def _setup(tiny_checkpoints):
    tok = load_tokenizer(tiny_checkpoints["policy"])
    policy = load_causal_lm(tiny_checkpoints["policy"], torch.device("cpu")).eval()
    prompts = ["Review of The Silent River:", "Review of The Paper Horizon, a long one:"]
    ids, mask = pad_left(tok(prompts, add_special_tokens=False)["input_ids"], tok.pad_token_id)
    return tok, policy, ids, mask


def test_rollout_logprobs_match_a_plain_forward_at_temperature(tiny_checkpoints):
    tok, policy, ids, mask = _setup(tiny_checkpoints)
    settings = GenerationSettings(8, temperature=0.7, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    resp = sample_responses(policy, ids, mask, settings, torch.Generator().manual_seed(0))
    qr, qr_mask = torch.cat([ids, resp.tokens], 1), torch.cat([mask, resp.mask], 1)
    with torch.no_grad():
        ours = policy_forward(policy, qr, qr_mask, ids.shape[1], 0.7).logprobs
        # reference: each row alone, unpadded, full logits through the plain HF forward
        for row in range(len(ids)):
            real = qr[row][qr_mask[row].bool()]
            n_prompt = int(mask[row].sum())
            logits = policy(real[None]).logits[0, n_prompt - 1 : -1]
            expected = logprobs_from_logits(logits[None], real[None, n_prompt:], 0.7)[0]
            n = int(resp.mask[row].sum())
            torch.testing.assert_close(ours[row, :n], expected, atol=1e-5, rtol=1e-5)


def test_left_padding_does_not_change_logprobs(tiny_checkpoints):
    tok, policy, ids, mask = _setup(tiny_checkpoints)
    response = torch.tensor([[11, 12, 13], [11, 12, 13]])
    qr, qr_mask = torch.cat([ids, response], 1), torch.cat([mask, torch.ones_like(response)], 1)
    with torch.no_grad():
        batched = policy_forward(policy, qr, qr_mask, ids.shape[1], 1.0).logprobs
        short = int(mask[0].sum())
        alone = policy_forward(
            policy,
            torch.cat([ids[0:1, -short:], response[:1]], 1),
            torch.ones(1, short + 3, dtype=torch.long),
            short,
            1.0,
        ).logprobs
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)


def test_sampling_is_seeded_and_stops(tiny_checkpoints):
    tok, policy, ids, mask = _setup(tiny_checkpoints)
    settings = GenerationSettings(6, stop_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    a = sample_responses(policy, ids, mask, settings, torch.Generator().manual_seed(1))
    b = sample_responses(policy, ids, mask, settings, torch.Generator().manual_seed(1))
    assert torch.equal(a.tokens, b.tokens)
    assert a.tokens.shape[1] <= 6
    # everything after a stop token is padding and masked
    for row in range(len(ids)):
        n = int(a.mask[row].sum())
        assert (a.tokens[row, n:] == tok.pad_token_id).all()


def test_sampling_passes_the_kv_cache_under_the_name_this_transformers_takes(tiny_checkpoints):
    """transformers 5.2x renamed `past_key_values` to `cache` and warns on every call with the old name: a warning
    per decoding step in `make run`'s output."""
    tok, policy, ids, mask = _setup(tiny_checkpoints)
    settings = GenerationSettings(4, stop_token_ids=(), pad_token_id=tok.pad_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = sample_responses(policy, ids, mask, settings, torch.Generator().manual_seed(1))
    assert out.tokens.shape == (len(ids), 4)


def test_sample_from_logits_matches_the_distribution():
    from rlhf.rollout.generation import sample_from_logits

    probs = torch.tensor([0.5, 0.3, 0.0, 0.2])
    logits = torch.log(probs).expand(40000, 4)  # the zero-probability token is -inf
    draws = sample_from_logits(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[2] == 0
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)


def test_sample_from_logits_two_level_path_matches_the_distribution():
    """A real-size vocabulary goes through block sums: the mass on block edges, in the last (partial) block and on a
    lone token is drawn as often as it should be; -inf entries (top-k / top-p filtered) never."""
    from rlhf.rollout.generation import _TWO_LEVEL_VOCAB, sample_from_logits

    v = _TWO_LEVEL_VOCAB + 901  # the last block of 256 is partial
    probs = torch.zeros(v)
    picks = {0: 0.2, 255: 0.1, 256: 0.15, 3000: 0.05, v - 1: 0.3, v - 2: 0.2}
    for token, p in picks.items():
        probs[token] = p
    logits = torch.log(probs).expand(60000, v)
    draws = sample_from_logits(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=v).float() / len(draws)
    assert set(draws.unique().tolist()) <= set(picks)  # nothing of probability 0
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    ramp = torch.linspace(0, 3, v).expand(60000, v)  # every entry possible, mass skewed to the end
    draws = sample_from_logits(ramp, torch.Generator().manual_seed(1))
    bins = torch.arange(v) * 20 // v  # 20 bins across the vocabulary, blocks straddling their edges
    expected = torch.zeros(20).index_add_(0, bins, ramp[0].softmax(-1))
    torch.testing.assert_close(torch.bincount(bins[draws], minlength=20) / len(draws), expected, atol=0.006, rtol=0)
