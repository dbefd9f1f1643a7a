"""Data-parallel PPO across processes: the process group, gradient averaging and cross-rank statistics.

A run started by ``torchrun`` or ``accelerate launch`` has RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT in its environment; :func:`init_distributed` turns them into a :class:`DistContext` and initialises
``torch.distributed`` (NCCL on CUDA, gloo on CPU). Without them (WORLD_SIZE unset or 1) nothing is initialised
and every helper here is a no-op, so the single-process path is exactly what it was.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf.config import PPOConfig, RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.models import sharding
from rlhf.models.device import resolve_device
from rlhf.ops import masked_mean, masked_var


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the run: its rank among `world_size` processes and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # rank on this node: picks the GPU
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, writes rollout records, the trainer state and the final models."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"the environment variable {name} must be an integer, not '{value}'") from None


def _device(runtime: RuntimeConfig, local_rank: int) -> torch.device:
    """CUDA devices are one per process, picked by the local rank ('cuda:N' in the config is overridden)."""
    device = resolve_device(runtime.device)
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {local_rank} but this node has {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", local_rank)


def world_size_from_env() -> int:
    """The number of processes the launcher started (WORLD_SIZE; 1 without a launcher)."""
    return _env_int("WORLD_SIZE", 1)


def init_distributed(runtime: RuntimeConfig) -> DistContext:
    """The context of this process; initialises the process group only when WORLD_SIZE > 1."""
    world_size = world_size_from_env()
    if world_size <= 1:
        return DistContext(device=resolve_device(runtime.device))
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    device = _device(runtime, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives and *_object helpers use the current device
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def close_distributed() -> None:
    """Tear down the process group (end of a launched run); a no-op when none was initialised. Every rank waits for
    the others first: a rank that tore its gloo group down while rank 0 was still saving the gathered models once
    died with SIGABRT ("terminate called without an active exception") on the 2-core CI machine."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    """Where small helper tensors live: the current GPU with NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_world_size(cfg: PPOConfig, world_size: int) -> None:
    """The global rollout batch and minibatch must split evenly into per-process shards, and each shard hold whole
    groups of ppo.samples_per_prompt samples (a group's baseline is computed on one process)."""
    if world_size <= 1:
        return
    if cfg.batch_size % (world_size * cfg.samples_per_prompt):
        raise ConfigError(
            f"ppo.batch_size ({cfg.batch_size}) must be divisible by the number of processes ({world_size}) times "
            f"ppo.samples_per_prompt ({cfg.samples_per_prompt}): each process takes whole groups of samples"
        )
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"ppo.batch_size ({cfg.batch_size}) must be divisible by the number of processes ({world_size})"
        )
    if cfg.mini_batch_size % world_size:
        raise ConfigError(
            f"the minibatch size (ppo.batch_size / ppo.num_mini_batches = {cfg.mini_batch_size}) must be divisible "
            f"by the number of processes ({world_size})"
        )
    local = cfg.mini_batch_size // world_size
    if local % cfg.gradient_accumulation_steps:
        raise ConfigError(
            f"ppo.gradient_accumulation_steps ({cfg.gradient_accumulation_steps}) must divide the per-process "
            f"minibatch size ({local} = {cfg.mini_batch_size} / {world_size} processes)"
        )


def check_sharding(cfg: PPOConfig, runtime: RuntimeConfig, world_size: int) -> None:
    """runtime.sharding 'fsdp' needs several processes and none of the options that work on whole models."""
    if runtime.sharding != "fsdp":
        return
    refused = {
        "ppo.lora.enabled": cfg.lora.enabled,  # the reference is the policy without adapters: not sharded here
        "ppo.value_model=policy_head": cfg.value_model == "policy_head",  # a head on the sharded policy's trunk
        "ppo.generation.backend=vllm": cfg.generation.backend == "vllm",  # vLLM takes whole weights
        "ppo.eval_every > 0": cfg.eval_every > 0,  # rank 0 alone evaluates; sharded forwards need every rank
        "runtime.compile_training": runtime.compile_training,  # compiled per process, not across FSDP's collectives
    }
    for key, on in refused.items():
        if on:
            raise ConfigError(f"runtime.sharding 'fsdp' does not work with {key}; use runtime.sharding=none")
    if world_size < 2:
        raise ConfigError(
            "runtime.sharding 'fsdp' needs several processes: set runtime.ppo_processes > 1 or launch the PPO stage "
            f"under torchrun (this run has {world_size})"
        )


