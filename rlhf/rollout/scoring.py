"""Scoring sampled responses under no grad: policy and reference log-probs, values and reward-model scores (the
models' forwards themselves: ``rlhf.rollout.forwards``).

`generate_and_score` samples responses and scores them; PPO (`rlhf.ppo.update`) and evaluation (`rlhf.eval.evaluate`)
both call it, so a rollout and an evaluation batch are generated and scored the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models import sharding
from rlhf.models.device import autocast, torch_threads
from rlhf.models.heads import sequence_scores
from rlhf.models.reward_ensemble import RewardEnsemble, reward_members
from rlhf.models.training import unwrap
from rlhf.rollout.batching import encode_prompt_response
from rlhf.rollout.forwards import policy_forward, value_forward
from rlhf.rollout.generation import GenerationSettings, Responses, Sampler, sample_responses
from rlhf.rollout.reward_function import RewardFunctions
from rlhf.rollout.row_groups import forward_rows, used_columns
from rlhf.rollout.sides import run_sides
from rlhf.rollout.static_decode import COMPILE_LOG


def reference_logprobs(
    policy: nn.Module,
    reference: PreTrainedModel | None,
    query_responses: Tensor,
    mask: Tensor,
    prompt_len: int,
    temperature: float,
) -> Tensor:
    """Reference log-probs: the frozen copy, or with `reference` None (LoRA) the policy with its adapters disabled.

    Shape: query_responses, mask (b, p + r) -> (b, r).
    """
    if reference is not None:
        return sharding.call(reference, policy_forward, query_responses, mask, prompt_len, temperature).logprobs
    with policy.disable_adapter():
        return policy_forward(unwrap(policy), query_responses, mask, prompt_len, temperature).logprobs


def function_scores(
    models: ScoringModels,
    prompts: list[str] | None,
    rows: list[str] | None,
    resp: Responses,
    model_scores: Tensor | None,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """The reward functions' weighted scores of the decoded responses (reward.source: function), or the reward
    model's scores plus ``reward_fn_weight`` times them; and each function's own scores. `rows`: each response's row
    key (``rlhf.rollout.rows``), for functions that take the row's columns. Shape: (b,), (F, b)."""
    if prompts is None:
        raise ValueError("a reward function scores texts: the prompts' texts are needed")
    assert models.reward_fn is not None
    tokenizer = models.tokenizer
    texts = tokenizer.batch_decode(
        resp.tokens.masked_fill(resp.mask == 0, tokenizer.pad_token_id), skip_special_tokens=True
    )
    parts = models.reward_fn.parts(prompts, texts, rows)
    rule = torch.tensor(models.reward_fn.combine(parts), dtype=torch.float32, device=device)
    parts_tensor = torch.tensor(parts, dtype=torch.float32, device=device).view(len(parts), len(texts))
    return (rule if model_scores is None else model_scores + models.reward_fn_weight * rule), parts_tensor


