"""The timed PPO updates of `rlhf bench` and the FLOP count of one more (untimed) update.

The only module of `benchmarks` that imports the PPO internals: the update steps are the trainer's own.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from rlhf.config import PPOConfig
from rlhf.memory import peak_memory_mb
from rlhf.models.cpu_kernels import use_cpu_kernels
from rlhf.models.device import autocast, autocast_dtype, torch_threads
from rlhf.models.reference import match_autocast
from rlhf.models.training import disable_dropout, enable_gradient_checkpointing, unwrap
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.models import PPOModels, compile_trained_models
from rlhf.ppo.optimise import optimize
from rlhf.ppo.plan import ExecutionPlan
from rlhf.ppo.prompts import PromptBatch
from rlhf.ppo.state import TrainerState, fresh_state
from rlhf.ppo.update import compute_advantages, first_epoch_order, generate_and_score, refresh_kl
from rlhf.rollout.generation import GenerationSettings, sample_responses
from rlhf.rollout.static_decode import resolve_decode

from .limit import count_flops, synchronize
from .shapes import BenchShape, model_classes, model_config

PHASES = ("time/generate", "time/score", "time/advantages", "time/optimize")
# responses a prompt with a critic-free group estimator (`--estimator grpo`): a batch of the shape's batch_size
# episodes holds batch_size / SAMPLES_PER_PROMPT prompts (docs/benchmark.md)
SAMPLES_PER_PROMPT = 4


def build_models(
    shape: BenchShape, device: torch.device, dtype: torch.dtype, seed: int = 0, critic: bool = True
) -> PPOModels:
    """Random-init policy and its frozen reference copy, and separate value (with `critic`) and frozen reward
    models (`*ForSequenceClassification` of the same shape). As in the trainer, the trained models keep float32
    weights, the reward model is cast to the compute dtype and the reference holds in it what autocast multiplies
    (`rlhf.models.reference.match_autocast`: it computes what the policy computes)."""
    torch.manual_seed(seed)
    config = model_config(shape)
    lm_class, scalar_class = model_classes(shape)
    with torch.device(device):  # initialise in place (a 1B model's init on the CPU takes a while)
        policy, value, reward = lm_class(config), scalar_class(config), scalar_class(config)
    value = value if critic else None
    reference = match_autocast(copy.deepcopy(policy), autocast_dtype(device, dtype)).requires_grad_(False)
    reward = reward.to(dtype).requires_grad_(False)
    for model in (policy, reference, value, reward):
        if model is None:
            continue
        disable_dropout(model)
        use_cpu_kernels(model)
        model.eval()
    if shape.gradient_checkpointing:
        enable_gradient_checkpointing(policy)
        if value is not None:
            enable_gradient_checkpointing(value)
    return PPOModels(
        policy, reference, value, reward, tokenizer=None, reward_tokenizer=None, stop_token_ids=(), same_tokenizer=True
    )


def ppo_config(shape: BenchShape, updates: int, estimator: str = "gae") -> PPOConfig:
    return PPOConfig(
        advantage_estimator=estimator,
        samples_per_prompt=1 if estimator == "gae" else SAMPLES_PER_PROMPT,
        total_episodes=shape.batch_size * updates,
        batch_size=shape.batch_size,
        num_mini_batches=shape.num_mini_batches,
        num_ppo_epochs=shape.num_ppo_epochs,
        max_new_tokens=shape.response_len,
        temperature=1.0,
        missing_eos_penalty=None,
        lr_schedule="constant",
        record_rollouts=False,
        gradient_checkpointing=shape.gradient_checkpointing,
        # every epoch of every update trains the policy, as the peer's do: no critic warmup, no early stop
        critic_warmup=0,
        target_kl=0,
    )


@dataclass
class Bench:
    """Models, optimizer state and settings of one benchmark run; `update()` runs one PPO update."""

    shape: BenchShape
    device: torch.device
    dtype: torch.dtype
    updates: int
    seed: int = 0
    estimator: str = "gae"  # ppo.advantage_estimator
    decode: str = "auto"  # ppo.generation.decode: auto is compiled on CUDA, dynamic on a CPU
    # ExecutionPlan's CPU threading fields (second_thread, split_policy, scoring_second_thread) forced to a value
    # instead of the trainer's choice (`benchmarks.paired_bench`)
    threading: dict[str, bool] = field(default_factory=dict)
    compile_training: bool = False  # runtime.compile_training: the training forwards under torch.compile
    models: PPOModels = field(init=False)
    cfg: PPOConfig = field(init=False)
    state: TrainerState = field(init=False)

    def __post_init__(self) -> None:
        self.cfg = ppo_config(self.shape, self.updates + 1, self.estimator)
        self.models = build_models(self.shape, self.device, self.dtype, self.seed, critic=not self.cfg.critic_free)
        if self.compile_training:
            compile_trained_models(self.models.policy, self.models.value)
        self.state = fresh_state(self.models, self.cfg, self.seed, self.device)
        # no stop tokens: every response has exactly response_len tokens (docs/benchmark.md)
        decode = resolve_decode(self.decode, self.device)
        self.settings = GenerationSettings(self.shape.response_len, 1.0, pad_token_id=0, decode=decode)
        self.data = torch.Generator().manual_seed(self.seed)

    def plan(self) -> ExecutionPlan:
        """How the optimisation executes: one process on `device` in `dtype`, the run's CPU threading (`threading`
        where set)."""
        plan = ExecutionPlan.for_models(self.models, self.dtype, DistContext(device=self.device))
        return replace(plan, **self.threading)

    def query(self) -> tuple[Tensor, Tensor]:
        s, group = self.shape, self.cfg.samples_per_prompt
        prompts = torch.randint(1, s.vocab_size, (s.batch_size // group, s.prompt_len), generator=self.data)
        query = prompts.repeat_interleave(group, dim=0).to(self.device)  # whole groups of one prompt, in a row
        return query, torch.ones_like(query)

    def update(self) -> dict[str, float]:
        """One timed update: generate and score, advantages, PPO epochs; the per-phase times and the total."""
        synchronize(self.device)
        t0 = time.perf_counter()
        query, mask = self.query()
        batch, plan = PromptBatch(query, mask, list(range(len(query)))), self.plan()
        first_order = first_epoch_order(self.cfg, self.state.shuffle_generator, len(query))  # as the trainer does
        rollout = generate_and_score(
            self.models, batch, None, self.cfg, self.settings, self.state.sample_generator, plan, first_order
        )
        compute_advantages(rollout, self.cfg, self.state.kl_ctl.value)
        result = optimize(self.models, self.state, rollout, self.cfg, plan)
        refresh_kl(rollout, self.cfg)
        synchronize(self.device)
        total = time.perf_counter() - t0
        timings = {**rollout.scored.timings, "time/optimize": result.stats["time/optimize"], "time/total": total}
        timings["episodes/s"] = self.shape.batch_size / total
        return timings

    def count_phase_flops(self) -> dict[str, int]:
        """The FLOPs of each phase of one update (not a timed one). Run with one torch thread so that the CPU's
        concurrent value-model thread stays in this one, where the (thread-local) counter sees it. Generation is
        counted alone (the same sampling call on the same prompts), scoring as the rest of `generate_and_score`."""
        settings = replace(self.settings, decode="dynamic")  # a compiled step would hide its ops from the counter
        with torch_threads(1):
            query, mask = self.query()
            sampler = torch.Generator(device=self.device).manual_seed(self.seed)
            with autocast(self.device, self.dtype):
                _, gen = count_flops(sample_responses, unwrap(self.models.policy), query, mask, settings, sampler)
            plan, batch = self.plan(), PromptBatch(query, mask, list(range(len(query))))  # one thread: no second
            first_order = first_epoch_order(self.cfg, self.state.shuffle_generator, len(query))
            rollout, gen_and_score = count_flops(
                generate_and_score, self.models, batch, None, self.cfg, settings, self.state.sample_generator, plan,
                first_order,
            )  # fmt: skip
            _, adv = count_flops(compute_advantages, rollout, self.cfg, self.state.kl_ctl.value)
            _, opt = count_flops(optimize, self.models, self.state, rollout, self.cfg, plan)
        return {"time/generate": gen, "time/score": gen_and_score - gen, "time/advantages": adv, "time/optimize": opt}


def summarize(per_update: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the updates after the first (the first pays for warm-up)."""
    steady = per_update[1:] if len(per_update) > 1 else per_update
    return {k: statistics.median(u[k] for u in steady) for k in (*PHASES, "time/total", "episodes/s")}


def run_bench(bench: Bench, log=print) -> dict[str, float]:
    """`bench.updates` timed updates; their medians and the peak memory."""
    per_update = []
    for i in range(bench.updates):
        timings = bench.update()
        per_update.append(timings)
        phases = " ".join(f"{k.split('/')[1]}={timings[k]:.3f}s" for k in PHASES)
        dtype = str(bench.dtype).removeprefix("torch.")
        log(f"update {i + 1}/{bench.updates} ({dtype}): {timings['episodes/s']:.2f} episodes/s {phases}")
    summary = summarize(per_update)
    summary["memory/peak_mb"] = peak_memory_mb(bench.device)
    return summary
