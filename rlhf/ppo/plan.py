"""How the policy stage executes, decided once per process: one object in place of loose flags.

`ExecutionPlan` holds the process group (device, rank, processes), the compute dtype, whether the models are sharded
(FSDP), what a non-finite statistic does and where its report goes, and the CPU-threading decisions that depend on
the models (`rlhf.ppo.threads`). `rlhf.ppo.trainer.train_ppo` builds it once after loading the models; the rollout
(`rlhf.ppo.update.generate_and_score`), the periodic evaluation, the optimisation (`rlhf.ppo.optimise`) and the
saving of the final models read it instead of taking each flag as a parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf.config import PPOConfig
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.models import PPOModels
from rlhf.ppo.threads import split_policy_work, use_second_thread
from rlhf.tracking.metrics_writer import LogFn


@dataclass(frozen=True)
class ExecutionPlan:
    dist: DistContext  # the processes of a data-parallel run (one by default) and this one's device
    dtype: torch.dtype = torch.float32  # autocast dtype on CUDA (runtime.dtype's compute dtype); float32: off
    on_nonfinite: str = "stop"  # runtime.on_nonfinite: 'stop' raises NonFiniteError, 'skip_update' skips the step
    log: LogFn | None = None  # where a non-finite step's statistics are reported (rank 0 only)
    second_thread: bool = False  # the value model's side beside the policy's in a second CPU thread
    split_policy: bool = False  # a critic-free micro-batch as two halves in two CPU threads
    scoring_second_thread: bool = False  # the rollout's value and reward forwards beside the policy's
    sharded: bool = False  # runtime.sharding 'fsdp': every model sharded over the processes

    @classmethod
    def for_models(
        cls,
        models: PPOModels,
        dtype: torch.dtype = torch.float32,
        dist: DistContext | None = None,
        on_nonfinite: str = "stop",
        log: LogFn | None = None,
        sharded: bool = False,
    ) -> ExecutionPlan:
        """The plan of a run of `models` (default: one process on the policy's device), with the threading that
        `use_second_thread` and `split_policy_work` choose for them and the current torch thread count."""
        if dist is None:
            dist = DistContext(device=next(models.policy.parameters()).device)
        device, world_size = dist.device, dist.world_size
        return cls(
            dist,
            dtype,
            on_nonfinite,
            log if dist.is_main else None,
            use_second_thread(device, models, world_size),
            split_policy_work(device, models, world_size, dtype),
            use_second_thread(device, models, world_size, scoring=True),
            sharded,
        )

    @property
    def optimise_threads(self) -> int | None:
        """torch's threads during the optimisation: 1 where it runs in two CPU threads (`second_thread`,
        `split_policy`), each op single-threaded; None: torch's count as it is."""
        return 1 if self.second_thread or self.split_policy else None

    def micro_batches(self, rows: Tensor, cfg: PPOConfig) -> tuple[Tensor, ...]:
        """The micro-batches of the minibatch `rows` (this rank's): ppo.gradient_accumulation_steps of them."""
        return rows.split(cfg.mini_batch_size // self.world_size // cfg.gradient_accumulation_steps)

    def policy_parts(self, micro: Tensor, critic: bool) -> tuple[Tensor, ...]:
        """The rows of each policy forward of the micro-batch `micro`: two halves, forward and backward side by side
        in two CPU threads, where the plan splits a critic-free run's work (`split_policy`, `critic` False, more
        than one row: `rlhf.ppo.optimise._policy_halves`); else the whole micro-batch."""
        if self.split_policy and not critic and len(micro) > 1:
            return micro.tensor_split(2)
        return (micro,)

    @property
    def paired_scoring(self) -> bool:
        """Whether the rollout's no-grad policy forwards run two at a time in two CPU threads, as the optimisation's
        halves do: where the optimisation runs each op on one torch thread and no value or reward forward runs beside
        them at sampling."""
        return self.optimise_threads == 1 and not self.scoring_second_thread

    def rollout_groups(self, order: Tensor, cfg: PPOConfig, critic: bool) -> list[Tensor]:
        """The rows of each of the rollout's no-grad policy and reference forwards, given the first epoch's `order`
        of this rank's rows: the first minibatch's rows as the optimisation's first policy forwards take them (its
        micro-batches, their `policy_parts`), so that its old log-probs are those forwards' bit for bit; then the
        other rows together, in two halves where they run two at a time (`paired_scoring`)."""
        mini = cfg.mini_batch_size // self.world_size
        first = [part for micro in self.micro_batches(order[:mini], cfg) for part in self.policy_parts(micro, critic)]
        rest = order[mini:]
        if not len(rest):
            return first
        return first + list(rest.tensor_split(2) if self.paired_scoring and len(rest) > 1 else (rest,))

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def is_main(self) -> bool:
        return self.dist.is_main