@torch.no_grad()
def reward_scores(
    reward: PreTrainedModel | RewardEnsemble,
    readers: list[PreTrainedTokenizerBase | None],
    policy_tokenizer: PreTrainedTokenizerBase,
    prompts: list[str] | None,
    query_responses: Tensor,
    qr_mask: Tensor,
    resp: Responses,
    forward_batch_size: int | None,
    device: torch.device,
) -> Tensor:
    """Reward-model score at the last real token of each (prompt, response), of each member of an ensemble (raw:
    without the members' offsets). Shape: (K, b), K = 1 without an ensemble.

    `readers` (one per member, `ScoringModels.readers`): None scores the policy's token ids as they are; a tokenizer
    (the member's own, another vocabulary) scores the decoded response, prompt and response re-tokenized with it (a
    logged decision, see the PPO stage params), so each member of an ensemble of several families reads the text in
    its own tokens.
    """
    texts: list[str] | None = None
    encoded: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}  # (tokenizer, length limit) -> ids, mask
    scores = []
    for member, reader in zip(reward_members(reward), readers, strict=True):
        ids, mask = query_responses, qr_mask
        if reader is not None:
            if prompts is None:
                raise ValueError("the reward model's tokenizer differs from the policy's: prompt texts are needed")
            if texts is None:
                texts = policy_tokenizer.batch_decode(
                    resp.tokens.masked_fill(resp.mask == 0, policy_tokenizer.pad_token_id), skip_special_tokens=True
                )
            limit = getattr(member.config, "max_position_embeddings", None) or 1024
            if (id(reader), limit) not in encoded:
                batch = encode_prompt_response(reader, prompts, texts, max_length=limit)
                encoded[id(reader), limit] = batch.input_ids.to(device), batch.attention_mask.to(device)
            ids, mask = encoded[id(reader), limit]
        size = forward_batch_size or len(ids)
        scores.append(
            torch.cat(
                [
                    sharding.call(member, sequence_scores, ids[i : i + size], mask[i : i + size])
                    for i in range(0, len(ids), size)
                ]
            )
        )
    return torch.stack(scores).float()


@dataclass
class ScoringModels:
    """The models `generate_and_score` samples and scores with.

    `policy` samples (a peft model with LoRA); `reference` None means the policy with its adapters disabled; `value`
    None (evaluation) computes no values; `same_tokenizer`: the reward model scores the policy's token ids as they
    are, else it re-tokenizes the decoded text with `reward_tokenizer`; `member_tokenizers` (where set) says that
    for each scoring model, an ensemble's members one by one; `sampler` None samples with the built-in sampler from
    the policy, else with that sampler (PPO's ppo.generation.backend).
    """

    policy: nn.Module
    reference: PreTrainedModel | None
    reward: PreTrainedModel | RewardEnsemble | None  # None: the reward function alone scores (reward.source: function)
    tokenizer: PreTrainedTokenizerBase
    reward_tokenizer: PreTrainedTokenizerBase
    same_tokenizer: bool
    value: nn.Module | None = None
    sampler: Sampler | None = None
    reward_fn: RewardFunctions | None = None  # reward.function(s): the score (no reward model) or added to it
    reward_fn_weight: float = 1.0  # with a reward model: score = model + weight * functions' weighted sum
    # per scoring model, the tokenizer it re-tokenizes the decoded text with, None: the policy's token ids as they are
    # (`rlhf.models.reward_ensemble.member_tokenizers`); None: every one as `same_tokenizer` says
    member_tokenizers: list[PreTrainedTokenizerBase | None] | None = None

    def readers(self) -> list[PreTrainedTokenizerBase | None]:
        """How each scoring model (an ensemble's members, or the one reward model) reads a response: `reward_scores`'
        `readers`."""
        if self.member_tokenizers is not None:
            return self.member_tokenizers
        return [None if self.same_tokenizer else self.reward_tokenizer] * len(reward_members(self.reward))


@dataclass
class ScoredResponses:
    """Sampled responses with their scores under no grad."""

    query_responses: Tensor  # (b, p + r)
    qr_mask: Tensor  # (b, p + r)
    prompt_len: int
    resp: Responses  # tokens, mask (b, r), contains_stop (b,)
    logprobs: Tensor  # (b, r) policy log-probs at the sampling temperature (0 at the `deferred` rows until filled)
    ref_logprobs: Tensor  # (b, r)
    values: Tensor | None  # (b, r); None without a value model
    scores: Tensor  # (b,) reward-model scores (an ensemble's: its objective's)
    timings: dict[str, float] = field(default_factory=dict)
    member_scores: Tensor | None = None  # (K, b) an ensemble's members' scores less their offsets; None without one
    function_scores: Tensor | None = None  # (F, b) each reward function's own scores; None without functions
    # (b,) bool: the rows whose policy log-probs the optimisation's first pass computes and writes into `logprobs`
    # (`rlhf.ppo.optimise`); None: all computed here
    deferred: Tensor | None = None


