"""The reward section (`reward:`): a reward model trained on the preference pairs (one, or an ensemble), or reward
functions (one `function`, or `functions` with `weights`), or both."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlhf.config.base import Section


class RewardConfig(Section):
    source: Literal["model", "function"] = Field(
        "model",
        description="'model': a reward model trained on the preference pairs scores the responses; 'function': "
        "the Python callable `function` does, and the reward-model stage is skipped (gae's value model then starts "
        "from the SFT model with a new scalar head).",
    )
    function: str | None = Field(
        None,
        description="A reward function 'module:callable', (prompts: list[str], responses: list[str]) -> "
        "list[float], importable in the run's environment (e.g. rlhf.data.synthetic:gold_reward). It may take the "
        "data's row columns (data.row_columns) as keyword arguments, TRL's convention: (prompts, completions, "
        "instruction_id_list, kwargs), or **kwargs for all. Used alone with source: function, or added to the "
        "model's score with function_weight.",
    )
    function_weight: float = Field(
        0.0,
        description="With source: model, the score is the reward model's plus function_weight * function(...) "
        "(format rewards on top of a reward model); 0 leaves the function out.",
    )
    functions: list[str] | None = Field(
        None,
        description="Several reward functions, each 'module:callable' as `function` is (TRL's reward_funcs): the "
        "score is their sum weighted by `weights`, plus the reward model's with source: model. Each is logged on its "
        "own, rewards/<name>/mean and /std (name: the callable's). `function` is a list of one; set one of the two.",
    )
    weights: list[float] | None = Field(
        None,
        description="One finite weight per entry of `functions` (TRL's reward_weights); None: all 1.",
    )
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
    frozen_layers: int = Field(
        0,
        ge=0,
        description="Freeze the embeddings and the first N transformer blocks of the reward model: only the top "
        "blocks and the scalar head train, which keeps no gradients, optimizer states or backward activations for "
        "the frozen ones (a pretrained trunk's features on a CPU or a small GPU; conf/real.yaml). 0 trains all.",
    )
    ensemble_size: int = Field(
        1,
        ge=1,
        description="Reward models in the ensemble (K). Member i trains as the single model does, from the SFT "
        "checkpoint with its own seed (its head and data order; member 0 is the single model of the same config, "
        "shared with it in the cache), and the policy stage scores with all of them (`ensemble_objective`). "
        "With `ensemble_models`: that list's length (an ensemble_size other than 1 must match it). "
        "docs/overoptimisation.md.",
    )
    ensemble_trunks: Literal["shared", "own_sft"] = Field(
        "shared",
        description="The trunk each member trains from: 'shared', the pipeline's SFT checkpoint (members that "
        "differ in their seed only share the trunk's errors); 'own_sft', member k > 0 from an SFT stage of its own "
        "run with the member's seed (without sft.model: a tiny GPT-2 pretrained anew; with sft.finetune: sft.model "
        "fine-tuned anew, the same pretrained trunk), member 0 from the pipeline's. No effect with one model.",
    )
    ensemble_models: list[str] | None = Field(
        None,
        description="The models the members train from, one each (hub ids or checkpoint folders), instead of "
        "the SFT checkpoint: member k from the k-th, with its own tokenizer, and it scores the policy's responses "
        "re-tokenized with that tokenizer. Its length is the ensemble size. None: every member from the SFT "
        "checkpoint (`ensemble_trunks`).",
    )
    bootstrap: bool = Field(
        False,
        description="Train each ensemble member on a bootstrap resample of the training pairs (drawn with "
        "replacement, with the member's seed) rather than on all of them: members that differ in their data too.",
    )
    ensemble_objective: Literal["mean", "uwo", "wco"] = Field(
        "mean",
        description="The score an ensemble gives the policy stage (Coste et al. 2023): 'mean' of the members, "
        "'uwo' (the mean minus uncertainty_coef times the members' variance) or 'wco' (the members' minimum). "
        "No effect with one model.",
    )
    uncertainty_coef: float = Field(
        1.0, ge=0, description="'uwo': the weight of the members' variance subtracted from their mean."
    )

    @model_validator(mode="after")
    def _function_given(self) -> RewardConfig:
        if self.function and self.functions is not None:
            raise ValueError(
                "reward.function and reward.functions both name reward functions: set one of them (a list of one "
                "is reward.function)"
            )
        if self.functions is not None and not self.functions:
            raise ValueError("reward.functions is empty: list 'module:callable' names, or leave the key out")
        if self.source == "function" and not self.function_specs:
            raise ValueError("reward.source: function needs reward.function ('module:callable') or reward.functions")
        if self.source == "model" and self.function_weight and not self.function:
            raise ValueError("reward.function_weight needs reward.function ('module:callable')")
        if self.functions is not None and self.function_weight:
            raise ValueError(
                "reward.function_weight weighs reward.function beside the reward model; with reward.functions give "
                "each its weight in reward.weights"
            )
        if self.weights is not None:
            if self.functions is None:
                raise ValueError("reward.weights weighs the entries of reward.functions: list them there")
            if len(self.weights) != len(self.functions):
                raise ValueError(
                    f"reward.weights has {len(self.weights)} values for the {len(self.functions)} functions of "
                    "reward.functions: give one weight per function, or leave reward.weights out (all 1)"
                )
        return self

    @model_validator(mode="before")
    @classmethod
    def _size_of_the_models_list(cls, data: Any) -> Any:
        """reward.ensemble_models' length is the ensemble size: it replaces reward.ensemble_size where that is
        unset or 1, its default (a config dumped and overridden, as a sweep's variant is, has it at 1)."""
        if not isinstance(data, dict) or not isinstance(data.get("ensemble_models"), list):
            return data
        listed, size = len(data["ensemble_models"]), data.get("ensemble_size")
        if not listed:
            raise ValueError("reward.ensemble_models is empty: list the members' models, or leave the key out")
        if size not in (None, 1, listed):
            raise ValueError(
                f"reward.ensemble_models lists {listed} models but reward.ensemble_size is {size}: leave "
                "reward.ensemble_size out (the list's length is the ensemble size) or make the two agree"
            )
        return {**data, "ensemble_size": listed}

    @model_validator(mode="after")
    def _ensemble_of_models(self) -> RewardConfig:
        if self.source == "function" and self.ensemble_models:
            raise ValueError(
                "reward.ensemble_models needs reward models to train: reward.source is 'function' (set "
                "reward.source: model, or leave reward.ensemble_models out)"
            )
        if self.source == "function" and self.ensemble_size > 1:
            raise ValueError(
                f"reward.ensemble_size {self.ensemble_size} needs reward models to train: reward.source is 'function' "
                "(set reward.source: model, with reward.function_weight to add the function to the ensemble's score)"
            )
        if self.ensemble_models and self.ensemble_trunks == "own_sft":
            raise ValueError(
                "reward.ensemble_trunks 'own_sft' trains the members from SFT checkpoints and reward.ensemble_models "
                "from the models it lists: set one of them"
            )
        return self

    @property
    def function_specs(self) -> list[str]:
        """The reward functions' names, 'module:callable': `functions`, or `function` as a list of one."""
        return list(self.functions) if self.functions is not None else [self.function] if self.function else []

    @property
    def function_weights(self) -> list[float]:
        """One weight per entry of `function_specs`: `weights`, or all 1."""
        return list(self.weights) if self.weights is not None else [1.0] * len(self.function_specs)

    @property
    def uses_function(self) -> bool:
        """Whether reward functions score: alone (source: function), listed beside the reward model
        (`functions`), or the one `function` at a non-zero `function_weight`."""
        if not self.function_specs:
            return False
        return self.source == "function" or self.functions is not None or self.function_weight != 0

    @property
    def is_ensemble(self) -> bool:
        return self.source == "model" and self.ensemble_size > 1

    def is_the_gold(self, gold_reward: str | None) -> bool:
        """Whether the reward is the data's gold reward itself (`data.gold_reward`, a verifier) and nothing else:
        its score is then the quality, not a proxy of it (the over-optimisation alarm says so)."""
        return (
            self.source == "function"
            and gold_reward is not None
            and self.function_specs == [gold_reward]
            and self.function_weights == [1.0]
        )

    def member_config(self) -> RewardConfig:
        """What one member's training reads: this section without the ensemble's own keys (at their defaults), so
        member 0 of an ensemble is the single reward model of the same config (one cache entry). What a member
        trains from is a parameter of its stage of its own (its SFT checkpoint, or its model of `ensemble_models`)."""
        ensemble_keys = (
            "ensemble_size",
            "ensemble_objective",
            "uncertainty_coef",
            "ensemble_trunks",
            "ensemble_models",
        )
        return self.model_copy(update={key: RewardConfig.model_fields[key].default for key in ensemble_keys})

    @model_validator(mode="after")
    def _prompt_fits(self) -> RewardConfig:
        if self.min_prompt_tokens >= self.max_length:
            raise ValueError(
                f"reward.min_prompt_tokens ({self.min_prompt_tokens}) must be less than reward.max_length "
                f"({self.max_length}): the response needs room too"
            )
        return self
