"""Evaluation generation: the PPO policy against the SFT policy on held-out prompts.

Besides scores, KL and win rates, it reports each policy's response lengths and empty answers, win rates at
equal length, and flags a gain over SFT that length or empty answers explain (``rlhf.eval.length_control``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from rlhf.checkpoints import atomic_dir, write_manifest
from rlhf.config import EvalConfig, PPOConfig, RewardConfig, RuntimeConfig
from rlhf.data.formats import ChatRenderer
from rlhf.eval import benchmark, length_control
from rlhf.eval.overoptimisation import OveroptimisationAlarm, ensemble_stats, response_stats, surprisal_stats
from rlhf.eval.responses import eval_prompts, generate_and_score_prompts
from rlhf.eval.sft_side import SFTSide, read_sft_side, write_sft_side
from rlhf.metrics import (
    EVAL_GOLD_PREFIX,
    EVAL_HACKING_EMPTY,
    EVAL_HACKING_LENGTH,
    EVAL_KL,
    EVAL_N_LEN_MATCHED,
    EVAL_N_PROMPTS,
    EVAL_OVEROPTIMISATION_FLAG,
    EVAL_POLICY_GOLD,
    EVAL_POLICY_SCORE,
    EVAL_SFT_GOLD,
    EVAL_SFT_SCORE,
    EVAL_TIE_RATE_GOLD,
    EVAL_WIN_RATE_GOLD,
    EVAL_WIN_RATE_RM,
    REWARD_FUNCTION_PREFIX,
)
from rlhf.models.device import autocast, resolve_device, run_dtype
from rlhf.models.loading import load_causal_lm, load_options, load_tokenizer
from rlhf.models.reward_ensemble import ensemble_objective, in_distribution_std, load_reward, member_tokenizers
from rlhf.models.stop_tokens import stop_token_ids
from rlhf.rollout.batching import pad_left
from rlhf.rollout.generation import GenerationSettings, sample_responses
from rlhf.rollout.prompt_fit import fit_prompts
from rlhf.rollout.reward_function import reward_function
from rlhf.rollout.rows import RowColumns
from rlhf.rollout.scoring import ScoringModels
from rlhf.rollout.static_decode import resolve_decode
from rlhf.tracking.metrics_writer import GoldFn, LogFn


@dataclass
class EvalResult:
    folder: str
    digest: str
    summary: dict[str, float]
    warnings: list[str] = field(default_factory=list)  # sentences, one per reward-hacking flag set
    sft_reused: bool = False  # the SFT policy's side was read from an earlier run's (`rlhf.eval.sft_side`)

    @property
    def completions(self) -> Path:
        return Path(self.folder) / "completions.parquet"

    @property
    def benchmark_files(self) -> list[Path]:
        """Each benchmark's report (benchmark-<name>.md) and per-instruction verdicts (benchmark-<name>.parquet)."""
        return sorted(Path(self.folder).glob("benchmark-*"))


def read_benchmarks(cfg: EvalConfig) -> list[benchmark.BenchmarkRows]:
    """The rows of each of eval.benchmarks, checked (one sentence naming the file and line otherwise)."""
    return [benchmark.read_benchmark(b.name, b.path, b.verifier, b.n_prompts) for b in cfg.benchmarks]


@torch.no_grad()
def benchmark_responses(
    policy: torch.nn.Module,
    tokenizer,
    rows: benchmark.BenchmarkRows,
    settings: GenerationSettings,
    max_prompt_tokens: int,
    batch_size: int,
    generator: torch.Generator,
    dtype: torch.dtype,
    progress: bool = False,
) -> pd.DataFrame:
    """One policy's responses to a benchmark's prompts (each the user turn of a conversation, rendered with the
    tokenizer's chat template): key, response, length (tokens before the stop token)."""
    chat = ChatRenderer(tokenizer)
    rendered = [chat.prompt([{"role": "user", "content": prompt}]) for prompt in rows.prompts]
    device = generator.device
    texts, lengths = [], []
    for start in tqdm(range(0, len(rendered), batch_size), desc=rows.name, disable=not progress):
        ids = fit_prompts(tokenizer, rendered[start : start + batch_size], max_prompt_tokens).ids
        query, query_mask = (t.to(device) for t in pad_left(ids, tokenizer.pad_token_id))
        with autocast(device, dtype):
            resp = sample_responses(policy, query, query_mask, settings, generator)
        texts += tokenizer.batch_decode(  # as a reward function reads them (rlhf.rollout.scoring.function_scores)
            resp.tokens.masked_fill(resp.mask == 0, tokenizer.pad_token_id), skip_special_tokens=True
        )
        lengths += (resp.mask.sum(1) - resp.contains_stop.long()).tolist()
    return pd.DataFrame({"key": rows.keys, "response": texts, "length": lengths})


