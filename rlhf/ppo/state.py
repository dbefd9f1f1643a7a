"""The four PPO models, the trainer state that is saved for resume, prompt batches and reward scoring."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import Tensor, nn
from transformers import AutoConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from rlhf import models
from rlhf.batching import encode_prompt_response, pad_left
from rlhf.checkpoints import atomic_dir, restore_interrupted_swap
from rlhf.config import PPOConfig, RuntimeConfig
from rlhf.errors import ConfigError
from rlhf.models import unwrap
from rlhf.ops import AdaptiveKLController, FixedKLController, make_kl_controller
from rlhf.ppo.rollout import Responses, policy_forward

STATE_FILE = "trainer_state.pt"


class PolicyValueHead(nn.Module):
    """Value model option 'policy_head': a scalar head on the policy's own trunk (shared, not copied)."""

    base_model_prefix = "trunk"

    def __init__(self, policy: PreTrainedModel) -> None:
        super().__init__()
        self.trunk = getattr(policy, policy.base_model_prefix)
        width = models.hidden_width(policy)  # the trunk's output width (not hidden_size for OPT-350m)
        self.score = nn.Linear(width, 1, bias=False)
        nn.init.normal_(self.score.weight, std=1.0 / (width + 1) ** 0.5)
        self.score.to(next(policy.parameters()).device)


@dataclass
class PPOModels:
    policy: PreTrainedModel  # a peft model when LoRA is on
    reference: PreTrainedModel | None  # None with LoRA: the policy with adapters disabled
    value: nn.Module
    reward: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    reward_tokenizer: PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]
    same_tokenizer: bool

    @property
    def shared_value_head(self) -> bool:
        return isinstance(self.value, PolicyValueHead)

    def value_trainable(self) -> nn.Module:
        """The value parameters the value optimizer owns (only the head when the trunk is the policy's)."""
        return self.value.score if self.shared_value_head else self.value


@dataclass
class TrainerState:
    step: int
    policy_params: list[nn.Parameter]
    value_params: list[nn.Parameter]
    policy_opt: torch.optim.Optimizer
    value_opt: torch.optim.Optimizer
    policy_sched: torch.optim.lr_scheduler.LRScheduler
    value_sched: torch.optim.lr_scheduler.LRScheduler
    kl_ctl: FixedKLController | AdaptiveKLController
    sample_generator: torch.Generator
    shuffle_generator: torch.Generator


