"""The estimate: each stage's bytes from the model's shape (counted on the meta device) and the config."""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from rlhf.config import PipelineConfig
from rlhf.models.model_config import config_value, model_positions
from rlhf.stages import REWARD, stages_of

GIB = 2**30
CUDA_OVERHEAD = 1.0 * GIB  # CUDA context, cuBLAS workspaces
ALLOCATOR_SLACK = 0.10  # fragmentation of the caching allocator
FIT_SHARE = 0.95  # an estimate above this share of the budget does not fit
# On a CPU the stage's process holds the interpreter, torch, transformers and the pipeline's modules before any
# model loads: 455 MiB resident measured on Linux (torch 2.13 CPU, transformers 5.2); the estimate takes the larger
# of this and the process's own resident set when it is made.
CPU_PROCESS_BASE = 0.5 * GIB


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of an architecture (read from its config, counted on the meta device)."""

    params: int  # causal LM
    reward_params: int  # the same trunk with a scalar head, without the LM head
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int  # key/value width per token per layer (kv heads x head dim)
    vocab: int
    positions: int | None
    linear_in_out: int  # sum of in + out features of the trunk's linear layers (LoRA params per unit of rank)
    lowered_params: int = 0  # causal-LM parameters the PPO reference holds in the compute dtype (the rest float32)


def shape_of(cfg: Any) -> ModelShape:
    """Count the parameters of `cfg`'s causal LM and reward model on the meta device (nothing is allocated)."""
    return _shape_of_json(cfg.to_json_string(use_diff=False), type(cfg))