def score_benchmark(
    rows: benchmark.BenchmarkRows, answers: dict[str, pd.DataFrame], tolerance: float
) -> tuple[dict[str, float], pd.DataFrame]:
    """A benchmark's figures as metric keys (``rlhf.eval.benchmark``) and its responses with their per-instruction
    verdicts (one row per prompt and policy)."""
    scored = {name: benchmark.score_rows(rows, frame["response"].tolist()) for name, frame in answers.items()}
    figures = benchmark.figures(scored)
    lengths = {name: frame["length"].tolist() for name, frame in answers.items()}
    figures |= benchmark.length_controlled(scored, lengths, rows.keys, tolerance)
    table = benchmark.by_type(scored)
    verdicts = pd.concat(
        [
            frame.assign(policy=name, prompt=rows.prompts, instruction_id_list=rows.instruction_ids).merge(
                scored[name]
                .groupby("key", sort=False)
                .agg(strict=("strict", list), loose=("loose", list))
                .reset_index(),
                on="key",
            )
            for name, frame in answers.items()
        ]
    )
    return benchmark.metrics(rows.name, figures, table), verdicts


def benchmark_markdown(summary: dict[str, float], name: str) -> str:
    """A benchmark's report: its figures in words and the table by instruction type (the stage's .md artifact)."""
    lines = benchmark.report_lines(summary, name)
    return "\n".join(
        [
            f"# {name}",
            "",
            "```",
            *lines,
            "```",
            "",
            benchmark.type_table_markdown(benchmark.type_table(summary, name)),
            "",
        ]
    )


