"""Sampling responses: logit filtering, inverse-CDF sampling, a KV-cached decode loop, truncation at the stop token.

Used by PPO rollouts and by evaluation (through `rlhf.rollout.scoring.generate_and_score`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.heads import position_ids_from_mask
from rlhf.rollout.static_decode import StaticDecoder, cache_args


@dataclass(frozen=True)
class GenerationSettings:
    """How responses are sampled: length, temperature, top-k / nucleus filtering, stop and pad ids."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    decode: str = "dynamic"  # 'dynamic', 'static' or 'compiled' (rlhf.rollout.static_decode.resolve_decode)


class Responses(NamedTuple):
    tokens: Tensor  # (b, r) sampled ids, pad after the first stop token
    mask: Tensor  # (b, r) 1 up to and including the first stop token
    contains_stop: Tensor  # (b,) bool


class Sampler(Protocol):
    """Another generation backend (``rlhf.rollout.vllm_backend``): called as `sample_responses` is, without the model,
    given the policy's weights after each update, closed at the end of the run."""

    def __call__(
        self, prompt_ids: Tensor, prompt_mask: Tensor, settings: GenerationSettings, generator: torch.Generator | None
    ) -> Responses: ...

    def sync_weights(self) -> float: ...

    def close(self) -> None: ...


def filter_logits(logits: Tensor, top_k: int | None, top_p: float | None) -> Tensor:
    """Top-k then nucleus filtering: removed entries become -inf. Shape: (b, v) -> (b, v)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# vocabularies of at least this many entries are sampled through blocks of _SAMPLE_BLOCK: two short prefix sums
# instead of one over the whole vocabulary, which on a CPU is a sizeable part of each decoding step
_TWO_LEVEL_VOCAB = 4096
_SAMPLE_BLOCK = 256


def _below(bound: Tensor, x: Tensor) -> Tensor:
    """`x`, capped at the largest float below `bound`: a point of a CDF strictly inside its total."""
    return torch.minimum(x, torch.nextafter(bound, torch.zeros_like(bound)))


def sample_from_logits(logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row from softmax(logits) by inverting the CDF with one uniform draw per row.

    Exact like torch.multinomial, and several times cheaper on CPU (no per-entry exponential draws). Large
    vocabularies invert two CDFs: over the sums of blocks of 256 entries, then inside the block drawn. A token of
    probability 0 (a -inf logit) is never drawn. Shape: (b, v) -> (b,).
    """
    logits = logits.float()
    b, v = logits.shape
    weights = logits.sub(logits.amax(-1, keepdim=True)).exp_()  # unnormalised probabilities
    u = torch.rand((b, 1), generator=generator, device=logits.device)
    if v < _TWO_LEVEL_VOCAB:
        cdf = weights.cumsum(-1)
        target = _below(cdf[:, -1:], u * cdf[:, -1:])
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=v - 1)  # NaN rows: in range
    size = _SAMPLE_BLOCK
    blocks = F.pad(weights, (0, -v % size)).view(b, -1, size)
    block_cdf = blocks.sum(-1).cumsum(-1)  # (b, blocks)
    target = _below(block_cdf[:, -1:], u * block_cdf[:, -1:])
    block = torch.searchsorted(block_cdf, target, right=True)  # the first block whose CDF passes the target
    block.clamp_(max=block_cdf.shape[1] - 1)  # (NaN logits pass no CDF: any in-range id, the NaN is caught later)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, block[:, :, None].expand(b, 1, size)).squeeze(1).cumsum(-1)  # (b, size)
    rest = _below(inner[:, -1:], (target - before).clamp_(min=0))
    return (block * size + torch.searchsorted(inner, rest, right=True)).squeeze(1).clamp_(max=v - 1)


