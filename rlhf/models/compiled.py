"""The trained models' training forwards under torch.compile (`runtime.compile_training`): the backbone (the
transformer without its LM or score head) of the PPO policy and value model, compiled once per model and used where
gradients are recorded; no-grad forwards (scoring, reference, evaluation) and generation stay eager.

Compiling fuses the element-wise work around the matmuls (GELU, norms, residual adds, masks) and removes most of
the per-op dispatch, which dominates small models on a CPU (docs/benchmark.md "Compiled training forwards"). It costs
one compile, on the first micro-batch: the inputs' rows and length are marked dynamic, so micro-batches of other
widths reuse it. Where the first compile fails (no C++ compiler on a CPU, no triton on a GPU, an
operator inductor cannot lower) the model trains eager, with a warning, and `COMPILE_FAILURES` says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

# the model's compiled backbone, kept in its __dict__ (not a submodule: the state dict and `save_pretrained` do not
# see it, and it goes with the model)
_ATTR = "_rlhf_training_backbone"


@dataclass
class CompileFailures:
    """The training compiles that failed in this process, one line each: those models train eager."""

    reasons: list[str] = field(default_factory=list)


COMPILE_FAILURES = CompileFailures()


class _TrainingBackbone:
    """A model's backbone under torch.compile, its inputs' rows and length marked dynamic (one compile serves every
    micro-batch shape); the eager backbone for good where the first call, which compiles, fails."""

    def __init__(self, backbone: nn.Module, backend: str | Callable) -> None:
        self.eager = backbone
        self.compiled: Callable | None = torch.compile(backbone, backend=backend)
        self.compiled_once = False

    def __call__(self, **inputs):
        if self.compiled is None:
            return self.eager(**inputs)
        for value in inputs.values():  # rows and length vary (micro-batches drop their all-padding columns)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(value, 0)
                torch._dynamo.maybe_mark_dynamic(value, 1)
        if self.compiled_once:
            return self.compiled(**inputs)
        try:
            out = self.compiled(**inputs)
        except Exception as err:  # torch.compile's failures have no common type (backend, codegen, toolchain)
            COMPILE_FAILURES.reasons.append(why := f"{type(err).__name__}: {str(err)[:200]}")
            name = type(self.eager).__name__
            logger.warning("torch.compile of %s's training forward failed (%s): it trains eager", name, why)
            self.compiled = None
            return self.eager(**inputs)
        self.compiled_once = True
        return out


def compile_for_training(model: nn.Module, backend: str | Callable = "inductor") -> None:
    """Compile `model`'s backbone (``getattr(model, model.base_model_prefix)``) for its training forwards
    (`training_backbone`); `backend`: torch.compile's (inductor by default)."""
    backbone = getattr(model, model.base_model_prefix)
    model.__dict__[_ATTR] = _TrainingBackbone(backbone, backend)


def training_backbone(model: nn.Module) -> Callable:
    """The backbone a forward of `model` runs: the compiled one where `compile_for_training` set one and gradients
    are recorded, else the model's own."""
    compiled = model.__dict__.get(_ATTR)
    if compiled is not None and torch.is_grad_enabled():
        return compiled
    return getattr(model, model.base_model_prefix)


def is_compiled_for_training(model: nn.Module) -> bool:
    """Whether `compile_for_training` compiled `model`'s backbone (its training forwards may then run compiled)."""
    return model.__dict__.get(_ATTR) is not None
