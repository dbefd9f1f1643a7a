"""Every metric name the pipeline logs to MLflow, declared once: its key and what it means.

The stages log these keys (the ones written in several modules are the constants below); docs/metrics.md's tables
are generated from the groups (`metric_tables`, `rlhf docs --write`) and a test checks that every metric key in the
code is declared here. A key may hold a `<placeholder>` (``data/dropped_<reason>``). `RENAMED_METRICS` lists the
keys renamed in this release (docs/metrics.md's changelog); `current_metric_name` maps an old key (a sweep space's
objective, a comparison) to its new name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Metric:
    keys: tuple[str, ...]  # one key, or several that share a meaning (`_std`, `_min`, `_max` of one figure)
    meaning: str


@dataclass(frozen=True)
class MetricGroup:
    name: str  # the group's marker in docs/metrics.md: <!-- metrics:NAME -->
    metrics: tuple[Metric, ...]


def _group(name: str, *rows: tuple[str | tuple[str, ...], str]) -> MetricGroup:
    return MetricGroup(name, tuple(Metric((k,) if isinstance(k, str) else k, m) for k, m in rows))


# Keys written in more than one module (the stages, the summary, sweeps, rankings, the MLflow view).
EVAL_POLICY_SCORE, EVAL_SFT_SCORE = "eval/policy_score", "eval/sft_score"
EVAL_POLICY_GOLD, EVAL_SFT_GOLD = "eval/policy_gold", "eval/sft_gold"
EVAL_GOLD_PREFIX = "eval/gold_"  # the gold's intervals and gain: eval/gold_policy_lo ... eval/gold_gain_hi
EVAL_KL = "eval/kl"
EVAL_WIN_RATE_RM, EVAL_WIN_RATE_GOLD = "eval/win_rate_rm", "eval/win_rate_gold"
EVAL_TIE_RATE_GOLD = "eval/tie_rate_gold"
EVAL_WIN_RATE_RM_LC, EVAL_WIN_RATE_GOLD_LC = "eval/win_rate_rm_len_controlled", "eval/win_rate_gold_len_controlled"
EVAL_POLICY_LENGTH, EVAL_SFT_LENGTH = "eval/policy_length_mean", "eval/sft_length_mean"
EVAL_POLICY_EMPTY, EVAL_POLICY_STOP = "eval/policy_empty_rate", "eval/policy_stop_rate"
EVAL_HACKING_LENGTH, EVAL_HACKING_EMPTY = "eval/hacking_flag_length", "eval/hacking_flag_empty"
EVAL_OVEROPTIMISATION_FLAG = "eval/overoptimisation_flag"
EVAL_N_PROMPTS, EVAL_N_LEN_MATCHED = "eval/n_prompts", "eval/n_len_matched"
PERIODIC_EVAL = "periodic_eval/"  # the prefix of PPO's periodic evaluation
REWARD_FUNCTION_PREFIX = "rewards/"  # each reward function's own statistics: rewards/<name>/mean, /std
PERIODIC_SCORE, PERIODIC_GOLD, PERIODIC_KL = "periodic_eval/score", "periodic_eval/gold", "periodic_eval/kl"
PERIODIC_REF_SURPRISAL = "periodic_eval/ref_surprisal"
REWARD_BEST_EVAL_ACCURACY = "reward/best_eval_accuracy"
OBJECTIVE_SCORES, OBJECTIVE_KL = "objective/scores", "objective/kl"
OBJECTIVE_KL_COEF, OBJECTIVE_GOLD = "objective/kl_coef", "objective/gold_score"
OBJECTIVE_RLHF_REWARD = "objective/rlhf_reward"
POLICY_APPROXKL, POLICY_CLIPFRAC = "policy/approxkl", "policy/clipfrac"
EPISODES_PER_S = "speed/episodes_per_s"
PEAK_MEMORY = "memory/peak_mb"
TIME_POLICY_TRAIN = "time/policy_train"  # the policy stage's wall time, on the pipeline run
TIME_TRAIN = "time/train"  # a policy stage's wall time (of the attempt that finished it), in its output's metrics
WARM_START_PROMPTS, WARM_START_SAMPLES = "warm_start/prompts", "warm_start/samples"
WARM_START_KEPT, WARM_START_KEPT_FRACTION = "warm_start/kept", "warm_start/kept_fraction"
WARM_START_PROMPTS_KEPT, WARM_START_MEAN_SCORE = "warm_start/prompts_with_a_kept_response", "warm_start/mean_score"
WARM_START_RESPONSE_TOKENS = "warm_start/response_tokens"
WARM_START_KEPT_RESPONSE_TOKENS = "warm_start/kept_response_tokens"
WARM_START_SAMPLING_TIME = "warm_start/sampling_time"

# The groups: one row a metric, its keys then what they mean (a table, kept as one).
# fmt: off
PPO_UPDATE = _group(
    "ppo",
    ("objective/kl", "mean over the batch of the sequence KL: sum over response tokens of the chosen estimator of "
     "`logp - ref_logp`"),
    ("objective/kl_coef", "KL coefficient used for this update's rewards (or its KL loss, with `ppo.kl_in: loss`)"),
    (("objective/logprobs", "objective/ref_logprobs"), "mean per-token log-prob of the response under the policy / "
     "reference"),
    ("objective/entropy", "mean sequence entropy estimate: `mean(sum_t -logp_t)`"),
    ("objective/non_score_reward", "mean of `sum_t -kl_coef * kl_t`"),
    (("objective/scores", "objective/scores_std", "objective/scores_min", "objective/scores_max"),
     "scores of the responses before shaping: the reward model's, a reward function's, or their weighted sum"),
    ("objective/shaped_scores", "scores after clipping and penalties (missing stop token, short response, DAPO's "
     "overlong penalty)"),
    ("objective/rlhf_reward", "mean of shaped score + non-score reward (what PPO maximises)"),
    ("objective/stop_rate", "fraction of responses that produced a stop token"),
    ("objective/gold_score", "mean gold reward of the rollouts (only for data sets with a gold reward)"),
    (("policy/loss", "value/loss", "loss/total"), "clipped policy loss, clipped value loss `0.5 mean(max((V-R)^2, "
     "(Vclip-R)^2))`, `policy + vf_coef * value - entropy_coef * entropy` (`+ kl_coef * policy/kl_loss` with the KL "
     "in the loss; means over minibatches and epochs)"),
    ("policy/kl_loss", "with the KL in the loss (`ppo.kl_in: loss`, the default of grpo and dr_grpo): the KL term of "
     "the policy loss, the chosen estimator between the current policy and the reference, aggregated like the loss"),
    ("policy/entropy", "mean per-token entropy of the policy in the optimisation pass"),
    ("policy/approxkl", "`0.5 * mean(d^2)` with `d = logp_new - logp_old`"),
    ("policy/policykl", "`mean(-d)`"),
    ("policy/clipfrac", "fraction of tokens where the clipped policy objective is active"),
    ("policy/seq_clipfrac", "with a sequence-level ratio (`ppo.importance_sampling_level: sequence` (GSPO) or "
     "`sequence_sum`): share of the responses whose clipped objective is active"),
    (("policy/ratio_mean", "policy/ratio_var"), "mean and variance of the token ratios `exp(d)`"),
    ("policy/early_stopped", "1 when the epochs stopped early at `ppo.target_kl`"),
    ("policy/held", "1 in the critic's warmup (`ppo.critic_warmup`): the update trained the value model alone"),
    ("value/clipfrac", "fraction of tokens where the clipped value loss is active"),
    ("value/error", "`mean((V - R)^2)`"),
    ("advantages/mean", "mean raw advantage (before whitening): GAE's, or the critic-free estimator's"),
    (("returns/mean", "returns/var"), "GAE returns `A + V`"),
    (("value/mean", "value/var"), "value estimates of the rollout"),
    ("value/explained_variance", "`1 - var(R - V) / var(R)`"),
    (("policy/grad_norm", "value/grad_norm"), "gradient norms before clipping (mean over optimizer steps)"),
    (("policy/lr", "value/lr"), "learning rates after this update's scheduler step"),
    (("tokens/query_len_mean", "tokens/query_len_std", "tokens/response_len_mean", "tokens/response_len_std"),
     "prompt and response lengths in tokens"),
    ("time/generate", "seconds sampling responses"),
    ("time/decode_compile", "with `ppo.generation.decode: compiled` (the default on CUDA): seconds of the update's "
     "generation spent compiling the decoding step (0 once compiled), included in `time/generate`"),
    ("time/weight_sync", "with `ppo.generation.backend: vllm`: seconds pushing the updated weights into vLLM"),
    ("time/score", "seconds of the no-grad forwards: policy, reference, value and reward model"),
    ("time/advantages", "seconds shaping scores, computing per-token rewards and advantages"),
    ("time/optimize", "seconds of the PPO epochs"),
    (("time/stats", "time/total"), "seconds computing statistics and records; the whole update"),
    (("speed/episodes_per_s", "speed/tokens_per_s"), "prompt/response pairs and response tokens per second"),
    ("memory/peak_mb", "peak GPU memory where there is one, else peak process RSS"),
    (("dist/kl_<p>", "dist/scores_<p>", "dist/response_len_<p>", "dist/advantages_<p>", "dist/ratio_<p>"),
     "5th/50th/95th percentiles (`<p>`: p05, p50, p95) of the sequence KL, scores, lengths, advantages (tokens) and "
     "ratios (tokens)"),
    ("group/reward_std", "critic-free estimators with groups: mean over the batch's groups of the (unbiased) std of "
     "the group's rewards"),
    ("group/distinct_responses", "critic-free estimators with groups: mean over the batch's groups of the share "
     "of the group's responses that differ from each other (1: every sample of the prompt is its own)"),
    ("group/zero_std_fraction", "share of the groups whose rewards are all equal (advantage 0); with dynamic "
     "sampling, of the batch trained on"),
    ("group/zero_std_fraction/<category>", "where the reward function sorts its rows into categories (its "
     "`categories` attribute; IFEval's and IFBench's verifiers: each instruction type, ':' written '.'): the share of "
     "the groups of that category's prompts whose rewards are all equal, in the update's first generation round "
     "(what the policy never or always gets right)"),
    ("dynamic_sampling/dropped_groups", "with DAPO's dynamic sampling: groups whose shaped scores were all equal, "
     "over every generation round of the update"),
    ("dynamic_sampling/extra_rounds", "generation rounds after the first that refilled the batch with new prompts"),
    ("dynamic_sampling/filled_groups", "groups without spread put back after the last round to keep the batch's size"),
    ("dynamic_sampling/generated_episodes", "episodes sampled in the update, every round together"),
    (("rewards/<name>/mean", "rewards/<name>/std"), "with reward functions (reward.functions, or reward.function "
     "as a list of one): each function's own score over the update's responses, before its weight (`<name>`: the "
     "callable's name); the pipeline's summary names each with its last mean"),
    (("ensemble/mean", "ensemble/std", "ensemble/min", "ensemble/disagreement_ratio"),
     "with a reward-model ensemble: the periodic evaluation's `periodic_eval/ensemble_*` statistics on the training "
     "samples"),
    ("ppo/prompts_truncated_fraction", "(first update) the share of prompts cut to `ppo.max_prompt_tokens`"),
    ("ppo/skipped_nonfinite", "with `runtime.on_nonfinite: skip_update`: the steps skipped so far"),
    (("overoptimisation/alarm_step", "overoptimisation/kept_step"), "(end of the stage) the update after which the "
     "over-optimisation alarm fired, and the update whose policy was kept as final (-1: never / the last)"),
)

PERIODIC_EVALUATION = _group(
    "periodic_eval",
    ("periodic_eval/score", "mean reward-model score of the responses"),
    ("periodic_eval/score_std", "the scores' spread across the prompts (population std)"),
    ("periodic_eval/gold", "mean gold reward (data with a gold reward only)"),
    (("periodic_eval/kl", "periodic_eval/sqrt_kl"), "KL to the SFT policy, as `eval/kl`, and its square root"),
    ("periodic_eval/length_mean", "mean response length in tokens"),
    (("periodic_eval/rewards/<name>/mean", "periodic_eval/rewards/<name>/std"), "with reward functions: each "
     "function's own score of the held-out responses, as `rewards/<name>/*` on the training samples"),
    ("periodic_eval/ref_surprisal", "the reference (SFT) model's surprisal at the response tokens, -log p_ref, in nats "
     "per token (over all the responses' tokens; the over-optimisation alarm's surprisal condition)"),
    ("periodic_eval/distinct_2", "distinct word bigrams over all bigrams of the responses (distinct-2)"),
    ("periodic_eval/identical_share", "share of the responses that are word for word another prompt's response"),
    ("periodic_eval/near_identical_share", "share of the responses whose word bigrams overlap another prompt's "
     "response's by 80% or more (Jaccard)"),
    ("periodic_eval/repetition", "mean share of a response's bigrams that repeat an earlier bigram of it"),
    (("periodic_eval/ensemble_mean", "periodic_eval/ensemble_std", "periodic_eval/ensemble_min"),
     "an ensemble's members (less their offsets): their mean score, std and minimum, each a mean over the responses"),
    ("periodic_eval/disagreement_ratio", "`periodic_eval/ensemble_std` over the members' std on held-out chosen "
     "responses (`reward_ensemble/disagreement_chosen`)"),
    ("periodic_eval/overoptimisation_alarm", "1 at the evaluation where the over-optimisation alarm fired, else 0"),
    ("periodic_eval/overoptimisation_sign", "1 where the evaluation shows the alarm's rule (confirmed or not) or the "
     "surprisal's evidence, so that `stop` and `keep_best` never keep its policy; 0 where it is quiet"),
)

DPO = _group(
    "dpo",
    ("dpo/loss", "the DPO (or IPO) loss of the batch"),
    (("dpo/rewards/chosen", "dpo/rewards/rejected"), "mean implicit reward `beta * (logp_policy - logp_ref)` of the "
     "chosen / rejected responses"),
    ("dpo/rewards/margin", "mean of chosen minus rejected implicit reward"),
    ("dpo/rewards/accuracy", "share of pairs whose chosen response has the higher implicit reward"),
    (("dpo/logps/chosen", "dpo/logps/rejected"), "mean policy log-prob of the chosen / rejected responses"),
    (("dpo/lr", "dpo/grad_norm"), "learning rate; gradient norm before clipping"),
    (("dpo/eval/loss", "dpo/eval/rewards/<name>", "dpo/eval/logps/<name>"), "every `dpo.eval_every` steps and at the "
     "last: the same statistics on the held-out pairs"),
    (("dpo/dropped_too_long", "dpo/dropped_too_long_fraction", "dpo/train_dropped_too_long",
      "dpo/eval_dropped_too_long", "dpo/truncated_fraction"),
     "(first and last step) what the length limit left out or cut (`dpo.truncation`)"),
    (("time/dpo", "time/dpo_reference"), "(last step) the stage's training time, the reference pass included; the "
     "reference log-probs' time"),
    ("dpo/skipped_nonfinite", "with `runtime.on_nonfinite: skip_update`: the steps this process skipped so far"),
)

REWARD = _group(
    "reward",
    (("reward/train/loss", "reward/train/accuracy", "reward/train/margin"), "every step, on the training batch: the "
     "pairwise loss, the share of pairs ordered right, the mean chosen-minus-rejected score"),
    (("reward/train/chosen_mean", "reward/train/chosen_std", "reward/train/rejected_mean", "reward/train/rejected_std"),
     "the scores of the chosen and rejected responses of the batch"),
    (("reward/train/grad_norm", "reward/train/lr", "reward/train/skipped_nonfinite"),
     "gradient norm, learning rate, and the skipped steps with `runtime.on_nonfinite: skip_update`"),
    ("reward/eval/<name>", "every `reward.eval_every` steps and at the last: the same statistics (`loss`, `accuracy`, "
     "`margin`, `chosen_mean`, ...) on the held-out pairs"),
    (("reward/best_eval_accuracy", "reward/best_step"), "(last step) the held-out accuracy of the kept checkpoint "
     "(the best one) and its step; the pipeline run's summary holds it too"),
    ("time/reward", "(last step) the stage's training time"),
    (("reward/dropped_too_long", "reward/truncated_fraction"), "what the length limit left out or cut"),
)

REWARD_ENSEMBLE = _group(
    "reward_ensemble",
    ("reward_ensemble/member_<k>_accuracy", "each member's held-out accuracy"),
    (("reward_ensemble/accuracy_mean", "reward_ensemble/accuracy_uwo", "reward_ensemble/accuracy_wco"),
     "the ensemble's held-out accuracy under each objective"),
    ("reward_ensemble/accuracy", "the configured objective's (also the pipeline's `reward/best_eval_accuracy`)"),
    ("reward_ensemble/agreement", "the share of pairs every member orders alike"),
    (("reward_ensemble/disagreement_chosen", "reward_ensemble/disagreement_rejected"),
     "the members' std on the chosen and the rejected responses after their offsets, mean over pairs"),
    (("reward_ensemble/members", "time/reward_ensemble"), "the number of members; the ensemble stage's time"),
)

WARM_START = _group(
    "warm_start",
    ((WARM_START_PROMPTS, WARM_START_SAMPLES), "the training prompts sampled for, and the responses sampled (prompts "
     "x `warm_start.samples`)"),
    ((WARM_START_KEPT, WARM_START_KEPT_FRACTION), "the responses kept (scored at least `warm_start.min_score`, at "
     "most `warm_start.keep_per_prompt` distinct ones a prompt), and their share of the samples"),
    (WARM_START_PROMPTS_KEPT, "the prompts with at least one kept response"),
    (WARM_START_MEAN_SCORE, "the reward function's mean score over every sample"),
    ((WARM_START_RESPONSE_TOKENS, WARM_START_KEPT_RESPONSE_TOKENS), "mean response tokens (the stop token included) "
     "of every sample and of the kept ones"),
    (WARM_START_SAMPLING_TIME, "seconds sampling and scoring (logged by the attempt that sampled; a retry reads the "
     "samples)"),
)

SFT = _group(
    "sft",
    (("sft/loss", "sft/grad_norm", "sft/lr"), "step 1, every 10th step, the last and any skipped one"),
    ("sft/skipped_nonfinite", "with `runtime.on_nonfinite: skip_update`: the steps skipped so far"),
    (("sft/truncated_fraction", "sft/response_truncated_fraction", "sft/prompt_lost_fraction"),
     "(first step) the shares cut by `sft.max_length`"),
    (("sft/final_loss", "time/sft"), "(last step) the last loss and the stage's training time"),
)

DATA = _group(
    "data",
    (("data/rows_<split>", "data/dropped_<reason>"), "rows written per split; rows dropped per reason"),
    (("data/over_<limit>_fraction", "data/<role>_<unit>_<stat>"), "the length report: the share over each limit, and "
     "length percentiles (`data/prompt_tokens_p50`, ...)"),
)

EVALUATION = _group(
    "eval",
    (("eval/policy_score", "eval/sft_score"), "mean reward-model score of the trained policy's / the SFT policy's "
     "responses"),
    ("eval/win_rate_rm", "share of prompts where the trained policy's response scores higher than the SFT one's"),
    ("eval/kl", "KL of the trained policy to the SFT policy on its own responses"),
    (("eval/policy_gold", "eval/sft_gold", "eval/win_rate_gold", "eval/tie_rate_gold"),
     "with a gold reward: the mean gold rewards, the strict win rate and the tie rate"),
    (("eval/gold_policy_lo", "eval/gold_policy_hi", "eval/gold_sft_lo", "eval/gold_sft_hi"), "with a gold reward: "
     "the 95% bootstrap interval of each mean gold reward over the held-out prompts (2,000 resamples); with a "
     "verifier as the gold (a verifiable task), of the held-out accuracy"),
    (("eval/gold_gain", "eval/gold_gain_lo", "eval/gold_gain_hi"), "the trained policy's mean gold minus SFT's, "
     "with its paired 95% interval (the same resampled prompts for both)"),
    (("eval/policy_rewards/<name>", "eval/sft_rewards/<name>"), "with reward functions: each function's own mean "
     "score of the trained and the SFT policy's held-out responses (the completions' policy_reward_<name> and "
     "sft_reward_<name>)"),
    (("eval/<policy>_length_mean", "eval/<policy>_length_std", "eval/<policy>_empty_rate", "eval/<policy>_stop_rate"),
     "`<policy>`: policy or sft; lengths in tokens, share of empty answers, share that stopped"),
    (("eval/win_rate_<judge>_len_matched", "eval/win_rate_<judge>_len_controlled", "eval/n_len_matched"),
     "length-matched and length-controlled win rates (`<judge>`: rm or gold) and the matched pairs' count"),
    (("eval/hacking_flag_length", "eval/hacking_flag_empty"), "1 where the win looks like length or empty-answer "
     "reward hacking"),
    (("eval/<policy>_distinct_2", "eval/<policy>_identical_share", "eval/<policy>_near_identical_share",
      "eval/<policy>_repetition", "eval/<policy>_ref_surprisal",
      "eval/<policy>_ensemble_<stat>", "eval/<policy>_disagreement_ratio"), "the alarm's signs for each policy"),
    ("eval/overoptimisation_flag", "1: the alarm's rule fires on the trained policy against the SFT policy"),
    ("eval/n_prompts", "held-out prompts evaluated"),
)

PIPELINE = _group(
    "pipeline",
    (("memory/<stage>_estimate_mb", "memory/<stage>_peak_mb"), "the preflight estimate and the measured peak of the "
     "SFT, reward and policy stages"),
    ("time/policy_train", "the policy stage's wall time (PPO, a critic-free estimator or DPO)"),
    ("time/train", "a policy stage's wall time, in the stage's output (cached with it)"),
    (("budget/ppo_episodes", "budget/sft_steps"), "the run's budget, for the summary's plumbing-check note"),
)
# fmt: on

GROUPS: tuple[MetricGroup, ...] = (
    PPO_UPDATE,
    PERIODIC_EVALUATION,
    DPO,
    REWARD,
    REWARD_ENSEMBLE,
    WARM_START,
    SFT,
    DATA,
    EVALUATION,
    PIPELINE,
)

# old key (or prefix, ending in '/' or '_') -> new key (or prefix): renamed in this release
RENAMED_METRICS: dict[str, str] = {
    "eval/ppo_": "eval/policy_",
    "ppo_eval/": "periodic_eval/",
    "reward/eval_accuracy": "reward/best_eval_accuracy",
    "sft/seconds": "time/sft",
    "reward/seconds": "time/reward",
    "dpo/seconds": "time/dpo",
    "dpo/reference_seconds": "time/dpo_reference",
    "reward_ensemble/seconds": "time/reward_ensemble",
    "time/policy_train_s": "time/policy_train",
    "time/train_s": "time/train",
}


def current_metric_name(key: str) -> str:
    """`key` under its current name (an old name of `RENAMED_METRICS`, or `key` itself)."""
    for old, new in RENAMED_METRICS.items():
        if key == old or (old.endswith(("/", "_")) and key.startswith(old)):
            return new + key[len(old) :]
    return key


def earlier_metric_names(key: str) -> list[str]:
    """The names `key` had before the renames of `RENAMED_METRICS` (runs logged by an earlier release)."""
    names = []
    for old, new in RENAMED_METRICS.items():
        if key == new or (new.endswith(("/", "_")) and key.startswith(new)):
            names.append(old + key[len(new) :])
    return names


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(
        "^" + re.sub(r"<[a-z_]+>", "[a-z0-9_]+", re.escape(key).replace(r"\<", "<").replace(r"\>", ">")) + "$"
    )


def declared_keys() -> list[str]:
    return [key for group in GROUPS for metric in group.metrics for key in metric.keys]


def is_declared(key: str) -> bool:
    """Whether `key` is a declared metric (placeholders match any name)."""
    return any(_pattern(declared).match(key) for declared in declared_keys())


def metric_table(group: MetricGroup) -> str:
    """The group's markdown table, as docs/metrics.md shows it."""
    rows = ["| key | meaning |", "| --- | --- |"]
    rows += [f"| {', '.join(f'`{k}`' for k in m.keys)} | {m.meaning} |" for m in group.metrics]
    return "\n".join(rows)


