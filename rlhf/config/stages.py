"""The config sections of the training stages: SFT, reward model, PPO and evaluation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf.config.base import Section


class BootstrapModelConfig(Section):
    vocab_size: int = Field(512, ge=64, description="Byte-level BPE vocabulary trained on the task text.")
    n_layer: int = Field(2, ge=1, description="GPT-2 layers.")
    n_head: int = Field(4, ge=1, description="GPT-2 attention heads.")
    n_embd: int = Field(128, ge=16, description="GPT-2 hidden size (a multiple of n_head).")
    n_positions: int = Field(128, ge=16, description="Maximum sequence length.")

    @model_validator(mode="after")
    def _heads_divide(self) -> BootstrapModelConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"sft.bootstrap.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        return self


class SFTConfig(Section):
    model: str | None = Field(
        None,
        description="Existing model (local path or hub id): used as the SFT policy as it is, or fine-tuned first "
        "with `finetune`. None bootstraps a tiny GPT-2 and its tokenizer from the task's demonstrations.",
    )
    revision: str | None = Field(None, description="Hub revision of `model`.")
    finetune: bool = Field(
        False,
        description="Fine-tune `model` on the demonstrations (synthetic task: its demonstrations; otherwise the "
        "chosen responses of the training pairs) before the later stages. Use a small `lr` (1e-5 to 5e-5).",
    )
    bootstrap: BootstrapModelConfig = Field(default_factory=BootstrapModelConfig)
    steps: int = Field(600, ge=1, description="SFT optimizer steps (bootstrapping or fine-tuning).")
    batch_size: int = Field(64, ge=1, description="SFT batch size.")
    lr: float = Field(3e-3, gt=0, description="SFT peak learning rate (AdamW, cosine decay).")
    warmup_steps: int = Field(30, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    max_length: int = Field(
        512, ge=8, description="Fine-tuning: maximum tokens of prompt + response (capped by the model's positions)."
    )
    gradient_checkpointing: bool = Field(False, description="Fine-tuning: trade compute for activation memory.")
    save_every: int = Field(200, ge=1, description="Save the full SFT trainer state every N steps (resume point).")

    @model_validator(mode="after")
    def _finetune_needs_model(self) -> SFTConfig:
        if self.finetune and self.model is None:
            raise ValueError(
                "sft.finetune needs sft.model (the model to fine-tune); without a model the tiny GPT-2 is "
                "bootstrapped and trained anyway"
            )
        return self


class RewardConfig(Section):
    epochs: float = Field(2.0, gt=0, description="Passes over the training pairs.")
    batch_size: int = Field(32, ge=1, description="Pairs per optimizer step.")
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW, linear decay).")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Fraction of steps of linear warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    use_margin: bool = Field(True, description="Subtract the data's margin column in the loss when present.")
    center_coef: float = Field(0.01, ge=0, description="Reward-centring coefficient c * mean((r_c + r_r)^2).")
    eval_every: int = Field(50, ge=1, description="Evaluate on held-out pairs every N steps; best is kept.")
    max_length: int = Field(128, ge=8, description="Maximum tokens of prompt + response (+ EOS).")
    truncation: Literal["drop", "truncate"] = Field(
        "drop",
        description="Pairs whose prompt + longer response + EOS exceed max_length: 'drop' leaves them out of "
        "training and held-out evaluation (counted: reward/dropped_too_long; an error when more than half are); "
        "'truncate' keeps them, the prompt cut on the left and the response on the right, at least "
        "min_prompt_tokens of the prompt kept.",
    )
    min_prompt_tokens: int = Field(
        8,
        ge=1,
        description="truncation 'truncate': prompt tokens that always survive (all of a shorter prompt), so no "
        "response is scored without its prompt.",
    )
    save_every: int = Field(100, ge=1, description="Save the full trainer state every N steps (resume point).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward: the reward model's activations at real lengths."
    )

    @model_validator(mode="after")
    def _prompt_fits(self) -> RewardConfig:
        if self.min_prompt_tokens >= self.max_length:
            raise ValueError(
                f"reward.min_prompt_tokens ({self.min_prompt_tokens}) must be less than reward.max_length "
                f"({self.max_length}): the response needs room too"
            )
        return self


class LoraConfig(Section):
    enabled: bool = Field(False, description="Train LoRA adapters on the policy (needs the 'lora' extra: peft).")
    r: int = Field(16, ge=1, description="LoRA rank.")
    alpha: int = Field(32, ge=1, description="LoRA scaling alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout (keep 0 for exact PPO ratios).")
    target_modules: list[str] | None = Field(None, description="Modules to adapt; None lets peft pick per model.")


class PPOGenerationConfig(Section):
    backend: Literal["builtin", "vllm"] = Field(
        "builtin",
        description="What samples the rollouts: 'builtin' (the KV-cached sampler of rlhf/rollout/generation.py, any "
        "device) or 'vllm' (a vLLM engine on the policy's CUDA GPU, the 'vllm' extra; the policy's weights are pushed "
        "into it after every update; ppo.max_new_tokens, temperature, top_k, top_p and the stop tokens apply "
        "unchanged; log-probs still come from the training model). docs/models.md.",
    )
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="vllm: share of the GPU's memory the vLLM engine takes (its weights and KV cache) beside the "
        "training models on the same GPU.",
    )
    sleep: bool = Field(
        False,
        description="vllm: release the engine's weights and KV cache while the PPO epochs run and take them back for "
        "the next rollout (vLLM's sleep mode): less memory during optimisation, some time per update.",
    )
    seed_requests: bool = Field(
        True,
        description="vllm: seed every prompt's request from the run's sampling generator (reproducible from the run "
        "seed and a resumed state, up to vLLM's kernels); false leaves sampling to the engine's own seeded generator, "
        "faster at large batches.",
    )


class PPOConfig(Section):
    total_episodes: int = Field(8192, ge=1, description="Prompt/response pairs sampled over the whole run.")
    batch_size: int = Field(64, ge=1, description="Rollout batch: episodes per PPO update.")
    num_mini_batches: int = Field(4, ge=1, description="Minibatches per PPO epoch; must divide batch_size.")
    num_ppo_epochs: int = Field(4, ge=1, description="Optimisation epochs over each rollout batch.")
    lr: float = Field(3e-4, gt=0, description="Policy learning rate (AdamW).")
    value_lr: float = Field(3e-4, gt=0, description="Value-model learning rate (AdamW).")
    kl_coef: float = Field(0.05, ge=0, description="Initial KL penalty coefficient.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="Per-token KL estimator in the reward.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="Policy ratio clip range.")
    cliprange_value: float = Field(0.2, gt=0, description="Value clip range.")
    vf_coef: float = Field(0.1, ge=0, description="Value-loss coefficient.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    whiten_rewards: bool = Field(False, description="Whiten per-token rewards before GAE.")
    whiten_rewards_keep_mean: bool = Field(
        True,
        description="With whiten_rewards: divide the rewards by their std and keep their mean (TRL's "
        "shift_mean=False); false also subtracts the mean.",
    )
    max_new_tokens: int = Field(24, ge=1, description="Maximum response tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (log-probs use the same one).")
    top_k: int | None = Field(None, ge=1, description="Top-k sampling; None disables.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling; None disables.")
    missing_eos_penalty: float | None = Field(
        1.0, description="Subtracted from the score of a response without a stop token; None disables."
    )
    max_prompt_tokens: int = Field(64, ge=1, description="Prompts are left-truncated to this many tokens.")
    stop_tokens: list[int | str] = Field(
        default_factory=list, description="Extra stop tokens (ids or single-token strings); EOS always stops."
    )
    missing_eos_mode: Literal["subtract", "replace"] = Field(
        "subtract", description="'subtract': score - missing_eos_penalty; 'replace': score = missing_eos_penalty."
    )
    min_response_length: int | None = Field(None, ge=1, description="Responses shorter than this are penalised.")
    min_length_penalty: float | None = Field(
        None, description="Penalty for short responses, in the mode of ppo.missing_eos_mode ('subtract' or 'replace')."
    )
    score_clip: float | None = Field(None, gt=0, description="Clip reward-model scores to [-c, c]; None disables.")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="Constant or adaptive KL coefficient.")
    kl_target: float = Field(6.0, gt=0, description="Adaptive controller: target sequence KL (Ziegler et al.).")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive controller: horizon in episodes.")
    whiten_advantages: bool = Field(True, description="Whiten advantages (masked mean 0, std 1) before the loss.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0 disables).")
    target_kl: float | None = Field(
        None, gt=0, description="Stop the PPO epochs of an update early once approximate KL passes this."
    )
    lr_schedule: Literal["constant", "linear"] = Field("linear", description="Learning-rate schedule of both models.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per minibatch optimizer step.")
    forward_batch_size: int | None = Field(
        None, ge=1, description="Rows per no-grad forward pass (reference, reward, value); None: the whole batch."
    )
    value_model: Literal["separate", "policy_head"] = Field(
        "separate",
        description="'separate': a value model initialised from the reward model; 'policy_head': a scalar head on "
        "the policy's trunk (one model, less memory).",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    generation: PPOGenerationConfig = Field(default_factory=PPOGenerationConfig)
    save_every: int = Field(10, ge=1, description="Save the full trainer state every N updates (resume point).")
    record_rollouts: bool = Field(True, description="Write the per-sample rollout records of each update to Parquet.")
    log_every: int = Field(1, ge=1, description="Log statistics every N updates.")
    eval_every: int = Field(
        0,
        ge=0,
        description="Periodic evaluation every N updates (also before the first and after the last): generate on "
        "`eval_prompts` held-out prompts with the training sampling settings and a fixed seed, log ppo_eval/score "
        "(reward model), ppo_eval/gold (where the data has a gold reward), ppo_eval/kl and ppo_eval/sqrt_kl (to the "
        "reference) and ppo_eval/length_mean. 0: off.",
    )
    eval_prompts: int = Field(64, ge=1, description="Held-out prompts of the periodic evaluation (eval_every).")

    @model_validator(mode="after")
    def _batches_divide(self) -> PPOConfig:
        if self.batch_size % self.num_mini_batches:
            raise ValueError(
                f"ppo.num_mini_batches ({self.num_mini_batches}) must divide ppo.batch_size ({self.batch_size})"
            )
        if self.mini_batch_size % self.gradient_accumulation_steps:
            raise ValueError(
                f"ppo.gradient_accumulation_steps ({self.gradient_accumulation_steps}) must divide the minibatch size "
                f"(ppo.batch_size / ppo.num_mini_batches = {self.mini_batch_size})"
            )
        if self.total_episodes < self.batch_size:
            raise ValueError(
                f"ppo.total_episodes ({self.total_episodes}) must be at least ppo.batch_size ({self.batch_size})"
            )
        return self

    @property
    def mini_batch_size(self) -> int:
        return self.batch_size // self.num_mini_batches

    @property
    def num_updates(self) -> int:
        return self.total_episodes // self.batch_size


class EvalConfig(Section):
    n_prompts: int = Field(256, ge=1, description="Held-out prompts to generate for.")
    batch_size: int = Field(64, ge=1, description="Generation batch size.")
    max_new_tokens: int | None = Field(None, ge=1, description="Response length; None uses ppo.max_new_tokens.")
    temperature: float | None = Field(None, gt=0, description="Sampling temperature; None uses ppo.temperature.")
    seed: int = Field(1234, description="Generation seed (the same for the SFT and PPO policies).")
    length_tolerance: float = Field(
        0.2,
        ge=0,
        description="Length-matched win rates count the prompts whose PPO and SFT responses differ in length by at "
        "most this fraction of the longer one (docs/evaluation.md).",
    )
