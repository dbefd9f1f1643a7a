"""How much memory a run needs, estimated from the model's ``config.json`` before any weight is loaded; what a
stage measured; and the estimate printed. The preflight asks `plan_memory` (fit), and nothing else here.

Estimates (``estimates``): each stage holds for its whole run weights, gradients and AdamW states, plus the largest
transient of its phases (activations of a training micro-batch, the logits over the vocabulary, the KV cache of
generation), plus a fixed overhead (CUDA context and allocator slack on a GPU; the process's own resident memory on
CPU). Parameter counts are exact: the architecture is instantiated on torch's ``meta`` device, which allocates
nothing. The activation terms follow Korthikanti et al. (2022) for a decoder layer with fused attention (sdpa: no
stored attention matrix), in the autocast dtype; expect agreement within about 30%. Hand-written because
Accelerate's ``estimate-memory`` (1.x) counts weights and optimizer states only: no activations, logits or KV cache.

Stages and what they hold (P: causal-LM parameters, R: reward-model parameters, b: bytes of the runtime dtype):
- ``sft``: the trained model in fp32 (16 bytes/param: weights, grads, AdamW m and v), a batch of
  ``sft.max_length`` tokens with full-vocabulary logits;
- ``reward``: the same for the reward model, on chosen and rejected rows of ``reward.max_length``;
- ``ppo``: policy 16P (LoRA: fp32 base + 16 bytes per adapter parameter, no reference copy), reference P*b,
  reward model R*b, value model 16R (``policy_head``: one head); transient: the larger of generation (KV cache
  of the rollout batch, prefill logits of the last position) and the training pass (policy and value micro
  batch activations, response logits), and no-grad scoring of ``forward_batch_size`` rows;
- ``evaluate``: the SFT and PPO policies and the reward model in the runtime dtype, generation of a batch.

Fit (``fit``): `plan_memory` checks every stage against the device's free memory (``runtime.memory_check``) and,
when one does not fit, names the settings that would make it fit in one ConfigError sentence.

Measures (``usage``): free RAM or GPU memory, the process's resident set, and a stage's peak (logged as
``memory/<stage>_peak_mb`` beside the estimate).

Prints (``report``): ``rlhf memory --config X``, each stage's estimate against this machine's RAM or GPU sizes.
"""

from rlhf.memory.estimates import CPU_PROCESS_BASE, GIB, ModelShape, StageEstimate, dtype_bytes, estimate, shape_of
from rlhf.memory.fit import check_fits, plan_memory
from rlhf.memory.usage import peak_memory_mb, reset_peak_memory

__all__ = ["CPU_PROCESS_BASE", "GIB", "ModelShape", "StageEstimate", "check_fits", "dtype_bytes", "estimate"]
__all__ += ["peak_memory_mb", "plan_memory", "reset_peak_memory", "shape_of"]
