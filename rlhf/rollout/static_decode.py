"""Decoding over a static KV cache, eager or compiled: the forward calls of `rlhf.rollout.generation`'s sampling loop.

The cache is allocated once for a batch size and a bucketed length (prompt + response, rounded up to
`LENGTH_BUCKET`), reused across calls and zeroed before each; every decoding step then has the same shapes, so
`torch.compile` compiles it once (on a GPU in "reduce-overhead" mode: a CUDA graph replayed per token, no per-kernel
launches). The prefill runs eagerly. The logits equal those of the dynamic cache up to the order of float sums
(keys past the current position are masked out); the tests hold the tokens identical (tests/test_static_decode.py).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import StaticCache
from transformers.cache_utils import Cache

# the cache's length is the prompt's plus the responses', rounded up to this: prompts of a batch that differ by a few
# tokens reuse one cache and one compiled step
LENGTH_BUCKET = 64

DECODE_MODES = ("dynamic", "static", "compiled")
logger = logging.getLogger(__name__)


def resolve_decode(name: str, device: torch.device) -> str:
    """`ppo.generation.decode` on `device`: 'auto' is 'compiled' on a CUDA device, else 'dynamic' (measured the
    fastest on the development CPU, docs/benchmark.md "Decoding")."""
    if name == "auto":
        return "compiled" if device.type == "cuda" else "dynamic"
    if name not in DECODE_MODES:
        raise ValueError(f"unknown decode mode {name!r}: one of auto, {', '.join(DECODE_MODES)}")
    return name


@dataclass
class _Slot:
    """A static cache of one (batch, length, dtype) and, when compiled, its decoding step."""

    cache: Cache
    args: CacheArgs
    step: Callable[..., Tensor] | None = None
    compile_seconds: float = 0.0


@dataclass
class CompileLog:
    """The compile warm-ups paid so far in this process: seconds and count (a stage reports them)."""

    seconds: float = 0.0
    count: int = 0
    shapes: list[tuple[int, int]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # compiles that failed: those shapes decode uncompiled


COMPILE_LOG = CompileLog()
# the model's static caches and compiled steps, kept on the model: they go with it (a compiled step refers to its
# model, so a table keyed by the model, even a weak one, would keep every model of a sweep alive)
_SLOTS_ATTR = "_rlhf_static_decode_slots"


def _static_cache(model: nn.Module, batch: int, length: int, device: torch.device) -> Cache:
    """transformers' StaticCache of `length` positions: its layers allocate on the first write (5.x); before 5.x it
    is allocated at once, for `batch` rows in the model's dtype."""
    config = model.config.get_text_config(decoder=True)
    if "max_batch_size" not in inspect.signature(StaticCache.__init__).parameters:
        return StaticCache(config=config, max_cache_len=length)
    dtype = next(model.parameters()).dtype
    return StaticCache(config=config, max_batch_size=batch, max_cache_len=length, device=device, dtype=dtype)


def bucketed_length(prompt_len: int, max_new_tokens: int) -> int:
    """The cache's length: prompt + responses rounded up to LENGTH_BUCKET."""
    return -(-(prompt_len + max_new_tokens) // LENGTH_BUCKET) * LENGTH_BUCKET


class CacheArgs(NamedTuple):
    """How this transformers' model forward takes the KV cache: the argument's name (`cache` since transformers 5.2x,
    where `past_key_values` is deprecated with a warning on every call), whether it keeps only the last position's
    logits (`logits_to_keep`) and whether it takes the cache's write position (`cache_position`, before 5.2x)."""

    name: str
    logits_to_keep: bool
    cache_position: bool


def cache_args(model: nn.Module) -> CacheArgs:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's forward takes **kwargs
    params = inspect.signature(base.forward).parameters
    return CacheArgs(
        "cache" if "cache" in params else "past_key_values", "logits_to_keep" in params, "cache_position" in params
    )


def _forward(
    model: nn.Module, args: CacheArgs, cache: Cache, ids: Tensor, mask: Tensor, pos: Tensor, start: Tensor
) -> Tensor:
    """One forward over the static cache, writing from position `start` (1,); the last position's logits in float32.
    Shape: ids (b, t) -> (b, v)."""
    extra = {"cache_position": start + torch.arange(ids.shape[1], device=ids.device)} if args.cache_position else {}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        use_cache=True,
        **{args.name: cache},
        logits_to_keep=1,
        **extra,
    )
    return out.logits[:, -1].float()