@functools.lru_cache(maxsize=8)
def _shape_of_json(config_json: str, config_class: type) -> ModelShape:
    cfg = config_class.from_dict(json.loads(config_json))
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    reward_cfg = copy.deepcopy(cfg)
    reward_cfg.num_labels = 1
    if getattr(reward_cfg, "pad_token_id", None) is None or isinstance(reward_cfg.pad_token_id, list):
        reward_cfg.pad_token_id = 0
    # heavy: torch and transformers (the estimate of a config runs before they are imported, `rlhf memory` too)
    from rlhf.models.device import MODEL_BUILD_LOCK
    from rlhf.models.reference import autocast_lowered_parameters

    with MODEL_BUILD_LOCK, torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(cfg)
        rm = AutoModelForSequenceClassification.from_config(reward_cfg)
    head = lm.get_output_embeddings()
    in_out = sum(m.in_features + m.out_features for m in lm.modules() if isinstance(m, nn.Linear) and m is not head)
    hidden = int(config_value(text, "hidden_size", "n_embd", "d_model"))
    heads = int(config_value(text, "num_attention_heads", "n_head"))
    head_dim = int(config_value(text, "head_dim") or hidden // heads)
    kv_heads = int(config_value(text, "num_key_value_heads") or heads)
    return ModelShape(
        params=sum(p.numel() for p in lm.parameters()),
        reward_params=sum(p.numel() for p in rm.parameters()),
        layers=int(config_value(text, "num_hidden_layers", "n_layer")),
        hidden=hidden,
        intermediate=int(config_value(text, "intermediate_size", "ffn_dim", "n_inner") or 4 * hidden),
        kv_dim=kv_heads * head_dim,
        vocab=int(text.vocab_size),
        positions=model_positions(cfg),
        linear_in_out=in_out,
        lowered_params=sum(p.numel() for p in autocast_lowered_parameters(lm).values()),
    )


def dtype_bytes(dtype: str, device_type: str, width: int | None = None) -> int:
    """Bytes per element of the runtime dtype ('auto': bf16 on CUDA; on a CPU what it resolves to on this machine for
    a model of width `width`, rlhf/models/cpu_bf16.py; fp32 elsewhere)."""
    if dtype == "auto" and device_type == "cpu":
        from rlhf.models.device import resolved_dtype_name  # heavy: torch (the CPU's cached bf16 check)

        dtype = resolved_dtype_name(dtype, device_type, width)
    if dtype == "auto":
        return 2 if device_type == "cuda" else 4
    return 4 if dtype == "float32" else 2


class StageEstimate(NamedTuple):
    stage: str
    persistent: float  # bytes held for the whole stage: weights, gradients, optimizer states
    transient: float  # bytes of the largest phase: activations, logits, KV cache
    overhead: float

    @property
    def total(self) -> float:
        return self.persistent + self.transient + self.overhead


def _layer_activations(
    shape: ModelShape, tokens: float, act_bytes: int, checkpointing: bool, cpu: bool = False
) -> float:
    """Bytes stored for backward by the decoder layers for `tokens` tokens (sdpa: no attention matrix).

    `cpu`: every tensor autograd keeps in a float32 CPU layer, counted on Llama's: the input, the normalised and
    the weighted input of both norms, RoPE's query, attention's output and its re-laid-out copy (9 hidden-wide),
    key and value (2 kv-wide), and the MLP's gate, its activation, up and their product (4 intermediate-wide); the
    GPU count (Korthikanti et al. 2022) stays as it was."""
    if cpu:
        per_token_layer = (9 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate) * act_bytes
    else:
        per_token_layer = (8 * shape.hidden + 2 * shape.kv_dim + 3 * shape.intermediate) * act_bytes
    if checkpointing:  # only each layer's input is kept, plus one layer recomputed at a time
        return tokens * (shape.layers * shape.hidden * act_bytes + per_token_layer)
    return tokens * shape.layers * per_token_layer


def _logits(shape: ModelShape, tokens: float, act_bytes: int, grad: bool) -> float:
    """Logits over the vocabulary: the autocast output, its fp32 log-softmax and, with grad, their gradients."""
    return tokens * shape.vocab * (act_bytes + 4 + (4 + act_bytes if grad else 0))


def _trained(params: float) -> float:
    return 16.0 * params  # fp32 weights, fp32 gradients, AdamW exp_avg and exp_avg_sq


def estimate(config: PipelineConfig, shape: ModelShape, device_type: str, base_rss: float = 0.0) -> list[StageEstimate]:
    """Per-stage estimates of `config` on a device of `device_type` ('cuda' or 'cpu')."""
    rt, ppo, sft, rw, ev = config.runtime, config.ppo, config.sft, config.reward, config.eval
    frozen_b = dtype_bytes(rt.dtype, device_type, rt.model_width)
    act_b = frozen_b  # autocast compute dtype
    cpu = device_type == "cpu"
    overhead = (CUDA_OVERHEAD if device_type == "cuda" else max(base_rss, CPU_PROCESS_BASE)) if device_type else 0.0
    out: list[StageEstimate] = []

    def stage(name: str, persistent: float, transient: float) -> None:
        slack = ALLOCATOR_SLACK * (persistent + transient) if device_type == "cuda" else 0.0
        out.append(StageEstimate(name, persistent, transient, overhead + slack))

    # SFT: bootstrap or fine-tune of the causal LM
    if sft.model is None or sft.finetune:
        length = sft.bootstrap.n_positions if sft.model is None else min(sft.max_length, shape.positions or 1 << 30)
        tokens = sft.batch_size * length
        act = _layer_activations(shape, tokens, act_b, sft.gradient_checkpointing, cpu)
        stage("sft", _trained(shape.params), act + _logits(shape, tokens, act_b, True))
    # warm start (warm_start.enabled): the KV cache of its samples (batch_size prompts, each `samples` times), then the
    # SFT trainer on the kept responses at warm_start.batch_size (its float32 weights and AdamW states bound the first)
    if config.warm_start.enabled:
        warm = config.warm_start
        length = sft.bootstrap.n_positions if sft.model is None else min(sft.max_length, shape.positions or 1 << 30)
        tokens = warm.batch_size * length
        act = _layer_activations(shape, tokens, act_b, sft.gradient_checkpointing, cpu)
        sampled = warm.batch_size * warm.samples * (ppo.max_prompt_tokens + (warm.max_new_tokens or ppo.max_new_tokens))
        kv = 2.0 * shape.layers * sampled * shape.kv_dim * act_b
        stage("warm_start", _trained(shape.params), max(act + _logits(shape, tokens, act_b, True), kv))
    # reward model: chosen and rejected rows of a batch, then held-out scoring under no grad; on a CPU the copy of
    # the best held-out checkpoint's float32 weights too (`BestCheckpoint`, kept beside the trained weights)
    # (reward.frozen_layers: the embeddings and the lowest blocks keep float32 weights only, no gradients, optimizer
    # states, best copy or activations)
    # (none where a reward function scores: reward.source 'function')
    trains_reward_model = REWARD in stages_of(config.algorithm, rw.source)
    if trains_reward_model:
        tokens = 2 * rw.batch_size * rw.max_length
        frozen_layers = min(rw.frozen_layers, shape.layers)
        embeddings = shape.vocab * shape.hidden if frozen_layers else 0
        frozen = embeddings + (shape.reward_params - embeddings) * frozen_layers / shape.layers
        trainable = shape.reward_params - frozen
        best_copy = 4.0 * trainable if cpu else 0.0
        trained_layers = replace(shape, layers=shape.layers - frozen_layers)
        reward_act = _layer_activations(trained_layers, tokens, act_b, rw.gradient_checkpointing, cpu)
        stage("reward", _trained(trainable) + 4.0 * frozen + best_copy, reward_act)
    # the policy stage: DPO on the pairs, or PPO (and the critic-free estimators) on sampled responses
    if config.algorithm == "dpo":
        stage("dpo", *_dpo_memory(config, shape, act_b, cpu))
    else:
        stage("ppo", *_ppo_memory(config, shape, frozen_b, act_b, cpu))
    # evaluation: SFT and PPO policies and the reward model, in the runtime dtype
    eval_new = ev.max_new_tokens or ppo.max_new_tokens
    eval_kv = 2.0 * shape.layers * ev.batch_size * (ppo.max_prompt_tokens + eval_new) * shape.kv_dim * act_b
    eval_logits = _logits(shape, ev.batch_size * eval_new, act_b, False)  # log-probs of the response positions
    # an ensemble's members are all loaded (reward.ensemble_size)
    scorers = shape.reward_params * rw.ensemble_size if trains_reward_model else 0
    stage("evaluate", (2 * shape.params + scorers) * frozen_b, max(eval_kv, eval_logits))
    return out


def _ppo_memory(
    config: PipelineConfig, shape: ModelShape, frozen_b: int, act_b: int, cpu: bool = False
) -> tuple[float, float]:
    """(persistent, transient) bytes of the PPO stage: the policy, reference, reward and value models (no value model
    for a critic-free estimator), then the largest of generation, scoring and one micro-batch's training."""
    rt, ppo = config.runtime, config.ppo
    ckpt_ppo = ppo.gradient_checkpointing
    world = max(1, rt.ppo_processes)
    rollout = ppo.batch_size // world
    seq = ppo.max_prompt_tokens + ppo.max_new_tokens
    micro = max(1, ppo.mini_batch_size // world // ppo.gradient_accumulation_steps)
    lora = ppo.lora.enabled
    trainable = ppo.lora.r * shape.linear_in_out if lora else shape.params
    policy = 4.0 * shape.params + 12.0 * trainable if lora else _trained(shape.params)
    # the reference of a full fine-tune (`load_reference_lm`): its matmul weights in the compute dtype, the rest
    # (embeddings, norms) float32 like the policy's, so that it computes what the policy computes (KL 0 at the start)
    from rlhf.models.reference import reference_bytes  # heavy: torch and transformers

    reference = 0.0 if lora else float(reference_bytes(shape.params, shape.lowered_params, int(frozen_b)))
    critic = not ppo.critic_free  # a critic-free estimator loads no value model
    separate_value = critic and ppo.value_model == "separate"
    value = _trained(shape.reward_params) if separate_value else (_trained(shape.hidden + 1) if critic else 0.0)
    reward_model = (
        shape.reward_params * config.reward.ensemble_size * frozen_b if config.reward.source == "model" else 0.0
    )
    persistent = policy + reference + reward_model + value
    if getattr(rt, "sharding", "none") == "fsdp":  # each process holds 1/W of the weights and optimizer states
        persistent /= world  # (a block's gathered weights are transient and small beside the activations)
    kv_cache = 2.0 * shape.layers * rollout * seq * shape.kv_dim * act_b
    generation = kv_cache + rollout * shape.vocab * (act_b + 4)
    fwd = ppo.forward_batch_size or rollout
    scoring = fwd * seq * shape.hidden * act_b * 4 + _logits(shape, fwd * ppo.max_new_tokens, act_b, False)
    train_tokens = micro * seq
    training = _layer_activations(shape, train_tokens, act_b, ckpt_ppo, cpu)
    training += _logits(shape, micro * ppo.max_new_tokens, act_b, True)
    if separate_value:
        training += _layer_activations(shape, train_tokens, act_b, ckpt_ppo, cpu)
    rollout_tensors = rollout * seq * (8 if critic else 6) * 4  # ids, masks, log-probs, (values,) rewards, ...
    return persistent, max(generation, scoring, training) + rollout_tensors


def _dpo_memory(config: PipelineConfig, shape: ModelShape, act_b: int, cpu: bool = False) -> tuple[float, float]:
    """(persistent, transient) bytes of the DPO stage: the trained policy alone (the reference's log-probs are
    computed once, before the first step, by the policy itself), then a batch's chosen and rejected sequences."""
    dpo = config.dpo
    tokens = 2 * dpo.batch_size * dpo.max_length
    activations = _layer_activations(shape, tokens, act_b, dpo.gradient_checkpointing, cpu)
    return _trained(shape.params), activations + _logits(shape, tokens, act_b, True)


def fmt_gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.0f} MiB"