def _chunks(n: int, size: int | None) -> list[slice]:
    size = size or max(n, 1)
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def policy_and_reference_logprobs(
    models: ScoringModels,
    query_responses: Tensor,
    qr_mask: Tensor,
    prompt_len: int,
    response_mask: Tensor,
    temperature: float,
    dtype: torch.dtype,
    pieces: list[Tensor],
    deferred: Tensor | None = None,
    paired: bool = False,
) -> tuple[Tensor, Tensor]:
    """No-grad policy and reference log-probs of the rows of each of `pieces` (`forward_rows`), each piece on its
    used columns (`used_columns`), under autocast in `dtype`; the policy's not for the rows of `deferred` (b,) (0
    there). `paired`: two pieces at a time, side by side in two threads (`run_sides`); with LoRA the reference
    forwards (the policy with its adapters disabled, a switch of the shared model) then follow, one at a time, on the
    same torch threads. Shape: query_responses, qr_mask (b, p + R), response_mask (b, R) -> logprobs, ref_logprobs
    (b, R), 0 past each response."""
    device = query_responses.device
    policy = unwrap(models.policy)
    skip = None if deferred is None else deferred.to(device)
    logprobs = torch.zeros(response_mask.shape, dtype=torch.float32, device=device)
    ref_logprobs = torch.zeros(response_mask.shape, dtype=torch.float32, device=device)

    @torch.no_grad()  # grad mode and autocast are per thread: set in the thread that runs it
    def forward(rows: Tensor, of_policy: bool = True, of_reference: bool = True) -> None:
        rows = rows.to(device)
        lead, r = used_columns(qr_mask[rows], prompt_len, response_mask[rows])
        cols, p = slice(lead, prompt_len + r), prompt_len - lead
        qr, mask = query_responses[rows][:, cols], qr_mask[rows][:, cols]
        with autocast(device, dtype):
            if of_policy and (skip is None or not bool(skip[rows].all())):
                logprobs[rows, :r] = sharding.call(policy, policy_forward, qr, mask, p, temperature).logprobs.float()
            if of_reference:
                ref = reference_logprobs(models.policy, models.reference, qr, mask, p, temperature)
                ref_logprobs[rows, :r] = ref.float()

    if paired:
        both = models.reference is not None  # a frozen copy: its forwards may run beside the policy's
        for i in range(0, len(pieces), 2):
            first, rest = partial(forward, pieces[i], True, both), pieces[i + 1 : i + 2]
            run_sides(first, lambda rest=rest: [forward(rows, True, both) for rows in rest], True)
        if not both:
            for rows in pieces:
                forward(rows, of_policy=False)
    else:
        for rows in pieces:
            forward(rows)
    return logprobs, ref_logprobs


