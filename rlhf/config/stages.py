"""The config sections of the training stages: SFT, warm start, DPO and evaluation (the reward model and reward
functions: rlhf.config.reward; PPO: rlhf.config.ppo)."""

from __future__ import annotations

from typing import Any, Literal

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
    section_name = "sft"
    renamed_keys = {"warmup_steps": "warmup_ratio"}

    @classmethod
    def renamed_value(cls, old: str, value: Any, data: dict[str, Any]) -> Any:
        """sft.warmup_steps (a count) becomes sft.warmup_ratio, the fraction of sft.steps it was."""
        steps = data.get("steps", cls.model_fields["steps"].default)
        if isinstance(value, int | float) and isinstance(steps, int) and steps > 0:
            return min(value / steps, 1.0)
        return value

    model: str | None = Field(
        None,
        description="Existing model (local path or hub id): used as the SFT policy as it is, or fine-tuned first "
        "with `finetune`. A path ending in .gguf is a GGUF file, dequantised once into "
        "<runtime.output_dir>/gguf/ (docs/models.md). None bootstraps a tiny GPT-2 and its tokenizer from the "
        "task's demonstrations.",
    )
    revision: str | None = Field(None, description="Hub revision of `model`.")
    gguf_file: str | None = Field(
        None,
        description="The GGUF file (a name such as 'smollm2-135m-instruct-q4_1.gguf') inside the folder or hub "
        "repository `model`: the model is that file, dequantised once as a .gguf `model` is. Needs the 'gguf' extra.",
    )
    finetune: bool = Field(
        False,
        description="Fine-tune `model` on the demonstrations (synthetic task: its demonstrations; otherwise the "
        "chosen responses of the training pairs) before the later stages. Use a small `lr` (1e-5 to 5e-5).",
    )
    bootstrap: BootstrapModelConfig = Field(default_factory=BootstrapModelConfig)
    steps: int = Field(600, ge=1, description="SFT optimizer steps (bootstrapping or fine-tuning).")
    batch_size: int = Field(64, ge=1, description="SFT batch size.")
    lr: float = Field(3e-3, gt=0, description="SFT peak learning rate (AdamW, cosine decay).")
    warmup_ratio: float = Field(
        0.05, ge=0, le=1, description="Fraction of the steps of linear warm-up (then cosine decay to 10% of lr)."
    )
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

    @model_validator(mode="after")
    def _gguf_file_in_model(self) -> SFTConfig:
        if self.gguf_file is not None and self.model is None:
            raise ValueError("sft.gguf_file needs sft.model: the folder or hub repository that holds the file")
        if self.gguf_file is not None and self.model is not None and self.model.lower().endswith(".gguf"):
            raise ValueError(
                f"sft.model ({self.model}) is a GGUF file already; sft.gguf_file names a file inside a folder or hub "
                "repository sft.model: set one of them"
            )
        return self


