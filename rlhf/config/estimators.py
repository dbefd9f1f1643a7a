"""The advantage estimators of the online RL stage (`ppo.advantage_estimator`), declared once.

Each entry holds what the rest of the code asks about an estimator: its name in the config, what the summary and
the study call it, the paper it follows, whether it needs a value model or groups of samples, which advantages of
`rlhf.ops.group_advantages` it computes, and the defaults of its paper for the settings left unset (None) in the
config. Adding an estimator is one entry here (and its arithmetic in `rlhf.ops` when it is new).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Estimator:
    name: str  # the value of ppo.advantage_estimator
    label: str  # what the summary, the study and the UI call it
    summary: str  # one line for the config reference: what its advantages are
    critic: bool = False  # needs a value model (GAE)
    groups: bool = True  # compares the samples of a prompt: needs ppo.samples_per_prompt >= 2
    advantages: str | None = None  # the advantages of rlhf.ops.group_advantages it computes (None: GAE)
    # the paper's defaults of the settings left unset (None) in the config
    kl_in: str = "reward"
    loss_aggregation: str = "token_mean"
    scale_rewards: str | None = None  # grpo-style estimators: what the centred scores are divided by
    cliprange_high: float | None = None  # None: ppo.cliprange (symmetric clipping)
    dynamic_sampling_rounds: int = 0
    overlong_buffer_share: float | None = None  # of max_new_tokens; None: no overlong penalty
    # this project's defaults for a value model, measured where the paper gives none (docs/overoptimisation.md, "PPO
    # without a KL penalty"): the updates that train the value model alone first (at most a tenth of the run's), and
    # the approximate KL that ends an update's epochs early (None: none)
    critic_warmup: int = 0
    target_kl: float | None = None


ESTIMATORS: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator(
            "gae",
            "PPO",
            "PPO with a learned value model (GAE; Schulman et al. 2017)",
            critic=True,
            groups=False,
            critic_warmup=5,
            target_kl=0.02,
        ),
        Estimator(
            "grpo",
            "GRPO",
            "each score minus its group's mean, over the group's std (Shao et al. 2024)",
            advantages="grpo",
            kl_in="loss",
            loss_aggregation="seq_mean_token_mean",
            scale_rewards="group",
        ),
        Estimator(
            "dr_grpo",
            "Dr. GRPO",
            "minus the group mean, no std, the loss summed over tokens over max_new_tokens (Liu et al. 2025)",
            advantages="dr_grpo",
            kl_in="loss",
            loss_aggregation="seq_mean_token_sum_norm",
            scale_rewards="none",
        ),
        Estimator(
            "dapo",
            "DAPO",
            "GRPO's advantages with DAPO's recipe (Yu et al. 2025): clip-higher (cliprange_high 0.28), dynamic "
            "sampling (3 extra rounds), the token-level loss and the overlong penalty over the last fifth of "
            "max_new_tokens",
            advantages="grpo",
            kl_in="loss",
            loss_aggregation="token_mean",
            scale_rewards="group",
            cliprange_high=0.28,
            dynamic_sampling_rounds=3,
            overlong_buffer_share=0.2,
        ),
        Estimator(
            "rloo",
            "RLOO",
            "minus the mean of the other samples of the prompt (Ahmadian et al. 2024)",
            advantages="rloo",
        ),
        Estimator(
            "reinforce_pp",
            "REINFORCE++",
            "per-token KL penalty, return to go, whitened over the global batch (Hu 2025)",
            groups=False,
            advantages="reinforce_pp",
        ),
        Estimator(
            "reinforce_pp_baseline",
            "REINFORCE++ (baseline)",
            "REINFORCE++ after subtracting the group mean of the scores",
            advantages="reinforce_pp_baseline",
        ),
    )
}
ESTIMATOR_NAMES: tuple[str, ...] = tuple(ESTIMATORS)
GROUP_ESTIMATORS: tuple[str, ...] = tuple(name for name, e in ESTIMATORS.items() if e.groups)
CRITIC_FREE_ESTIMATORS: tuple[str, ...] = tuple(name for name, e in ESTIMATORS.items() if not e.critic)
# the estimators whose advantages are a group-centred score that ppo.scale_rewards can divide
SCALED_ESTIMATORS: tuple[str, ...] = tuple(name for name, e in ESTIMATORS.items() if e.scale_rewards is not None)


def estimator_descriptions() -> str:
    """The estimators as the config reference describes them."""
    return "; ".join(f"'{e.name}': {e.summary}" for e in ESTIMATORS.values())


# The pipeline run's MLflow tag naming what trained its policy (`objective_label`'s value, or 'DPO'): the summary's
# lines, a column of the MLflow view (MLflow shows tag columns after the metrics and parameters) and a study's arms
# read it.
OBJECTIVE_LABEL_TAG = "rlhf.objective_label"


def objective_label(estimator: str, importance_sampling_level: str = "token") -> str:
    """What the summary and the study call an estimator with its importance ratio: 'GRPO', 'GSPO' (GRPO with
    sequence-level ratios), 'RLOO (sequence)' (RLOO with the whole response's ratio, as TRL's RLOOTrainer), ..."""
    label = ESTIMATORS[estimator].label
    if importance_sampling_level == "sequence":
        return "GSPO" if estimator == "grpo" else f"GSPO ({label} advantages)"
    if importance_sampling_level == "sequence_sum":
        return f"{label} (sequence)"
    return label