def evaluate_policies(
    cfg: EvalConfig,
    ppo_cfg: PPOConfig,
    runtime: RuntimeConfig,
    policy_path: str,
    sft_path: str,
    reward_path: str | None,
    eval_file: str | Path,
    out_dir: str | Path,
    gold_fn: GoldFn | None,
    log: LogFn,
    reward_cfg: RewardConfig | None = None,
    reward_is_gold: bool = False,
    sft_side: str | Path | None = None,
) -> EvalResult:
    """Generate with the trained and the SFT policies (same prompts, same seed) and compare them. The score is the
    reward model's at `reward_path`, the reward function of `reward_cfg` (reward.source: function, `reward_path`
    None), or the model's plus the weighted function (reward.function_weight), as in training. `reward_is_gold`:
    that function is the data's gold reward itself (`RewardConfig.is_the_gold`), which the alarm's check says.
    `sft_side`: the folder of the SFT policy's side for exactly these inputs (`rlhf.eval.sft_side`), read where an
    earlier run wrote it, else written."""
    device = resolve_device(runtime.device)
    trust_remote_code = runtime.trust_remote_code
    benchmarks = read_benchmarks(cfg)  # a bad benchmark file stops the stage before any model loads
    tokenizer = load_tokenizer(policy_path, trust_remote_code=trust_remote_code)
    reward_tokenizer = (
        tokenizer if reward_path is None else load_tokenizer(reward_path, trust_remote_code=trust_remote_code)
    )
    frozen = load_options(runtime, device, trainable=False)
    reference = load_causal_lm(sft_path, device, **frozen).eval()
    objective = ensemble_objective(reward_cfg)
    reward = None if reward_path is None else load_reward(reward_path, device, *objective, **frozen)
    reward_fn, reward_fn_weight = reward_function(reward_cfg, RowColumns.read(eval_file))
    settings = GenerationSettings(
        cfg.max_new_tokens or ppo_cfg.max_new_tokens,
        cfg.temperature or ppo_cfg.temperature,
        ppo_cfg.top_k,
        ppo_cfg.top_p,
        stop_token_ids(tokenizer, ppo_cfg.stop_tokens, reference.config, reference.generation_config),
        tokenizer.pad_token_id,
        resolve_decode(ppo_cfg.generation.decode, device),
    )
    readers = None if reward_path is None else member_tokenizers(reward_path, tokenizer, trust_remote_code)
    same_tokenizer = readers is None or all(reader is None for reader in readers)
    dtype = run_dtype(runtime, device)
    prompts, keys = eval_prompts(eval_file, cfg.n_prompts)
    frames = {}
    answers: dict[str, dict[str, pd.DataFrame]] = {rows.name: {} for rows in benchmarks}
    reused = read_sft_side(sft_side, list(answers))
    if reused is not None:
        frames["sft"] = reused.responses
        for name, frame in reused.answers.items():
            answers[name]["sft"] = frame
    for name, path in (("sft", sft_path), ("policy", policy_path)):
        if name in frames:  # the SFT side, read
            continue
        policy = reference if name == "sft" else load_causal_lm(path, device, **frozen).eval()
        models = ScoringModels(
            policy,
            reference,
            reward,
            tokenizer,
            reward_tokenizer,
            same_tokenizer,
            reward_fn=reward_fn,
            reward_fn_weight=reward_fn_weight,
            member_tokenizers=readers,
        )  # fmt: skip (no value model)
        generator = torch.Generator(device=device).manual_seed(cfg.seed)  # the same seed for both policies
        frames[name] = generate_and_score_prompts(
            models, prompts, settings, ppo_cfg.max_prompt_tokens, cfg.batch_size, generator, dtype, runtime.progress,
            keys,
        )  # fmt: skip
        for rows, bench_cfg in zip(benchmarks, cfg.benchmarks, strict=True):
            bench_settings = replace(settings, max_new_tokens=bench_cfg.max_new_tokens or settings.max_new_tokens)
            answers[rows.name][name] = benchmark_responses(
                policy, tokenizer, rows, bench_settings, bench_cfg.max_prompt_tokens, cfg.batch_size,
                generator.manual_seed(cfg.seed), dtype, runtime.progress,
            )  # fmt: skip
        if name == "sft" and sft_side is not None:
            write_sft_side(sft_side, SFTSide(frames["sft"], {bench: sides["sft"] for bench, sides in answers.items()}))
    table, summary, warnings = summarize(prompts, frames["sft"], frames["policy"], gold_fn, cfg.length_tolerance)
    tables = {}
    for rows in benchmarks:
        figures, tables[rows.name] = score_benchmark(rows, answers[rows.name], cfg.length_tolerance)
        summary |= figures
    signs, alarm = overoptimisation_signs(
        frames["sft"], frames["policy"], in_distribution_std(reward), verified=reward_is_gold
    )
    summary |= signs
    warnings += alarm
    log(summary, 0)
    with atomic_dir(out_dir) as tmp:
        table.to_parquet(tmp / "completions.parquet", index=False)
        for name, responses in tables.items():
            responses.to_parquet(tmp / f"benchmark-{name}.parquet", index=False)
            (tmp / f"benchmark-{name}.md").write_text(benchmark_markdown(summary, name))
        manifest = write_manifest(tmp, stage="evaluate", summary=summary, warnings=warnings)
    return EvalResult(str(out_dir), manifest["digest"], summary, warnings, sft_reused=reused is not None)


def overoptimisation_signs(
    sft: pd.DataFrame, policy: pd.DataFrame, in_distribution_std: float, verified: bool = False
) -> tuple[dict[str, float], list[str]]:
    """The signs of a gamed reward model that need no gold reward (`rlhf.eval.overoptimisation`): each policy's
    diversity and, with an ensemble, its members' view, as eval/<policy>_<stat>; and the alarm's rule applied to the
    trained policy against the SFT policy (eval/overoptimisation_flag, and its warning: where the reward is a
    verifier, `verified`, what was seen rather than a gamed reward model)."""
    alarm = OveroptimisationAlarm(in_distribution_std, surprisal_waits_for_stall=False, confirm=1)
    summary: dict[str, float] = {}
    for name, frame in (("sft", sft), ("policy", policy)):
        stats = {**response_stats(frame["response"].tolist()), **surprisal_stats(frame)}
        stats |= ensemble_stats(frame, in_distribution_std)
        summary |= {f"eval/{name}_{key}": value for key, value in stats.items()}
        fired = alarm.check(int(name == "policy"), stats)
    summary[EVAL_OVEROPTIMISATION_FLAG] = float(fired is not None)
    if fired is None:
        return summary, []
    seen = "; ".join(fired.reasons)
    if verified:
        return summary, [
            f"the trained policy's responses moved far from the SFT policy's ({seen}); its reward is the verifier, "
            "so its verified scores above say whether that paid (docs/overoptimisation.md)"
        ]
    return summary, [
        f"the trained policy's responses show signs of a gamed reward model against the SFT policy's ({seen}): its "
        "score may rise while its quality falls (docs/overoptimisation.md)"
    ]


