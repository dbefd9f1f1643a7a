"""The config section of the online RL stage (PPO and the critic-free estimators): `ppo:`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlhf.config.base import Section, warn_once
from rlhf.config.estimators import (
    ESTIMATOR_NAMES,
    ESTIMATORS,
    GROUP_ESTIMATORS,
    SCALED_ESTIMATORS,
    estimator_descriptions,
)
from rlhf.config.ppo_resolved import GSPO_CLIPRANGE, GSPO_CLIPRANGE_HIGH, PPO_CLIPRANGE, ResolvedSettings


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
    decode: Literal["auto", "dynamic", "static", "compiled"] = Field(
        "auto",
        description="builtin: how the sampling loop runs the model. 'dynamic' (transformers' growing KV cache), "
        "'static' (a preallocated KV cache of fixed shape, rlhf/rollout/static_decode.py) or 'compiled' (the static "
        "cache's one-token step under torch.compile: a CUDA graph on a GPU, compiled once per stage and batch shape, "
        "the warm-up logged as time/decode_compile); the same tokens in each. 'auto': 'compiled' on CUDA, 'dynamic' "
        "on a CPU (measured faster there once the compile warm-up is counted; docs/benchmark.md). Used by PPO's "
        "rollouts, the periodic and the final evaluation.",
    )
    seed_requests: bool = Field(
        True,
        description="vllm: seed every prompt's request from the run's sampling generator (reproducible from the run "
        "seed and a resumed state, up to vLLM's kernels); false leaves sampling to the engine's own seeded generator, "
        "faster at large batches.",
    )


class PPOConfig(ResolvedSettings, Section):
    section_name = "ppo"
    renamed_keys = {"eval_prompts": "eval_n_prompts", "kl_target": "adaptive_kl_target"}

    total_episodes: int = Field(8192, ge=1, description="Prompt/response pairs sampled over the whole run.")
    batch_size: int = Field(64, ge=1, description="Rollout batch: episodes per PPO update.")
    num_mini_batches: int = Field(4, ge=1, description="Minibatches per PPO epoch; must divide batch_size.")
    num_ppo_epochs: int = Field(4, ge=1, description="Optimisation epochs over each rollout batch.")
    lr: float = Field(3e-4, gt=0, description="Policy learning rate (AdamW).")
    value_lr: float = Field(3e-4, gt=0, description="Value-model learning rate (AdamW).")
    kl_coef: float = Field(0.05, ge=0, description="Initial KL penalty coefficient.")
    advantage_estimator: Literal[ESTIMATOR_NAMES] = Field(  # type: ignore[valid-type]
        "gae",
        description=estimator_descriptions() + ". All but 'gae' are critic-free (no value model loaded). "
        "docs/choosing-an-algorithm.md.",
    )
    samples_per_prompt: int = Field(
        1,
        ge=1,
        description="Responses sampled per prompt (the group size G): a batch of ppo.batch_size episodes holds "
        f"batch_size / G prompts; {', '.join(GROUP_ESTIMATORS)} need G >= 2.",
    )
    kl_in: Literal["reward", "loss"] | None = Field(
        None,
        description="Where the KL to the reference goes: 'reward' (a per-token penalty kl_coef * KL in the reward) "
        "or 'loss' (kl_coef * KL as a term of the policy loss). None: the estimator's paper: 'loss' for "
        f"{', '.join(n for n, e in ESTIMATORS.items() if e.kl_in == 'loss')}, 'reward' for the others.",
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] | None = Field(
        None,
        description="How per-token losses become one: 'token_mean' (over all tokens of the minibatch), "
        "'seq_mean_token_mean' (per sequence, then over sequences), 'seq_mean_token_sum_norm' (each sequence's sum "
        "over max_new_tokens, then over sequences). None: the estimator's paper: seq_mean_token_mean for grpo, "
        "seq_mean_token_sum_norm for dr_grpo, token_mean for the others (dapo's token-level loss included). With a "
        "sequence-level importance ratio the policy loss is the mean over responses and this applies to the KL term.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None, description="Per-token KL estimator (Schulman's k1, k2, k3). None: k1 in the reward, k3 in the loss."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float | None = Field(
        None,
        gt=0,
        description=f"Policy ratio clip range (eps_low: the ratio is clipped at 1 - cliprange). None: {PPO_CLIPRANGE}, "
        f"or GSPO's {GSPO_CLIPRANGE} with importance_sampling_level 'sequence'.",
    )
    cliprange_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip range (eps_high: the ratio is clipped at 1 + cliprange_high; DAPO's clip-higher sets "
        "it above cliprange so that unlikely tokens can grow). None: the estimator's paper (dapo 0.28), GSPO's "
        f"{GSPO_CLIPRANGE_HIGH} with importance_sampling_level 'sequence', else equal to cliprange.",
    )
    importance_sampling_level: Literal["token", "sequence", "sequence_sum"] = Field(
        "token",
        description="The importance ratio of the policy loss: 'token' (one per token, PPO's; GRPO and OpenRLHF's "
        "RLOO use it), 'sequence' (one per response, the geometric mean of its token ratios, clipped per response "
        "and averaged over responses: GSPO, Zheng et al. 2025; TRL's importance_sampling_level 'sequence', veRL's "
        "loss_mode gspo) or 'sequence_sum' (one per response, its whole likelihood ratio, exp of the summed token "
        "log-ratios, clipped per response and averaged over responses: RLOO as Ahmadian et al. 2024 and TRL 0.19's "
        "RLOOTrainer compute it). The sequence levels need a critic-free estimator.",
    )
    scale_rewards: Literal["group", "batch", "none"] | None = Field(
        None,
        description=f"{', '.join(SCALED_ESTIMATORS)}: what each score minus its group's mean is divided by (TRL's "
        "scale_rewards): the group's std ('group', GRPO's), the whole batch's std ('batch') or nothing ('none', "
        "Dr. GRPO's). None: the estimator's own.",
    )
    dynamic_sampling_rounds: int | None = Field(
        None,
        ge=0,
        description="DAPO's dynamic sampling: groups whose samples all get the same score (no learning signal) are "
        "dropped and the batch is refilled with groups of new prompts, in up to this many extra generation rounds; "
        "what is still missing after them is filled with dropped groups. Needs groups (samples_per_prompt >= 2, a "
        "critic-free estimator). 0: off. None: the estimator's paper (dapo 3, others 0).",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=0,
        description="DAPO's soft overlong penalty: over the last this many tokens before max_new_tokens the score "
        "falls linearly by up to overlong_penalty (L_cache of the paper's eq. 13). 0: off. None: the estimator's "
        "paper (dapo: a fifth of max_new_tokens, others off).",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="The overlong penalty's size at max_new_tokens (veRL's penalty_factor)."
    )
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
        None, description="Penalty for responses shorter than min_response_length, applied as min_length_mode says."
    )
    min_length_mode: Literal["subtract", "replace"] = Field(
        "subtract", description="'subtract': score - min_length_penalty; 'replace': score = min_length_penalty."
    )
    score_clip: float | None = Field(None, gt=0, description="Clip reward-model scores to [-c, c]; None disables.")
    kl_controller: Literal["fixed", "adaptive"] = Field("fixed", description="Constant or adaptive KL coefficient.")
    adaptive_kl_target: float = Field(
        6.0, gt=0, description="kl_controller 'adaptive': the sequence KL it steers toward (Ziegler et al.)."
    )
    kl_horizon: int = Field(10000, ge=1, description="Adaptive controller: horizon in episodes.")
    whiten_advantages: bool = Field(True, description="Whiten advantages (masked mean 0, std 1) before the loss.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0 disables).")
    target_kl: float | None = Field(
        None,
        ge=0,
        description="Stop the PPO epochs of an update early once approximate KL passes this (an early stop, not "
        "the adaptive controller's adaptive_kl_target). 0: never. None: the estimator's (gae 0.02, the others never).",
    )
    critic_warmup: int | None = Field(
        None,
        ge=0,
        description="With a value model (advantage_estimator gae): the first this many updates train the value model "
        "alone, on the SFT policy's rollouts, and leave the policy as it is, so that the policy's first steps follow "
        "a critic that has learned the returns rather than the reward model it started from (veRL's critic_warmup, "
        "OpenRLHF's freezing_actor_steps). 0: off. None: the estimator's (gae: 5 updates, at most a tenth of the "
        "run's; the others have no value model).",
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
        "`eval_n_prompts` held-out prompts with the training sampling settings and a fixed seed, log "
        "periodic_eval/score (reward model), periodic_eval/gold (where the data has a gold reward), periodic_eval/kl "
        "and periodic_eval/sqrt_kl (to the reference) and periodic_eval/length_mean. 0: off.",
    )
    eval_n_prompts: int = Field(64, ge=1, description="Held-out prompts of the periodic evaluation (eval_every).")
    on_overoptimisation: Literal["warn", "stop", "keep_best"] = Field(
        "stop",
        description="What the over-optimisation alarm (checked at every periodic evaluation; docs/overoptimisation.md) "
        "does when it fires, besides its WARNING line, run tag and evaluation row: 'stop' (the default: the stage "
        "ends, its final policy that of the last quiet evaluation before the alarm: the rule not holding and the SFT "
        "model's surprisal at the responses neither risen 1.3 nats nor jumping; docs/overoptimisation.md gives what "
        "it keeps per estimator), 'warn' (training goes on to the last update, whose policy is final) or "
        "'keep_best' (training goes on and the final policy is that of the evaluation with the best conservative "
        "score among the same ones). It acts at the periodic evaluations (eval_every); 'keep_best' with eval_every 0 "
        "is refused.",
    )

    @model_validator(mode="before")
    @classmethod
    def _min_length_mode_was_missing_eos_mode(cls, data: Any) -> Any:
        """Before min_length_mode was split out, missing_eos_mode applied to min_length_penalty too: a config that
        sets the penalty with missing_eos_mode 'replace' and no min_length_mode is now read differently."""
        if (
            isinstance(data, dict)
            and data.get("min_length_penalty") is not None
            and data.get("missing_eos_mode") == "replace"
            and "min_length_mode" not in data
        ):
            warn_once(
                "ppo.min_length_mode",
                "warning: ppo.min_length_penalty now subtracts from the score (ppo.min_length_mode: subtract, the "
                "default); before, ppo.missing_eos_mode: replace made it replace the score: set ppo.min_length_mode: "
                "replace to keep that",
            )
        return data

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
        if self.batch_size % self.samples_per_prompt:
            raise ValueError(
                f"ppo.samples_per_prompt ({self.samples_per_prompt}) must divide ppo.batch_size ({self.batch_size}): "
                "a batch holds whole groups of samples of a prompt"
            )
        if self.advantage_estimator in GROUP_ESTIMATORS and self.samples_per_prompt < 2:
            raise ValueError(
                f"ppo.advantage_estimator {self.advantage_estimator} compares the samples of a prompt: it needs "
                f"ppo.samples_per_prompt of 2 or more (got {self.samples_per_prompt})"
            )
        return self

    @model_validator(mode="after")
    def _objective_fits_estimator(self) -> PPOConfig:
        estimator = self.advantage_estimator
        if self.importance_sampling_level != "token" and self.estimator.critic:
            raise ValueError(
                f"ppo.importance_sampling_level '{self.importance_sampling_level}' gives one ratio per response, and "
                f"GAE's advantages differ from token to token: use a critic-free ppo.advantage_estimator (e.g. grpo) "
                "or importance_sampling_level: token"
            )
        if self.dynamic_rounds and (self.estimator.critic or self.samples_per_prompt < 2):
            raise ValueError(
                f"ppo.dynamic_sampling_rounds ({self.dynamic_rounds}) drops groups of samples of one prompt that all "
                f"score the same, and this run has no groups (advantage_estimator {estimator}, samples_per_prompt "
                f"{self.samples_per_prompt}): use a critic-free estimator with samples_per_prompt of 2 or more, or "
                "set ppo.dynamic_sampling_rounds: 0"
            )
        if self.clip_high < self.clip_low:
            raise ValueError(
                f"ppo.cliprange_high ({self.clip_high}) is below ppo.cliprange ({self.clip_low}): clip-higher widens "
                "the upper bound only; raise cliprange_high or leave it unset (equal to cliprange)"
            )
        if self.scale_rewards is not None and estimator not in SCALED_ESTIMATORS:
            raise ValueError(
                f"ppo.scale_rewards divides the group-centred scores of {', '.join(SCALED_ESTIMATORS)}, not "
                f"{estimator}'s: leave it unset or pick one of those estimators"
            )
        if self.critic_warmup and not self.estimator.critic:  # set: an unset one resolves to 0 (`warmup_updates`)
            raise ValueError(
                f"ppo.critic_warmup ({self.critic_warmup}) trains a value model alone, and advantage_estimator "
                f"{estimator} has none: set ppo.critic_warmup: 0 or ppo.advantage_estimator: gae"
            )
        if self.critic_warmup and self.critic_warmup >= max(self.num_updates, 1):
            raise ValueError(
                f"ppo.critic_warmup ({self.critic_warmup}) holds the policy for at least every update of the run "
                f"({self.num_updates}: total_episodes / batch_size): lower it or raise ppo.total_episodes"
            )
        if self.overlong_buffer is not None and self.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"ppo.overlong_buffer ({self.overlong_buffer}) is longer than ppo.max_new_tokens "
                f"({self.max_new_tokens}): the penalty covers the last tokens before max_new_tokens"
            )
        return self

    @model_validator(mode="after")
    def _alarm_needs_evaluations(self) -> PPOConfig:
        # 'stop', the default, acts where there are periodic evaluations (the evaluation stage's check still warns
        # without them); 'keep_best' picks among them, so it needs them
        if self.on_overoptimisation == "keep_best" and self.eval_every == 0:
            raise ValueError(
                "ppo.on_overoptimisation 'keep_best' picks among the periodic evaluations, and ppo.eval_every is 0: "
                "set ppo.eval_every (e.g. 5), or ppo.on_overoptimisation: stop (the default) or warn"
            )
        return self

    @property
    def prompts_per_batch(self) -> int:
        return self.batch_size // self.samples_per_prompt

    @property
    def mini_batch_size(self) -> int:
        return self.batch_size // self.num_mini_batches

    @property
    def num_updates(self) -> int:
        return self.total_episodes // self.batch_size