def _compiled_step(model: nn.Module, args: CacheArgs, cache: Cache, device: torch.device) -> Callable[..., Tensor]:
    """`_forward` for one token under torch.compile; a CUDA graph on a GPU ("reduce-overhead")."""
    mode = "reduce-overhead" if device.type == "cuda" else None

    def step(ids: Tensor, mask: Tensor, pos: Tensor, start: Tensor) -> Tensor:
        return _forward(model, args, cache, ids, mask, pos, start).clone()  # a CUDA graph reuses its output buffer

    return torch.compile(step, mode=mode, dynamic=False)


class StaticDecoder:
    """The forward calls of one sampling call over a static cache: `prefill()` on the prompts, then `step(ids)` per
    token. Shape: prompt_ids, prompt_mask (b, p) left-padded; the logits (b, v)."""

    def __init__(self, model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int, compiled: bool):
        b, p = prompt_ids.shape
        device = prompt_ids.device
        length = bucketed_length(p, max_new_tokens)
        autocast = torch.is_autocast_enabled(device.type)
        key = (b, length, device, autocast, torch.get_autocast_dtype(device.type) if autocast else None, compiled)
        slots = model.__dict__.setdefault(_SLOTS_ATTR, {})
        if key not in slots:
            slots[key] = _Slot(_static_cache(model, b, length, device), cache_args(model))
        self.slot = slots[key]
        self.slot.cache.reset()  # zeroed in place: a compiled step keeps the tensors' addresses
        self.model, self.compiled, self.prompt_len, self.shape = model, compiled, p, (b, length)
        # the whole length's mask: the prompt's padding, ones for every response position (the causal mask hides
        # positions not yet written); fixed shape for every step
        self.mask = torch.ones(b, length, dtype=prompt_mask.dtype, device=device)
        self.mask[:, :p] = prompt_mask
        self.written = p

    def prefill(self, ids: Tensor, pos: Tensor) -> Tensor:
        """The logits after the prompts. Shape: ids, pos (b, p) -> (b, v)."""
        start = torch.zeros(1, dtype=torch.long, device=ids.device)
        return _forward(self.model, self.slot.args, self.slot.cache, ids, self.mask, pos, start)

    def step(self, ids: Tensor, pos: Tensor) -> Tensor:
        """The next token's logits. Shape: ids, pos (b, 1) -> (b, v)."""
        cache_pos = torch.tensor([self.written], device=ids.device)  # (1,) where its keys go, before transformers 5.2x
        self.written += 1
        slot = self.slot
        if not self.compiled:
            return _forward(self.model, slot.args, slot.cache, ids, self.mask, pos, cache_pos)
        if slot.step is None:
            return self._compile_and_step(ids, pos, cache_pos)
        return slot.step(ids, self.mask, pos, cache_pos)

    def _compile_and_step(self, ids: Tensor, pos: Tensor, cache_pos: Tensor) -> Tensor:
        """The first compiled step: compiles (timed into COMPILE_LOG). Where torch.compile cannot (no compiler, no
        triton), a warning, and this shape decodes over the static cache uncompiled: the same tokens."""
        slot = self.slot
        t0 = time.perf_counter()
        try:
            slot.step = _compiled_step(self.model, slot.args, slot.cache, ids.device)
            logits = slot.step(ids, self.mask, pos, cache_pos)  # the first call compiles
        except Exception as err:  # torch.compile's failures have no common type (backend, codegen, toolchain)
            COMPILE_LOG.failures.append(why := f"{type(err).__name__}: {str(err)[:200]}")
            logger.warning("torch.compile of the decoding step failed (%s): decoding uncompiled", why)
            slot.step = partial(_forward, self.model, slot.args, slot.cache)
            return slot.step(ids, self.mask, pos, cache_pos)
        slot.compile_seconds = time.perf_counter() - t0
        COMPILE_LOG.seconds += slot.compile_seconds
        COMPILE_LOG.count += 1
        COMPILE_LOG.shapes.append(self.shape)
        return logits
