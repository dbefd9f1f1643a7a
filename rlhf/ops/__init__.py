"""Pure tensor functions of RLHF with PPO: masked stats, KL, reward shaping, GAE, losses, log-probs."""

from rlhf.ops.advantages import GAEOutput, gae
from rlhf.ops.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_per_token,
    make_kl_controller,
)
from rlhf.ops.logprobs import entropy_from_logits, linear_logprobs, logprobs_from_logits
from rlhf.ops.losses import (
    PairwiseLossOutput,
    PolicyLossOutput,
    ValueLossOutput,
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
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "GAEOutput",
    "PairwiseLossOutput",
    "PolicyLossOutput",
    "ShapedScores",
    "TokenRewards",
    "ValueLossOutput",
    "entropy_from_logits",
    "explained_variance",
    "gae",
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
    "shape_scores",
    "value_loss",
]
