"""PPO with sharded models (``runtime.sharding: fsdp``): sharding the four models, the resume state in
torch.distributed.checkpoint (DCP) format, and the whole weights for the final models.

The resume state is one folder, written in one rename like every trainer's (`rlhf.checkpoints.atomic_dir`):
``shards/`` is a DCP checkpoint of the policy and value weights and their AdamW states (each rank writes its own
shards, in parallel), ``trainer_state.pt`` (rank 0) the rest: step, schedulers, KL controller, RNGs. DCP can load
it on another number of processes, but the PPO state also holds each rank's sampling generator, so a resume
needs the same number (`rlhf.ppo.state.load_state` says so). The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rlhf.checkpoints import TRAINER_STATE_FILE, atomic_dir
from rlhf.models import sharding
from rlhf.ppo import distributed
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.models import PPOModels

SHARDS = "shards"
logger = logging.getLogger(__name__)


def shard_models(models: PPOModels, dist: DistContext) -> dict[str, tuple[int, int]]:
    """Shard policy, value, reference and reward over the ranks (`rlhf.models.sharding.shard_model`); returns each
    model's parameter bytes on this rank before and after."""
    sizes: dict[str, tuple[int, int]] = {}
    for name in ("policy", "value", "reference", "reward"):
        model = getattr(models, name)
        if model is None:
            continue
        before = sharding.parameter_bytes(model)
        sharding.shard_model(model, dist.device, dist.world_size)
        sizes[name] = (before, sharding.parameter_bytes(model))
    if dist.is_main:
        shown = ", ".join(f"{k} {a / 2**20:.1f} -> {b / 2**20:.1f} MiB" for k, (a, b) in sizes.items())
        logger.info("FSDP over %d processes: parameters per process %s", dist.world_size, shown)
    return sizes


def _trained(models: PPOModels, policy_opt, value_opt) -> list[tuple[str, Any, Any]]:
    """(name, model, optimizer) of the trained models: the policy, and the value model where there is one."""
    trained = [("policy", models.policy, policy_opt)]
    if models.value is not None:
        trained.append(("value", models.value, value_opt))
    return trained


def _state_dicts(models: PPOModels, policy_opt: torch.optim.Optimizer, value_opt: torch.optim.Optimizer | None) -> dict:
    """The sharded weights and optimizer states of the trained models (this rank's shards, as DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    for name, model, optimizer in _trained(models, policy_opt, value_opt):
        weights, optim = get_state_dict(model, optimizer)
        out[name] = {"model": weights, "optim": optim}
    return out


def save_sharded_state(
    folder: Path, models: PPOModels, policy_opt, value_opt, fields: dict[str, Any], dist: DistContext
) -> None:
    """Every rank calls this (it is a collective): the shards into ``folder/shards`` through DCP, `fields` into
    ``trainer_state.pt`` by rank 0, all in a temporary folder that rank 0 renames into place once complete."""
    import torch.distributed.checkpoint as dcp

    tensors = _state_dicts(models, policy_opt, value_opt)

    def write(tmp: Path | None) -> None:
        path = Path(distributed.broadcast_object(str(tmp) if tmp is not None else None))
        dcp.save(tensors, checkpoint_id=path / SHARDS)
        distributed.barrier()  # every rank's shards are written before the state is declared complete
        if dist.is_main:
            torch.save({**fields, "sharding": "fsdp"}, path / TRAINER_STATE_FILE)

    if dist.is_main:
        with atomic_dir(folder) as tmp:
            write(tmp)
    else:
        write(None)
    distributed.barrier()  # the folder is in place before any rank goes on (or stops)


def load_sharded_weights(folder: Path, models: PPOModels, policy_opt, value_opt) -> None:
    """Every rank reads its shards of the weights and optimizer states from ``folder/shards``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    tensors = _state_dicts(models, policy_opt, value_opt)
    dcp.load(tensors, checkpoint_id=folder / SHARDS)
    for name, model, optimizer in _trained(models, policy_opt, value_opt):
        set_state_dict(
            model, optimizer, model_state_dict=tensors[name]["model"], optim_state_dict=tensors[name]["optim"]
        )


def full_weights(models: PPOModels) -> dict[str, dict[str, torch.Tensor]]:
    """The whole policy and value state dicts on rank 0 (empty on the others): a collective every rank calls."""
    weights = {"policy": sharding.full_state_dict(models.policy)}
    if models.value is not None:
        weights["value"] = sharding.full_state_dict(models.value)
    return weights