def summarize(
    prompts: list[str], sft: pd.DataFrame, policy: pd.DataFrame, gold_fn: GoldFn | None, length_tolerance: float
) -> tuple[pd.DataFrame, dict[str, float], list[str]]:
    """The completions table, the summary metrics and the reward-hacking warnings of two policies' generations.

    `sft` and `policy` (the trained policy: PPO, a critic-free estimator or DPO) have one row per prompt: response,
    score, kl, length (tokens before the stop token), stopped, and row (the row's key, which the gold reward reads its
    columns by; None where absent).
    """
    empty = {
        name: length_control.is_empty(f["length"], f["response"]) for name, f in (("sft", sft), ("policy", policy))
    }
    table = pd.DataFrame(
        {
            "prompt": prompts,
            "sft_response": sft["response"],
            "policy_response": policy["response"],
            "sft_score": sft["score"],
            "policy_score": policy["score"],
            "policy_kl": policy["kl"],
            "sft_length": sft["length"],
            "policy_length": policy["length"],
            "sft_empty": empty["sft"],
            "policy_empty": empty["policy"],
        }
    )
    for column in (c for c in policy.columns if c.startswith(REWARD_FUNCTION_PREFIX)):  # each reward function's
        name = column.removeprefix(REWARD_FUNCTION_PREFIX)
        table[f"sft_reward_{name}"], table[f"policy_reward_{name}"] = sft[column], policy[column]
    summary = {
        **{
            f"eval/{who}_{column}": float(frame[column].mean())
            for who, frame in (("policy", policy), ("sft", sft))
            for column in frame.columns
            if column.startswith(REWARD_FUNCTION_PREFIX)
        },
        EVAL_N_PROMPTS: float(len(prompts)),
        EVAL_POLICY_SCORE: float(policy["score"].mean()),
        EVAL_SFT_SCORE: float(sft["score"].mean()),
        EVAL_WIN_RATE_RM: float(np.mean(policy["score"] > sft["score"])),
        EVAL_KL: float(policy["kl"].mean()),
    }
    for name, frame in (("policy", policy), ("sft", sft)):
        stats = length_control.length_stats(frame["length"], empty[name])
        summary |= {f"eval/{name}_{k}": v for k, v in stats.items()}
        summary[f"eval/{name}_stop_rate"] = float(frame["stopped"].mean())
    controls = {}

    def add_length_control(key: str, name: str, policy_scores, sft_scores) -> None:
        c = length_control.length_control(policy_scores, sft_scores, policy["length"], sft["length"], length_tolerance)
        controls[name] = c
        summary[f"eval/win_rate_{key}_len_controlled"] = c.controlled_win_rate
        if c.n_matched:  # undefined without a length-matched pair: left out rather than NaN
            summary[f"eval/win_rate_{key}_len_matched"] = c.matched_win_rate
        summary[EVAL_N_LEN_MATCHED] = float(c.n_matched)

    add_length_control("rm", "reward-model score", policy["score"], sft["score"])
    if gold_fn is not None:
        for who, frame in (("sft", sft), ("policy", policy)):
            keys = frame.get("row", [None] * len(frame))
            table[f"{who}_gold"] = [gold_fn(*row) for row in zip(prompts, frame["response"], keys, strict=True)]
        summary.update(
            {
                EVAL_POLICY_GOLD: float(table["policy_gold"].mean()),
                EVAL_SFT_GOLD: float(table["sft_gold"].mean()),
                EVAL_WIN_RATE_GOLD: float(np.mean(table["policy_gold"] > table["sft_gold"])),
                EVAL_TIE_RATE_GOLD: float(np.mean(table["policy_gold"] == table["sft_gold"])),
            }
        )
        # the held-out gold's 95% intervals and the paired gain (a verifiable task: the held-out accuracy)
        intervals = benchmark.mean_intervals(table["policy_gold"].to_numpy(), table["sft_gold"].to_numpy())
        summary |= {f"{EVAL_GOLD_PREFIX}{key}": value for key, value in intervals.items()}
        add_length_control("gold", "gold reward", table["policy_gold"], table["sft_gold"])
    verdict = length_control.hacking_verdict(
        controls, policy["length"], sft["length"], empty["policy"], empty["sft"], policy["score"]
    )
    summary[EVAL_HACKING_LENGTH] = float(verdict.length)
    summary[EVAL_HACKING_EMPTY] = float(verdict.empty)
    return table, summary, verdict.warnings
