"""FSDP2 sharding of a transformers model across the processes of a run (``runtime.sharding: fsdp``).

`shard_model` applies torch's ``fully_shard`` to every transformer block and then to a :class:`ShardedRoot` around
the model: each rank keeps 1/W of every parameter (a dim-0 shard, a ``DTensor``), a block's full parameters are
all-gathered just before its forward (and backward) and freed after, and gradients are reduce-scattered, averaged
over the ranks, into the shards. The root holds what is outside the blocks (embeddings, final norm, LM or score
head, tied weights together).

The project's code calls a model's backbone and heads directly (``rlhf.models.heads``), not only its forward, so the
root is not the model itself: ``call(model, fn, *args)`` runs ``fn(model, *args)`` inside the root's forward, which
gathers the root's parameters for the whole call and reduce-scatters their gradients in backward. On a model that
is not sharded it is just ``fn(model, *args)``. Every rank must make the same calls in the same order (each forward
of a block is a collective).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from rlhf.errors import ConfigError

T = TypeVar("T")
_ROOT = "_rlhf_fsdp_root"  # the ShardedRoot of a sharded model, an attribute outside the module tree (no cycle)


class ShardedRoot(nn.Module):
    """The FSDP root around a model: its forward is ``fn(model, *args, **kwargs)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.model, *args, **kwargs)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the modules of its ``_no_split_modules`` classes (transformers' own list of
    what must not be split), outermost only; else the children of its largest ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    for module in model.modules():
        if type(module).__name__ in names and not any(module in b.modules() for b in blocks):
            blocks.append(module)
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ConfigError(f"runtime.sharding 'fsdp' found no transformer blocks in {type(model).__name__}")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def shard_model(model: nn.Module, device: torch.device, world_size: int, reshard_after_forward: bool = True) -> None:
    """Shard `model` in place over the `world_size` ranks of the initialised process group (a 1-D device mesh).

    `reshard_after_forward` False keeps each block's gathered parameters from its forward to its backward (less
    communication, more memory); frozen models have no backward and always free them after their forward.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    root = ShardedRoot(model)
    fully_shard(root, mesh=mesh)
    object.__setattr__(model, _ROOT, root)


def is_sharded(model: nn.Module | None) -> bool:
    return model is not None and _ROOT in model.__dict__


def call(model: nn.Module, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(model, *args, **kwargs)``, through the FSDP root when `model` is sharded (its parameters gathered)."""
    root = model.__dict__.get(_ROOT)
    return root(fn, *args, **kwargs) if root is not None else fn(model, *args, **kwargs)


def reshard(*models: nn.Module | None) -> None:
    """Free the gathered root parameters of sharded models after no-grad calls (a backward frees them itself)."""
    for model in models:
        if is_sharded(model):
            model.__dict__[_ROOT].reshard()


def local(tensor: Tensor) -> Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: Tensor) -> Tensor:
    """The whole of a (possibly sharded) tensor; a collective when it is sharded."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """``clip_grad_norm_`` over sharded or plain parameters; the norm of the whole gradient as a plain tensor."""
    return full(torch.nn.utils.clip_grad_norm_(list(params), max_norm))


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards when sharded)."""
    return sum(local(p).numel() * p.element_size() for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's whole state dict on the CPU of rank 0 ({} on the others); a collective when sharded. A tied
    weight is kept under its first name only (``lm_head.weight`` goes with GPT-2's embeddings), as
    ``save_pretrained`` writes it."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first
    return {k: v for k, v in weights.items() if k not in tied}