def generate_and_score(
    models: ScoringModels,
    query: Tensor,
    query_mask: Tensor,
    prompt_texts: list[str] | None,
    settings: GenerationSettings,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    forward_batch_size: int | None = None,
    second_thread: bool = False,
    deferred: Tensor | None = None,
    groups: list[Tensor] | None = None,
    policy_threads: int | None = None,
    paired: bool = False,
    rows: list[str] | None = None,
) -> ScoredResponses:
    """Sample responses to left-padded prompts, then (no grad) policy and reference log-probs at the sampling
    temperature, values (when there is a value model) and reward-model scores. `second_thread` (a CPU, models of
    about one size): the value and reward forwards run in a second thread beside the policy's and the reference's,
    each op single-threaded (`rlhf.ppo.threads.use_second_thread`). `deferred` (b,) bool: rows whose policy
    log-probs are not computed here (0 until the optimisation's first pass writes them: `rlhf.ppo.optimise`).

    `groups`: the rows of each policy and reference forward, the first minibatch's as the optimisation's first policy
    forwards take them (`rlhf.ppo.plan.ExecutionPlan.rollout_groups`); each group is computed on its tensors without
    its all-padding columns, as the optimisation computes them: a matmul's result can depend on how many rows it
    multiplies (bf16 kernels accumulate in blocks chosen by the shape), so only identical inputs give the first
    minibatch a ratio of exactly 1 and its deferred rows a KL of exactly 0; for the same reason they run on
    `policy_threads` torch threads, the optimisation's, two groups at a time in two threads where `paired` (as its
    halves). None: consecutive rows. Either way policy and reference take the same rows (a KL of exactly 0 at
    identical weights).

    `prompt_texts` are the rows' prompts (needed when the reward model re-tokenizes), `rows` their row keys (needed
    by a reward function that takes row columns: ``rlhf.rollout.rows``); `dtype` is the autocast
    dtype (float32 turns it off); no-grad forwards take `forward_batch_size` rows at a time (None: all).
    Shape: query, query_mask (b, p) -> ScoredResponses with (b, p + r), (b, r) and (b,) tensors.
    """
    device = query.device
    temperature = settings.temperature
    t0, compiled_before = time.perf_counter(), COMPILE_LOG.seconds
    with autocast(device, dtype):
        if models.sampler is not None:
            resp = models.sampler(query, query_mask, settings, generator)
        else:
            policy = unwrap(models.policy)
            lockstep = sharding.is_sharded(policy)  # every rank runs as many forwards
            resp = sharding.call(policy, sample_responses, query, query_mask, settings, generator, lockstep=lockstep)
    query_responses = torch.cat([query, resp.tokens], 1)
    qr_mask = torch.cat([query_mask, resp.mask], 1)
    prompt_len = query.shape[1]
    t1 = time.perf_counter()
    chunks = _chunks(len(query), forward_batch_size)

    policy = unwrap(models.policy)
    pieces = forward_rows(len(query), groups, forward_batch_size)

    def policy_side() -> tuple[Tensor, Tensor]:
        with torch_threads(policy_threads):
            return policy_and_reference_logprobs(
                models, query_responses, qr_mask, prompt_len, resp.mask, temperature, dtype, pieces, deferred, paired
            )

    @torch.no_grad()
    def value_side() -> tuple[Tensor | None, Tensor]:
        with autocast(device, dtype):
            values = None
            if models.value is not None:
                values = torch.cat(
                    [
                        sharding.call(models.value, value_forward, query_responses[s], qr_mask[s], prompt_len)
                        for s in chunks
                    ]
                ).float()
            scores = members = parts = None
            if models.reward is not None:
                raw = reward_scores(
                    models.reward,
                    models.readers(),
                    models.tokenizer,
                    prompt_texts,
                    query_responses,
                    qr_mask,
                    resp,
                    forward_batch_size,
                    device,
                )
                if isinstance(models.reward, RewardEnsemble):  # (K, b) -> (b,): the ensemble objective
                    members = models.reward.centred(raw)
                    scores = models.reward.combine(members)
                else:
                    scores = raw[0]
        if models.reward_fn is not None:
            scores, parts = function_scores(models, prompt_texts, rows, resp, scores, device)
        return values, (scores, members, parts)

    with torch_threads(1 if second_thread else None):  # in two threads, each side's ops single-threaded
        (logprobs, ref_logprobs), (values, (scores, members, parts)) = run_sides(policy_side, value_side, second_thread)
    sharding.reshard(policy, models.reference, models.value, models.reward)  # free what the no-grad calls gathered
    timings = {"time/generate": t1 - t0, "time/score": time.perf_counter() - t1}
    if settings.decode == "compiled":  # the compile warm-up of this call (0 once compiled), inside time/generate
        timings["time/decode_compile"] = COMPILE_LOG.seconds - compiled_before
    return ScoredResponses(
        query_responses, qr_mask, prompt_len, resp, logprobs, ref_logprobs, values, scores, timings, members,
        function_scores=parts, deferred=None if deferred is None else deferred.to(device),
    )  # fmt: skip