def truncate_at_stop(tokens: Tensor, stop_token_ids: tuple[int, ...], pad_token_id: int) -> Responses:
    """Keep each response up to and including its first stop token; the rest becomes padding."""
    if stop_token_ids:
        is_stop = torch.isin(tokens, torch.tensor(stop_token_ids, device=tokens.device))
    else:
        is_stop = torch.zeros_like(tokens, dtype=torch.bool)
    after_stop = (is_stop.long().cumsum(1) - is_stop.long()) > 0  # strictly after the first stop
    mask = (~after_stop).long()
    return Responses(tokens.masked_fill(after_stop, pad_token_id), mask, is_stop.any(1))


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids `decode(..., skip_special_tokens=True)` leaves out: the special tokens of the tokenizer's map and every
    added token marked special (a chat template's `<|im_start|>` / `<|im_end|>`)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, token in added.items() if getattr(token, "special", False)}


def response_texts(tokenizer: PreTrainedTokenizerBase, resp: Responses) -> list[str]:
    """The responses as the texts that are logged and read (rollout records, evaluation completions). Special tokens
    inside a response stay visible: a leaked `<|im_start|>assistant` or a second turn shows in the text, where
    ``skip_special_tokens=True`` would hide it. Left out: the padding, and the closing stop token when it is a
    special token (EOS, end of turn), so a clean response reads as before. Shape: resp (b, r) -> b texts."""
    special = special_token_ids(tokenizer)
    rows = []
    lengths, stopped = resp.mask.sum(1).tolist(), resp.contains_stop.tolist()
    for ids, n, stop in zip(resp.tokens.tolist(), lengths, stopped, strict=True):
        ids = ids[:n]  # (r,) -> the response up to and including its first stop token
        rows.append(ids[:-1] if stop and ids and ids[-1] in special else ids)
    return tokenizer.batch_decode(rows, skip_special_tokens=False)


def _done_everywhere(done: bool, device: torch.device) -> bool:
    """Whether every rank of the process group is done (a MIN all-reduce)."""
    import torch.distributed as dist

    flag = torch.tensor([int(done)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class _DynamicDecoder:
    """The forward calls of one sampling call over transformers' dynamic KV cache (it grows by a token a step)."""

    def __init__(self, model: PreTrainedModel, prompt_mask: Tensor):
        self.args = cache_args(model)
        # only the last position's logits: the prefill would otherwise hold (b, p, vocab) floats (GiBs at 150k entries)
        self.last_only = {"logits_to_keep": 1} if self.args.logits_to_keep else {}
        self.model, self.mask, self.cache = model, prompt_mask, None

    def step(self, ids: Tensor, pos: Tensor) -> Tensor:
        """The next token's logits. Shape: ids, pos (b, t) -> (b, v)."""
        if self.cache is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=pos,
            use_cache=True,
            **{self.args.name: self.cache},
            **self.last_only,
        )
        self.cache = getattr(out, self.args.name)
        return out.logits[:, -1].float()

    prefill = step


def _next_tokens(logits: Tensor, settings: GenerationSettings, generator: torch.Generator | None) -> Tensor:
    """Temperature, top-k / top-p filtering and one draw per row. Shape: (b, v) -> (b,)."""
    if settings.temperature != 1.0:  # x / 1.0 is x: no copy of (b, vocabulary) per token
        logits = logits / settings.temperature
    return sample_from_logits(filter_logits(logits, settings.top_k, settings.top_p), generator)


@torch.no_grad()
def sample_responses(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: GenerationSettings,
    generator: torch.Generator | None = None,
    lockstep: bool = False,
) -> Responses:
    """Autoregressive sampling with a KV cache; stops early when every row has produced a stop token.

    `settings.decode`: 'dynamic' (transformers' dynamic cache), 'static' (a static cache,
    `rlhf.rollout.static_decode`) or 'compiled' (the static cache's decoding step under torch.compile; a CUDA graph
    on a GPU); the same tokens. `lockstep` (a model sharded across processes, whose every forward is a collective):
    the loop stops only when every rank's rows have stopped; a rank done before the others runs forwards without
    sampling (the responses, and the generator's draws, are those of a loop that stopped on its own); it decodes
    over the dynamic cache.

    Shape: prompt_ids, prompt_mask (b, p), left-padded -> Responses with (b, r), r <= max_new_tokens.
    """
    b = prompt_ids.shape[0]
    device = prompt_ids.device
    stop = torch.tensor(settings.stop_token_ids or (-1,), device=device)
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    ids, pos = prompt_ids, position_ids_from_mask(prompt_mask)
    if settings.decode == "dynamic" or lockstep:
        decoder = _DynamicDecoder(model, prompt_mask)
    else:
        compiled = settings.decode == "compiled"
        decoder = StaticDecoder(model, prompt_ids, prompt_mask, settings.max_new_tokens, compiled)
    tokens = []
    done = False
    for t in range(settings.max_new_tokens):
        logits = decoder.prefill(ids, pos) if t == 0 else decoder.step(ids, pos)
        if done:  # lockstep: this rank's rows have all stopped, another rank's have not
            nxt = torch.full((b,), settings.pad_token_id, dtype=ids.dtype, device=device)
        else:
            nxt = _next_tokens(logits, settings, generator).masked_fill(finished, settings.pad_token_id)
            tokens.append(nxt)
            finished |= torch.isin(nxt, stop)
            done = bool(finished.all())
        if _done_everywhere(done, device) if lockstep else done:  # lockstep: an all-reduce on every rank, every step
            break
        ids = nxt[:, None]
        pos = pos[:, -1:] + 1
    return truncate_at_stop(torch.stack(tokens, 1), settings.stop_token_ids, settings.pad_token_id)