def all_reduce_mean(tensor: Tensor) -> Tensor:
    """Mean of `tensor` over ranks, in place; returned for chaining."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def masked_mean_var(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased variance of the real entries of `x` over every rank's shard: the count, sum and sum of
    squares are all-reduced (in float64). In one process: those of `x` (``masked_mean``, ``masked_var``).

    Shape: x and mask (b, t), b may differ between ranks; outputs () in x's dtype and device.
    """
    if not _active():
        return masked_mean(x, mask), masked_var(x, mask, unbiased=True)
    m = mask.to(torch.float64)
    xm = x.detach().to(torch.float64) * m
    totals = torch.stack([m.sum(), xm.sum(), (xm * xm).sum()]).to(_comm_device())
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    n, total, squares = totals.tolist()
    if n <= 0:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return zero, zero.clone()
    mean = total / n
    var = max(squares / n - mean * mean, 0.0)  # biased; Bessel's correction when there are 2+ entries
    if n > 1:
        var *= n / (n - 1)
    return torch.tensor(mean, dtype=x.dtype, device=x.device), torch.tensor(var, dtype=x.dtype, device=x.device)


def average_gradients(params: Iterable[nn.Parameter]) -> None:
    """Replace every ``.grad`` by its mean over ranks: one all-reduce per dtype over a flattened buffer.

    Parameters without a gradient are skipped; every rank runs the same code, so the same ones are skipped.
    """
    if not _active():
        return
    world_size = dist.get_world_size()
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():
        flat = torch.cat([g.reshape(-1) for g in grads])  # one buffer: a single collective per group
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Copy `src`'s parameters and buffers to every rank (they start equal anyway; this makes it certain)."""
    if not _active():
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=src)


def _reduce_op(key: str) -> str:
    if key.endswith("_min"):
        return "min"
    if key.endswith("_max") or key.startswith("memory/"):
        return "max"
    return "mean"


def reduce_stats(stats: dict[str, float]) -> dict[str, float]:
    """Statistics over all ranks: the mean of the per-rank values, min/max for `*_min` / `*_max` keys and peak
    memory. Every rank must pass the same keys. The mean is exact for per-episode means (equal shards), an
    approximation for token-weighted means, standard deviations and percentiles."""
    if not _active():
        return stats
    keys = sorted(stats)
    out: dict[str, float] = {}
    device = _comm_device()
    for op_name, op in (("mean", dist.ReduceOp.SUM), ("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        group = [k for k in keys if _reduce_op(k) == op_name]
        if not group:
            continue
        values = torch.tensor([float(stats[k]) for k in group], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op)
        if op_name == "mean":
            values /= dist.get_world_size()
        out.update(zip(group, values.tolist(), strict=True))
    return {k: out[k] for k in stats}


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (picklable objects); ``[obj]`` in a single process."""
    if not _active():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`src`'s `obj` on every rank (picklable objects)."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank."""
    if _active():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def parameter_digest(*modules: nn.Module | None) -> str:
    """sha256 over the names and bytes of the modules' state dicts: equal on every rank while they stay in sync."""
    h = hashlib.sha256()
    for module in modules:
        if module is None:  # no value model
            continue
        for name, tensor in sorted(module.state_dict().items()):
            h.update(name.encode())
            tensor = sharding.full(tensor)  # a sharded model's whole parameter: every rank hashes the same bytes
            h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