def renamed_table() -> str:
    rows = ["| before | now |", "| --- | --- |"]
    rows += [
        f"| `{old}{'*' * old.endswith(('/', '_'))}` | `{new}{'*' * new.endswith(('/', '_'))}` |"
        for old, new in RENAMED_METRICS.items()
    ]
    return "\n".join(rows)


METRICS_PAGE = "docs/metrics.md"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- metrics:{name}:start -->", f"<!-- metrics:{name}:end -->"


def metrics_page(text: str, source: str = METRICS_PAGE) -> str:
    """`text` (docs/metrics.md) with every group's table, and the renamed metrics, regenerated between the page's
    markers (``<!-- metrics:ppo:start -->`` ... ``<!-- metrics:ppo:end -->``)."""
    for name, body in [(g.name, metric_table(g)) for g in GROUPS] + [("renamed", renamed_table())]:
        start, end = _markers(name)
        if start not in text or end not in text:
            raise ValueError(f"{source} has no {start} ... {end} markers to hold the {name} metrics")
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{body}\n{end}{tail}"
    return text


def update_metrics_page(path: str | Path = METRICS_PAGE) -> bool:
    """Write the metric tables into the page; True when it changed."""
    path = Path(path)
    text = path.read_text()
    new = metrics_page(text, str(path))
    if new != text:
        path.write_text(new)
    return new != text
