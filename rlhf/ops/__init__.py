"""Pure tensor functions of RLHF: masked stats, KL, reward shaping, GAE, critic-free advantages, losses, log-probs."""

from rlhf.ops.advantages import (
    ADVANTAGE_ESTIMATORS,
    CRITIC_FREE,
    GAEOutput,
    GroupAdvantages,
    broadcast_to_tokens,
    gae,
    group_advantages,
    reinforce_returns,
)
from rlhf.ops.dpo import DPO_LOSS_TYPES, DPOLossOutput, dpo_loss, sequence_logps
from rlhf.ops.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_per_token,
    make_kl_controller,
)
from rlhf.ops.logprobs import entropy_from_logits, linear_logprobs, logprobs_from_logits
from rlhf.ops.losses import (
    LOSS_AGGREGATIONS,
    PairwiseLossOutput,
    PolicyLossOutput,
    ValueLossOutput,
    aggregate_loss,
    kl_loss,
    pairwise_reward_loss,
    policy_loss,
    value_loss,
)
from rlhf.ops.rewards import ShapedScores, TokenRewards, per_token_rewards, shape_scores
from rlhf.ops.stats import (
    explained_variance,
    masked_mean,
    masked_quantiles,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CRITIC_FREE",
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AdaptiveKLController",
    "DPOLossOutput",
    "FixedKLController",
    "GAEOutput",
    "GroupAdvantages",
    "PairwiseLossOutput",
    "PolicyLossOutput",
    "ShapedScores",
    "TokenRewards",
    "ValueLossOutput",
    "aggregate_loss",
    "broadcast_to_tokens",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_advantages",
    "kl_loss",
    "kl_per_token",
    "linear_logprobs",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_quantiles",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "pairwise_reward_loss",
    "per_token_rewards",
    "policy_loss",
    "reinforce_returns",
    "sequence_logps",
    "shape_scores",
    "value_loss",
]