class WarmStartConfig(Section):
    """A verified best-of-N warm start between the SFT and the policy stage (rejection-sampling fine-tuning: RAFT,
    Dong et al. 2023; Llama 2's rejection sampling, Touvron et al. 2023): the SFT policy samples `samples` responses
    to each training prompt, reward.function scores them, and the SFT policy is fine-tuned on the ones that pass;
    the policy stage's policy and reference start from that checkpoint (rlhf/train/warm_start.py,
    docs/pipeline.md). Off by default."""

    section_name = "warm_start"

    enabled: bool = Field(
        False,
        description="Run the warm-start stage: sample, verify with reward.function (with the rows' data.row_columns), "
        "fine-tune on the responses that pass; the policy stage (PPO's estimators or DPO) then starts from it, while "
        "the evaluation still compares against the SFT policy. Needs reward.function.",
    )
    samples: int = Field(8, ge=1, description="Responses sampled per prompt (the N of best-of-N).")
    prompts: int | None = Field(
        None,
        ge=1,
        description="Training prompts (prompts.parquet, the policy stage's) sampled for, the first N of a seeded "
        "order; None: all of them.",
    )
    temperature: float | None = Field(
        None,
        gt=0,
        description="Sampling temperature (no top-k or nucleus filtering); None: ppo.temperature, as the policy stage "
        "samples.",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Response length; None uses ppo.max_new_tokens (the policy stage's)."
    )
    min_score: float = Field(
        1.0,
        description="A response is kept when the reward function scores it at least this (1.0 with IFEval's "
        "verifiers: every instruction followed).",
    )
    keep_per_prompt: int = Field(
        1, ge=1, description="Distinct responses kept per prompt at most, the highest scores first (RAFT: 1)."
    )
    steps: int = Field(50, ge=1, description="Fine-tuning optimizer steps on the kept responses.")
    lr: float = Field(
        1e-5, gt=0, description="Peak learning rate of the fine-tuning (AdamW, cosine decay, sft.warmup_ratio)."
    )
    batch_size: int = Field(
        16,
        ge=1,
        description="Kept responses per optimizer step; also the prompts sampled at once (each `samples` times). The "
        "other fine-tuning settings are the SFT stage's (sft.weight_decay, sft.warmup_ratio, sft.max_length, "
        "sft.save_every, sft.gradient_checkpointing).",
    )


class DPOConfig(Section):
    """DPO (Rafailov et al. 2023): the policy trained on the preference pairs against the frozen SFT model
    (`algorithm: dpo`). Defaults from the paper where it has them; the rest as the reward stage has them."""

    beta: float = Field(
        0.1, gt=0, description="Strength of the implicit KL to the reference: rewards are beta * log(pi / ref)."
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="'sigmoid' (DPO) or 'ipo' (Azar et al. 2023: mean log-probs per response token)."
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="'sigmoid' only: the assumed chance that a label is flipped (conservative DPO); 0 disables.",
    )
    epochs: float = Field(1.0, gt=0, description="Passes over the training pairs.")
    batch_size: int = Field(64, ge=1, description="Pairs per optimizer step (2 * batch_size sequences a forward).")
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW, linear warm-up then linear decay to 0).")
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="Fraction of the steps of linear warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    eval_every: int = Field(50, ge=1, description="Held-out statistics every N steps (and after the last one).")
    max_length: int = Field(128, ge=8, description="Maximum tokens of prompt + response (+ EOS).")
    truncation: Literal["drop", "truncate"] = Field(
        "drop",
        description="Pairs over max_length: 'drop' leaves them out (counted: dpo/dropped_too_long; an error past "
        "half) or 'truncate' (the prompt cut on the left, the response on the right).",
    )
    min_prompt_tokens: int = Field(8, ge=1, description="truncation 'truncate': prompt tokens that always survive.")
    save_every: int = Field(100, ge=1, description="Save the full trainer state every N steps (resume point).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")

    @model_validator(mode="after")
    def _consistent(self) -> DPOConfig:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"dpo.label_smoothing applies to dpo.loss_type 'sigmoid' only, not {self.loss_type!r}")
        if self.min_prompt_tokens >= self.max_length:
            raise ValueError(
                f"dpo.min_prompt_tokens ({self.min_prompt_tokens}) must be less than dpo.max_length "
                f"({self.max_length}): the response needs room too"
            )
        return self

    @property
    def length_normalized(self) -> bool:
        """IPO compares the mean log-prob per response token (TRL's convention), DPO the sum."""
        return self.loss_type == "ipo"


class BenchmarkConfig(Section):
    """One instruction-following benchmark of the evaluation stage (rlhf.eval.benchmark, docs/evaluation.md)."""

    name: str = Field(description="The benchmark's name in metric keys and tables, e.g. 'ifbench'.")
    path: str = Field(
        description="A JSON-lines file in IFEval's layout: key, prompt, instruction_id_list, kwargs (google/IFEval, "
        "allenai/IFBench_test; `make real-model` installs IFBench's test set as data/ifbench/IFBench_test.jsonl)."
    )
    verifier: Literal["ifeval", "ifbench"] = Field(
        description="Whose checkers score it: IFEval's (25 types) or IFBench's (58 types), from if-verifiable."
    )
    n_prompts: int | None = Field(None, ge=1, description="The file's first N prompts; None: all of them.")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Response length on this benchmark; None uses eval.max_new_tokens."
    )
    max_prompt_tokens: int = Field(
        512, ge=8, description="Prompts longer than this keep their last tokens (IFBench's run to ~700 tokens)."
    )


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
    benchmarks: list[BenchmarkConfig] = Field(
        default_factory=list,
        description="Instruction-following benchmarks the SFT and the trained policy are both sampled on and scored "
        "with IFEval's or IFBench's checkers: prompt- and instruction-level accuracy, strict and loose, with 95% "
        "intervals, and a table by instruction type (docs/evaluation.md).",
    )
