"""Whether a PPO update's work runs in two CPU threads, each op single-threaded: the policy beside the value model
(`use_second_thread`), or, without a value model, two halves of each micro-batch (`split_policy_work`). Small
models' matmuls do not keep several cores busy on their own; two streams of work do (docs/benchmark.md)."""

from __future__ import annotations

import torch

from rlhf.models import sharding
from rlhf.models.compiled import is_compiled_for_training
from rlhf.models.device import autocast_dtype
from rlhf.models.training import unwrap
from rlhf.ppo.models import PPOModels


def matmul_weights(model: torch.nn.Module) -> int:
    """Entries of a model's matrix-multiply weights (linear and GPT-2 Conv1D layers, LM head included; not the
    embeddings, which are looked up): what one token's forward and backward cost, up to a factor."""
    return sum(
        module.weight.numel()
        for module in unwrap(model).modules()
        if not isinstance(module, torch.nn.Embedding)
        and getattr(module, "weight", None) is not None
        and module.weight.dim() == 2
    )


# the policy's per-token work (its LM head included) may be at most this multiple of the value model's for the two
# to share the cores as two single-threaded threads; past it the policy's thread would leave the other core idle
_BALANCED_THREADS = 2.0


def use_second_thread(device: torch.device, models: PPOModels, world_size: int = 1, scoring: bool = False) -> bool:
    """Whether the policy's and the value model's work (scoring and optimisation) run in two CPU threads, each op
    single-threaded (`rlhf.models.device.torch_threads`), rather than one after the other with every torch thread
    on each op. Small models' matmuls do not keep several cores busy on their own, so two models side by side do
    better; not where the policy's LM head makes its side much heavier than the value model's (a large vocabulary
    on a small model: the value thread would wait idle), and not with several processes: they already share the
    cores (docs/benchmark.md). Without a value model (a critic-free estimator) the optimisation phase has one side;
    the scoring phase (`scoring`) then weighs the reward model against the policy instead."""
    other = models.value if models.value is not None else (models.reward if scoring else None)
    return (
        other is not None
        and device.type == "cpu"
        and not models.shared_value_head
        and torch.get_num_threads() > 1
        and world_size == 1
        and matmul_weights(models.policy) <= _BALANCED_THREADS * matmul_weights(other)
    )


def split_policy_work(
    device: torch.device, models: PPOModels, world_size: int = 1, dtype: torch.dtype = torch.float32
) -> bool:
    """Whether a critic-free run's micro-batches run as two halves in two CPU threads (`_policy_halves`), each op
    single-threaded: with no value model to run beside the policy, one small model's float32 matmuls would leave a
    core idle (docs/benchmark.md). Only in float32 (`dtype`) on a CPU whose torch kernels use AVX-512, where they
    measured faster on a 2-core AMD EPYC (and slower on a 2-core Intel Xeon: 9% longer updates on the `cpu` shape,
    13 of 16 paired updates, `benchmarks.paired_bench`); one micro-batch with every op on both threads
    measured faster under bf16 autocast (the optimisation's median 16% shorter on the `cpu` bench shape, 7 of 7
    alternating pairs), with torch held to AVX2 (11%, 5 of 5) and on an AVX2 CPU (a Zen 3 EPYC: the update 4% shorter
    whole, 7 of 10 pairs). Not with several processes (they share the cores), a sharded policy or a policy compiled
    for training (runtime.compile_training: one compiled module is not called from two threads at once)."""
    return (
        models.value is None
        and device.type == "cpu"
        and autocast_dtype(device, dtype) == torch.float32
        and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        and torch.get_num_threads() > 1
        and world_size == 1
        and not sharding.is_sharded(unwrap(models.policy))
        and not is_compiled_for_training(unwrap(models.policy))
    )