def same_vocabulary(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> bool:
    return a.get_vocab() == b.get_vocab()


# Tokens that close an assistant turn in common chat templates (a fallback when rendering the template fails).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "</s>")
_PROBE = "Zq7Xv"  # an assistant message the probe conversation renders, to find what follows it


def added_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of the tokenizer's special and added tokens (BOS, EOS, pad, chat-template markers ...)."""
    return set(tokenizer.added_tokens_decoder) | set(tokenizer.all_special_ids)


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token that closes an assistant turn of the tokenizer's chat template; None without a template.

    Found by rendering a one-exchange conversation and taking the first special (added) token after the
    assistant's message; a template that cannot render it falls back to well-known end-of-turn tokens.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    special = added_ids(tokenizer)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # any template error (jinja, raise_exception): fall back to the known names
        text = ""
    if _PROBE in text:
        after = text.split(_PROBE, 1)[1]
        found = [i for i in tokenizer(after, add_special_tokens=False)["input_ids"] if i in special]
        if found:
            return found[0]
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in END_OF_TURN_TOKENS if vocab.get(t) in special), None)


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    stop_tokens: list[int | str],
    config: Any = None,
    generation_config: Any = None,
) -> tuple[int, ...]:
    """Ids that end a response: the tokenizer's EOS, every EOS id of the generation config and of the model config
    (an int or a list), the chat template's end-of-turn token, and the configured `stop_tokens` (a string must be
    exactly one token of the policy's vocabulary)."""
    eos_fields = (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None))
    eos_fields += (getattr(config, "eos_token_id", None), end_of_turn_id(tokenizer))
    ids = [i for field in eos_fields for i in models.token_ids(field)]
    for tok in stop_tokens:
        if isinstance(tok, int):
            ids.append(tok)
            continue
        encoded = tokenizer(tok, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ConfigError(f"ppo.stop_tokens: '{tok}' is {len(encoded)} tokens for this tokenizer, not one")
        ids.append(encoded[0])
    return tuple(dict.fromkeys(ids))


def checkpoint_stop_tokens(path: str, stop_tokens: list[int | str], trust_remote_code: bool) -> dict[int, str]:
    """`stop_token_ids` of a saved policy (its tokenizer, config and generation config, not its weights), each
    with its token."""
    tokenizer = models.load_tokenizer(path, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: the model config's EOS ids stand
        generation_config = None
    ids = stop_token_ids(tokenizer, stop_tokens, config, generation_config)
    return dict(zip(ids, tokenizer.convert_ids_to_tokens(list(ids)), strict=True))


def run_choices(cfg: PPOConfig, runtime: RuntimeConfig, policy_path: str) -> dict[str, str]:
    """What the PPO stage takes from the policy checkpoint, as run parameters: the stop tokens and, with LoRA, the
    adapted modules."""
    trc = runtime.trust_remote_code
    stops = checkpoint_stop_tokens(policy_path, cfg.stop_tokens, trc)
    choices = {"stop_token_ids": json.dumps(list(stops)), "stop_tokens_resolved": json.dumps(list(stops.values()))}
    if cfg.lora.enabled:
        model_type = AutoConfig.from_pretrained(policy_path, trust_remote_code=trc).model_type
        choices["lora_target_modules_resolved"] = json.dumps(lora_targets(model_type, cfg.lora.target_modules))
    return choices


def disable_dropout(model: nn.Module) -> None:
    """PPO needs ratio == 1 before the first step: no dropout anywhere, in train mode too.

    Dropout modules get p = 0, and so do the float rates that layers pass to functional dropout in train mode
    (OPT's ``self.dropout``, ``attention_dropout`` handed to the attention kernel, OPT's ``layerdrop``).
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "drop" in name and isinstance(value, float):
                setattr(module, name, 0.0)


def lora_targets(model_type: str, configured: list[str] | None) -> list[str] | str:
    """The modules LoRA adapts: the configured ones, else peft's default for the model type, else 'all-linear'
    (every linear layer but the output layer) for types peft has no default for (Phi-3's fused projections)."""
    if configured is not None:
        return configured
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    return list(defaults[model_type]) if model_type in defaults else "all-linear"


def _apply_lora(policy: PreTrainedModel, cfg: PPOConfig) -> nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ConfigError("ppo.lora.enabled needs peft: pip install -e '.[lora]'") from err
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=lora_targets(policy.config.model_type, cfg.lora.target_modules),
    )
    return get_peft_model(policy, lora)


def load_models(
    cfg: PPOConfig, runtime: RuntimeConfig, policy_path: str, reward_path: str, value_path: str, device: torch.device
) -> PPOModels:
    """Policy and frozen reference from the SFT checkpoint; value model and frozen reward model from the RM.

    Trained models (policy, value) get float32 weights, frozen ones the runtime dtype (`models.load_options`).
    """
    trained, frozen = (models.load_options(runtime, device, trainable) for trainable in (True, False))
    trc = runtime.trust_remote_code
    policy = models.load_causal_lm(policy_path, device, **trained)
    tokenizer = models.load_tokenizer(policy_path, trust_remote_code=trc)
    reward_tokenizer = models.load_tokenizer(reward_path, trust_remote_code=trc)
    stops = stop_token_ids(tokenizer, cfg.stop_tokens, policy.config, policy.generation_config)
    if cfg.gradient_checkpointing:
        models.enable_gradient_checkpointing(policy)
    reference = None if cfg.lora.enabled else models.load_causal_lm(policy_path, device, **frozen)
    if cfg.lora.enabled:
        policy = _apply_lora(policy, cfg)
    if cfg.value_model == "policy_head":
        value: nn.Module = PolicyValueHead(unwrap(policy))
    else:
        value = models.load_reward_model(value_path, device, **trained)
        if not same_vocabulary(tokenizer, models.load_tokenizer(value_path, trust_remote_code=trc)):
            raise ConfigError(f"the value model {value_path} must share the policy's tokenizer (it scores every token)")
        if cfg.gradient_checkpointing:
            models.enable_gradient_checkpointing(value)
    reward = models.load_reward_model(reward_path, device, **frozen)
    for frozen_model in (reference, reward):
        if frozen_model is not None:
            frozen_model.requires_grad_(False)
            frozen_model.eval()
    for model in (policy, value, reward, reference):
        if model is not None:
            disable_dropout(model)
            models.fuse_gelu(model)
    return PPOModels(
        policy,
        reference,
        value,
        reward,
        tokenizer,
        reward_tokenizer,
        stops,
        same_vocabulary(tokenizer, reward_tokenizer),
    )


def reference_logprobs(
    m: PPOModels, query_responses: Tensor, mask: Tensor, prompt_len: int, temperature: float
) -> Tensor:
    """Reference log-probs: the frozen copy, or with LoRA the policy with its adapters disabled."""
    if m.reference is not None:
        return policy_forward(m.reference, query_responses, mask, prompt_len, temperature).logprobs
    with m.policy.disable_adapter():
        return policy_forward(unwrap(m.policy), query_responses, mask, prompt_len, temperature).logprobs


def _schedule(cfg: PPOConfig):
    total = cfg.num_updates
    if cfg.lr_schedule == "linear":
        return lambda step: max(0.0, 1.0 - step / total)
    return lambda step: 1.0


def sample_seed(seed: int, rank: int) -> int:
    """Seed of a rank's sampling generator: `seed` on rank 0 (the single-process run), far apart on the others
    so that no rank's sampling stream is the shuffle stream (seeded ``seed + 1``) or another rank's."""
    return seed + 1_000_003 * rank


def fresh_state(m: PPOModels, cfg: PPOConfig, seed: int, device: torch.device, rank: int = 0) -> TrainerState:
    """Optimizers, schedulers, KL controller and RNGs of a run that starts at update 0.

    The shuffle generator is the same on every rank; the sampling generator differs per rank (`sample_seed`).
    """
    policy_params = [p for p in m.policy.parameters() if p.requires_grad]
    value_params = [p for p in m.value_trainable().parameters() if p.requires_grad]
    policy_opt = models.adamw(policy_params, lr=cfg.lr, eps=1e-5)
    value_opt = models.adamw(value_params, lr=cfg.value_lr, eps=1e-5)
    return TrainerState(
        step=0,
        policy_params=policy_params,
        value_params=value_params,
        policy_opt=policy_opt,
        value_opt=value_opt,
        policy_sched=torch.optim.lr_scheduler.LambdaLR(policy_opt, _schedule(cfg)),
        value_sched=torch.optim.lr_scheduler.LambdaLR(value_opt, _schedule(cfg)),
        kl_ctl=make_kl_controller(cfg.kl_controller, cfg.kl_coef, cfg.kl_target, cfg.kl_horizon),
        sample_generator=torch.Generator(device=device).manual_seed(sample_seed(seed, rank)),
        shuffle_generator=torch.Generator().manual_seed(seed + 1),
    )


def load_state(
    folder: Path,
    m: PPOModels,
    cfg: PPOConfig,
    seed: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
) -> TrainerState:
    """The state saved in `folder` (weights, optimizers, schedulers, KL, RNGs, step), or a fresh one.

    Every rank reads the same files (rank 0 wrote them) and takes its own sampling generator state; a state saved
    by a different number of processes cannot be resumed (the shards of the prompt batches would change).
    """
    state = fresh_state(m, cfg, seed, device, rank)
    restore_interrupted_swap(folder, STATE_FILE)  # a crash mid-save: the previous state
    if not (folder / STATE_FILE).is_file():
        return state
    saved: dict[str, Any] = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    saved_world = int(saved.get("world_size", 1))
    if saved_world != world_size:
        raise ConfigError(
            f"the PPO trainer state in {folder} was saved by {saved_world} process(es); resume it with the same "
            f"number, not {world_size}"
        )
    load_model(m.policy, folder / "policy.safetensors", device=str(device))
    m.value_trainable().load_state_dict(load_file(folder / "value.safetensors", device=str(device)))
    state.step = int(saved["step"])
    state.policy_opt.load_state_dict(saved["policy_opt"])
    state.value_opt.load_state_dict(saved["value_opt"])
    state.policy_sched.load_state_dict(saved["policy_sched"])
    state.value_sched.load_state_dict(saved["value_sched"])
    state.kl_ctl.load_state_dict(saved["kl_ctl"])
    state.sample_generator.set_state(saved["sample_rngs"][rank] if world_size > 1 else saved["sample_rng"])
    state.shuffle_generator.set_state(saved["shuffle_rng"])
    return state


def save_state(folder: Path, m: PPOModels, state: TrainerState, sample_rngs: list[Tensor] | None = None) -> None:
    """Write everything a restart needs, atomically (a crash mid-save keeps the previous state).

    With several processes, rank 0 alone calls this, with `sample_rngs`: every rank's sampling generator state in
    rank order (weights, optimizers and the shuffle generator are the same on every rank).
    """
    extra: dict[str, Any] = {}
    if sample_rngs is not None and len(sample_rngs) > 1:
        extra = {"world_size": len(sample_rngs), "sample_rngs": sample_rngs}
    with atomic_dir(folder) as tmp:
        save_model(m.policy, str(tmp / "policy.safetensors"))  # handles tied weights
        save_file({k: v.contiguous() for k, v in m.value_trainable().state_dict().items()}, tmp / "value.safetensors")
        torch.save(
            {
                "step": state.step,
                "policy_opt": state.policy_opt.state_dict(),
                "value_opt": state.value_opt.state_dict(),
                "policy_sched": state.policy_sched.state_dict(),
                "value_sched": state.value_sched.state_dict(),
                "kl_ctl": state.kl_ctl.state_dict(),
                "sample_rng": state.sample_generator.get_state(),
                "shuffle_rng": state.shuffle_generator.get_state(),
                **extra,
            },
            tmp / STATE_FILE,
        )


def save_final(folder: Path, m: PPOModels) -> None:
    """The trained policy (LoRA merged into the base) and value model, loadable with the Auto classes."""
    policy = m.policy.merge_and_unload() if hasattr(m.policy, "merge_and_unload") else m.policy
    policy.save_pretrained(folder / "policy", safe_serialization=True)
    m.tokenizer.save_pretrained(folder / "policy")
    (folder / "value").mkdir(parents=True, exist_ok=True)
    if m.shared_value_head:
        save_file(
            {k: v.contiguous() for k, v in m.value.score.state_dict().items()},
            folder / "value" / "value_head.safetensors",
        )
    else:
        m.value.save_pretrained(folder / "value", safe_serialization=True)
        m.tokenizer.save_pretrained(folder / "value")


@functools.lru_cache(maxsize=4)
def _pass_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


class PromptBatch(NamedTuple):
    ids: Tensor  # (b, p) left-padded
    mask: Tensor  # (b, p)
    indices: list[int]  # rows of the prompt list


def prompt_batch(
    prompt_ids: list[list[int]],
    update: int,
    batch_size: int,
    seed: int,
    pad_id: int,
    rank: int = 0,
    world_size: int = 1,
) -> PromptBatch:
    """Prompts of one update: a seeded stream of shuffled passes, so the data position is the update index.

    `batch_size` is the global batch; with `world_size` processes, rank r takes the r-th of `world_size` equal,
    disjoint slices of it (padded to its own longest prompt).
    """
    n = len(prompt_ids)
    indices = []
    for pos in range(update * batch_size, (update + 1) * batch_size):
        epoch, offset = divmod(pos, n)
        indices.append(_pass_order(n, seed, epoch)[offset])
    if world_size > 1:
        local = batch_size // world_size
        indices = indices[rank * local : (rank + 1) * local]
    ids, mask = pad_left([prompt_ids[i] for i in indices], pad_id)
    return PromptBatch(ids, mask, indices)


@torch.no_grad()
def reward_scores(
    reward: PreTrainedModel,
    reward_tokenizer: PreTrainedTokenizerBase,
    policy_tokenizer: PreTrainedTokenizerBase,
    same_tokenizer: bool,
    prompts: list[str] | None,
    query_responses: Tensor,
    qr_mask: Tensor,
    resp: Responses,
    forward_batch_size: int | None,
    device: torch.device,
) -> Tensor:
    """Reward-model score at the last real token of each (prompt, response). Shape: (b,).

    Same tokenizer: the policy's token ids are scored as they are. Different tokenizers: the response is decoded
    and the reward model re-tokenizes prompt and response text (a logged decision, see the PPO stage params).
    """
    if not same_tokenizer:
        if prompts is None:
            raise ValueError("the reward model's tokenizer differs from the policy's: prompt texts are needed")
        texts = policy_tokenizer.batch_decode(
            resp.tokens.masked_fill(resp.mask == 0, policy_tokenizer.pad_token_id), skip_special_tokens=True
        )
        limit = getattr(reward.config, "max_position_embeddings", None) or 1024
        batch = encode_prompt_response(reward_tokenizer, prompts, texts, max_length=limit)
        query_responses, qr_mask = batch.input_ids.to(device), batch.attention_mask.to(device)
    size = forward_batch_size or len(query_responses)
    return torch.cat(
        [
            models.sequence_scores(reward, query_responses[i : i + size], qr_mask[i : i + size])
            for i in range(0, len(query_responses), size)
        ]
    ).float()
