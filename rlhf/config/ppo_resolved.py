"""What the unset (None) fields of the `ppo:` section resolve to for the chosen estimator: its paper's defaults
(`rlhf.config.estimators`), GSPO's clipping ranges at the sequence level, PPO's own otherwise. `PPOConfig` inherits
these properties; a run logs them as parameters (`resolved`) so that runs compared in MLflow show what they used.
"""

from __future__ import annotations

from rlhf.config.estimators import ESTIMATORS, Estimator, objective_label

# GSPO's clipping ranges (Zheng et al. 2025, section 5.1): a sequence ratio is a geometric mean and moves little
GSPO_CLIPRANGE, GSPO_CLIPRANGE_HIGH = 3e-4, 4e-4
PPO_CLIPRANGE = 0.2


class ResolvedSettings:
    """The `ppo:` section's settings as a run uses them (the section's fields are `PPOConfig`'s)."""

    @property
    def estimator(self) -> Estimator:
        return ESTIMATORS[self.advantage_estimator]

    @property
    def label(self) -> str:
        """What the summary and the study call this objective ('PPO', 'GRPO', 'GSPO', 'DAPO', 'RLOO (sequence)')."""
        return objective_label(self.advantage_estimator, self.importance_sampling_level)

    @property
    def critic_free(self) -> bool:
        """No value model: the estimator's baseline comes from the samples themselves."""
        return not self.estimator.critic

    @property
    def kl_placement(self) -> str:
        """'reward' or 'loss': `kl_in`, or the estimator's own."""
        return self.kl_in or self.estimator.kl_in

    @property
    def aggregation(self) -> str:
        """`loss_aggregation`, or the estimator's own."""
        return self.loss_aggregation or self.estimator.loss_aggregation

    @property
    def kl_estimator_used(self) -> str:
        """`kl_estimator`, or k1 in the reward and k3 in the loss."""
        return self.kl_estimator or ("k3" if self.kl_placement == "loss" else "k1")

    @property
    def clip_low(self) -> float:
        """`cliprange`, or PPO's 0.2 (GSPO's 3e-4 at the sequence level)."""
        if self.cliprange is not None:
            return self.cliprange
        return GSPO_CLIPRANGE if self.importance_sampling_level == "sequence" else PPO_CLIPRANGE

    @property
    def clip_high(self) -> float:
        """`cliprange_high`, or the estimator's, or GSPO's at the sequence level, or `clip_low`."""
        if self.cliprange_high is not None:
            return self.cliprange_high
        if self.importance_sampling_level == "sequence" and self.cliprange is None:
            return GSPO_CLIPRANGE_HIGH
        return self.estimator.cliprange_high or self.clip_low

    @property
    def reward_scale(self) -> str | None:
        """`scale_rewards`, or the estimator's own (None where the estimator has no group-centred scores)."""
        return self.scale_rewards or self.estimator.scale_rewards

    @property
    def dynamic_rounds(self) -> int:
        """Extra generation rounds of dynamic sampling (0: off)."""
        if self.dynamic_sampling_rounds is not None:
            return self.dynamic_sampling_rounds
        return self.estimator.dynamic_sampling_rounds

    @property
    def overlong_tokens(self) -> int:
        """The overlong penalty's buffer in tokens (0: off)."""
        if self.overlong_buffer is not None:
            return self.overlong_buffer
        share = self.estimator.overlong_buffer_share
        return 0 if share is None else max(1, round(share * self.max_new_tokens))

    @property
    def warmup_updates(self) -> int:
        """`critic_warmup`, or the estimator's when unset: the first updates that train the value model alone."""
        if self.critic_warmup is not None:
            return self.critic_warmup
        return min(self.estimator.critic_warmup, self.num_updates // 10)

    @property
    def early_stop_kl(self) -> float | None:
        """`target_kl`, or the estimator's when unset; None: the epochs never stop early (0 turns it off)."""
        value = self.target_kl if self.target_kl is not None else self.estimator.target_kl
        return value or None

    def resolved(self) -> dict[str, str | int | float]:
        """The settings an unset (None) field resolves to for this estimator, as run parameters (`<key>_resolved`),
        with the objective's label: what a run compared in MLflow really used."""
        return {
            "objective": self.label,
            "kl_in_resolved": self.kl_placement,
            "kl_estimator_resolved": self.kl_estimator_used,
            "loss_aggregation_resolved": self.aggregation,
            "cliprange_resolved": self.clip_low,
            "cliprange_high_resolved": self.clip_high,
            "scale_rewards_resolved": self.reward_scale or "n/a",
            "dynamic_sampling_rounds_resolved": self.dynamic_rounds,
            "overlong_buffer_resolved": self.overlong_tokens,
            "critic_warmup_resolved": self.warmup_updates,
            "target_kl_resolved": self.early_stop_kl or "off",
        }
