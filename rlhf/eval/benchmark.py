"""Instruction-following benchmarks of the evaluation stage: IFEval's and IFBench's verifiers on a prompt file.

A benchmark (``eval.benchmarks``) is a JSON-lines file in IFEval's layout (``key``, ``prompt``,
``instruction_id_list``, ``kwargs``: google/IFEval, allenai/IFBench_test and the real tier's held-out prompts all
have it), scored with one registry's checkers (``rlhf.data.verifiers``). The evaluation stage samples the SFT
policy and the trained policy on its prompts (the same seed) and reports the four figures the field reports:

- prompt-level accuracy: the share of prompts whose every instruction is followed, strict and loose;
- instruction-level accuracy: the share of instructions followed, strict and loose;

each with a 95% interval (a percentile bootstrap over prompts, 2,000 resamples, seeded), the trained policy's gain
over SFT with its paired interval, a table by instruction type (SFT against trained), and the length-controlled win
rate of the instruction-level strict share (``rlhf.eval.length_control``). Instructions whose checker needs NLTK data
that is not installed are left out and counted (``unscorable``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlhf.checkpoints import file_digest
from rlhf.data import verifiers
from rlhf.errors import DataError
from rlhf.eval import length_control

RESAMPLES = 2000
FIGURES = ("prompt_strict", "prompt_loose", "instruction_strict", "instruction_loose")
MIN_TYPE_PROMPTS = 20  # the per-type table flags a drop only on types with at least this many prompts


@dataclass(frozen=True)
class BenchmarkRows:
    """A benchmark file's rows: prompts with their instruction ids and kwargs."""

    name: str
    verifier: verifiers.Benchmark
    path: str
    keys: list[str]
    prompts: list[str]
    instruction_ids: list[list[str]]
    kwargs: list[list[dict]]


def read_benchmark(name: str, path: str | Path, verifier: verifiers.Benchmark, n_prompts: int | None) -> BenchmarkRows:
    """The first `n_prompts` rows of a benchmark file, each checked (`verifiers.check_row`): a missing file, a line
    that is not JSON, a missing field, an unknown instruction id or bad kwargs is one sentence naming the line."""
    file = Path(path)
    if not file.is_file():
        raise DataError(
            f"eval.benchmarks {name}: {file} does not exist"
            + ("; `make real-model` installs IFBench's test set" if verifier == "ifbench" else "")
        )
    keys, prompts, ids, kwargs = [], [], [], []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if n_prompts is not None and len(prompts) >= n_prompts:
                break
            if not line.strip():
                continue
            where = f"{file} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where} is not JSON ({err.msg})") from None
            missing = [k for k in ("prompt", "instruction_id_list", "kwargs") if k not in row]
            if missing:
                raise DataError(f"{where} has no '{missing[0]}' field (IFEval's layout: key, prompt, ...)")
            verifiers.check_row(row["instruction_id_list"], row["kwargs"], verifier, where)
            keys.append(str(row.get("key", number)))
            prompts.append(row["prompt"])
            ids.append(list(row["instruction_id_list"]))
            kwargs.append([verifiers.plain_kwargs(k) for k in row["kwargs"]])
    if not prompts:
        raise DataError(f"eval.benchmarks {name}: {file} has no rows")
    return BenchmarkRows(name, verifier, str(file), keys, prompts, ids, kwargs)


def files_digest(benchmarks: list[Any]) -> str | None:
    """The content digest of eval.benchmarks' files (a cache key part: a changed file is a changed evaluation);
    None without benchmarks. A missing file keys as its path (the stage then stops on it)."""
    if not benchmarks:
        return None
    h = hashlib.sha256()
    for bench in benchmarks:
        path = Path(bench.path)
        h.update(f"{bench.name}\0{file_digest(path) if path.is_file() else bench.path}\0".encode())
    return h.hexdigest()[:16]


def score_rows(rows: BenchmarkRows, responses: list[str]) -> pd.DataFrame:
    """One row per (prompt, instruction): key, instruction_id, strict, loose (None: not scorable)."""
    records = []
    for key, prompt, ids, kwargs, response in zip(
        rows.keys, rows.prompts, rows.instruction_ids, rows.kwargs, responses, strict=True
    ):
        scored = verifiers.score(prompt, response, ids, kwargs, rows.verifier)
        for instruction_id, strict, loose in zip(scored.instruction_ids, scored.strict, scored.loose, strict=True):
            records.append({"key": key, "instruction_id": instruction_id, "strict": strict, "loose": loose})
    return pd.DataFrame(records, columns=["key", "instruction_id", "strict", "loose"])


def _per_prompt(scored: pd.DataFrame) -> pd.DataFrame:
    """Per prompt (scorable instructions only): followed and count, strict and loose, and all-followed."""
    ok = scored[scored["strict"].notna()].astype({"strict": float, "loose": float})
    grouped = ok.groupby("key", sort=False)
    return pd.DataFrame(
        {
            "n": grouped.size(),
            "strict": grouped["strict"].sum(),
            "loose": grouped["loose"].sum(),
            "all_strict": grouped["strict"].min(),
            "all_loose": grouped["loose"].min(),
        }
    )


def _figures(per_prompt: pd.DataFrame, index: np.ndarray) -> np.ndarray:
    """The four figures over the prompts at `index` (with repeats). Shape: (4,)."""
    p = per_prompt.to_numpy()[index]  # columns: n, strict, loose, all_strict, all_loose
    n = p[:, 0].sum()
    return np.array([p[:, 3].mean(), p[:, 4].mean(), p[:, 1].sum() / n, p[:, 2].sum() / n])


def figures(scored: dict[str, pd.DataFrame], seed: int = 0) -> dict[str, float]:
    """The four figures of each policy with their 95% bootstrap intervals, and the trained policy's gain over SFT
    with its paired interval (the same resampled prompts for both): keys like ``policy/prompt_strict``,
    ``policy/prompt_strict_lo``, ``gain/instruction_strict_hi``; and the scored counts."""
    per = {name: _per_prompt(frame) for name, frame in scored.items()}
    keys = per["sft"].index.intersection(per["policy"].index)  # prompts with a scorable instruction
    per = {name: frame.loc[keys] for name, frame in per.items()}
    rng = np.random.default_rng(seed)
    n = len(keys)
    samples = rng.integers(0, n, size=(RESAMPLES, n))
    out: dict[str, float] = {"n_prompts": float(n), "n_instructions": float(per["sft"]["n"].sum())}
    out["unscorable"] = float(scored["sft"]["strict"].isna().sum())
    boot = {}
    for name, frame in per.items():
        point = _figures(frame, np.arange(n))
        boot[name] = np.stack([_figures(frame, s) for s in samples])  # (RESAMPLES, 4)
        for i, figure in enumerate(FIGURES):
            out[f"{name}/{figure}"] = float(point[i])
            out[f"{name}/{figure}_lo"], out[f"{name}/{figure}_hi"] = (
                float(v) for v in np.percentile(boot[name][:, i], [2.5, 97.5])
            )
    gains = boot["policy"] - boot["sft"]
    for i, figure in enumerate(FIGURES):
        out[f"gain/{figure}"] = out[f"policy/{figure}"] - out[f"sft/{figure}"]
        out[f"gain/{figure}_lo"], out[f"gain/{figure}_hi"] = (float(v) for v in np.percentile(gains[:, i], [2.5, 97.5]))
    return out


def mean_intervals(policy: np.ndarray, sft: np.ndarray, seed: int = 0) -> dict[str, float]:
    """Per-prompt scores of the trained and the SFT policy (the same prompts, in order): each one's 95% bootstrap
    interval of the mean and the gain's paired interval (the same resampled prompts for both), as `figures` gives
    the benchmarks': keys policy_lo, policy_hi, sft_lo, sft_hi, gain, gain_lo, gain_hi."""
    policy, sft = np.asarray(policy, dtype=float), np.asarray(sft, dtype=float)
    samples = np.random.default_rng(seed).integers(0, len(policy), size=(RESAMPLES, len(policy)))
    boot = {"policy": policy[samples].mean(1), "sft": sft[samples].mean(1)}
    out = {"gain": float(policy.mean() - sft.mean())}
    for name, values in (*boot.items(), ("gain", boot["policy"] - boot["sft"])):
        out[f"{name}_lo"], out[f"{name}_hi"] = (float(v) for v in np.percentile(values, [2.5, 97.5]))
    return out


def by_type(scored: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """Per instruction type: prompts, SFT's and the trained policy's strict accuracy, and the change (points)."""
    rows = []
    sft, policy = (scored[n][scored[n]["strict"].notna()] for n in ("sft", "policy"))
    for instruction_id, group in sft.groupby("instruction_id"):
        trained = policy[policy["instruction_id"] == instruction_id]
        rows.append(
            {
                "instruction_id": instruction_id,
                "prompts": len(group),
                "sft_strict": float(group["strict"].astype(float).mean()),
                "policy_strict": float(trained["strict"].astype(float).mean()),
            }
        )
    table = pd.DataFrame(rows, columns=["instruction_id", "prompts", "sft_strict", "policy_strict"])
    table["change_points"] = 100 * (table["policy_strict"] - table["sft_strict"])
    return table.sort_values(["prompts", "instruction_id"], ascending=[False, True]).reset_index(drop=True)


def length_controlled(
    scored: dict[str, pd.DataFrame], lengths: dict[str, list[int]], keys: list[str], tolerance: float
) -> dict[str, float]:
    """The trained policy's win rate over SFT on each prompt's instruction-level strict share: raw, and at equal
    length (``rlhf.eval.length_control``)."""
    share = {
        name: frame[frame["strict"].notna()].astype({"strict": float}).groupby("key")["strict"].mean()
        for name, frame in scored.items()
    }
    both = [k for k in keys if k in share["sft"].index and k in share["policy"].index]
    position = {k: i for i, k in enumerate(keys)}
    sft_len = [lengths["sft"][position[k]] for k in both]
    pol_len = [lengths["policy"][position[k]] for k in both]
    control = length_control.length_control(
        share["policy"].loc[both].to_numpy(), share["sft"].loc[both].to_numpy(), pol_len, sft_len, tolerance
    )
    wins = length_control.win_values(share["policy"].loc[both].to_numpy(), share["sft"].loc[both].to_numpy())
    return {"win_rate": float(np.mean(wins)), "win_rate_len_controlled": control.controlled_win_rate}


def metrics(name: str, summary: dict[str, float], table: pd.DataFrame) -> dict[str, float]:
    """The figures and the per-type table as MLflow metric keys: ``benchmark/<name>/<figure>`` and
    ``benchmark/<name>/type/<instruction type, ':' as '.'>/<column>``."""
    out = {f"benchmark/{name}/{key}": value for key, value in summary.items()}
    for row in table.itertuples():
        prefix = f"benchmark/{name}/type/{row.instruction_id.replace(':', '.')}"
        out |= {f"{prefix}/prompts": float(row.prompts), f"{prefix}/sft_strict": row.sft_strict}
        out[f"{prefix}/policy_strict"] = row.policy_strict
    return out


def names(summary: dict[str, Any]) -> list[str]:
    """The benchmarks whose figures a summary holds."""
    return list(
        dict.fromkeys(k.split("/")[1] for k in summary if k.startswith("benchmark/") and k.endswith("/n_prompts"))
    )


def type_table(summary: dict[str, Any], name: str) -> pd.DataFrame:
    """The per-type table of benchmark `name`, read back from its metric keys."""
    prefix = f"benchmark/{name}/type/"
    rows: dict[str, dict[str, Any]] = {}
    for key, value in summary.items():
        if key.startswith(prefix):
            instruction, column = key[len(prefix) :].rsplit("/", 1)
            rows.setdefault(instruction.replace(".", ":", 1), {})[column] = value
    table = pd.DataFrame(
        [{"instruction_id": k, **v} for k, v in rows.items()],
        columns=["instruction_id", "prompts", "sft_strict", "policy_strict"],
    )
    table["change_points"] = 100 * (table["policy_strict"] - table["sft_strict"])
    return table.sort_values(["prompts", "instruction_id"], ascending=[False, True]).reset_index(drop=True)


def report_lines(summary: dict[str, Any], name: str, label: str = "trained") -> list[str]:
    """Benchmark `name`'s figures in a few lines of words (the pipeline summary, the evaluation artifact)."""
    s = {k[len(f"benchmark/{name}/") :]: v for k, v in summary.items() if k.startswith(f"benchmark/{name}/")}

    def cell(policy: str, figure: str) -> str:
        point, lo, hi = (100 * s[f"{policy}/{figure}{end}"] for end in ("", "_lo", "_hi"))
        return f"{point:.1f}% [{lo:.1f}, {hi:.1f}]"

    lines = [f"{name}: {int(s['n_prompts'])} prompts, {int(s['n_instructions'])} instructions (95% intervals)"]
    for figure in FIGURES:
        gain, lo, hi = (100 * s[f"gain/{figure}{end}"] for end in ("", "_lo", "_hi"))
        lines.append(
            f"  {figure.replace('_', '-level ', 1)}: SFT {cell('sft', figure)} -> {label} {cell('policy', figure)}, "
            f"{gain:+.1f} points [{lo:+.1f}, {hi:+.1f}]"
        )
    if "win_rate_len_controlled" in s:
        lines.append(
            f"  {label} beats SFT (instruction-level strict, ties half) on {100 * s['win_rate']:.1f}% of prompts, "
            f"{100 * s['win_rate_len_controlled']:.1f}% at equal length"
        )
    table = type_table(summary, name)
    worse = table[(table["prompts"] >= MIN_TYPE_PROMPTS) & (table["change_points"] < -5)]
    if len(worse):
        types = ", ".join(worse["instruction_id"])
        lines.append(f"  worse by more than 5 points (types with {MIN_TYPE_PROMPTS}+ prompts): {types}")
    if s.get("unscorable"):
        lines.append(f"  {int(s['unscorable'])} instructions not scorable here (their checker needs NLTK data)")
    return lines


def markdown_table(summary: dict[str, Any], name: str, label: str = "trained") -> str:
    """Benchmark `name`'s four figures as a short Markdown table: SFT, the trained policy and the gain, each with
    its 95% interval (the Prefect evaluation artifact)."""
    s = {k[len(f"benchmark/{name}/") :]: v for k, v in summary.items() if k.startswith(f"benchmark/{name}/")}

    def cell(key: str, sign: str = "") -> str:
        point, lo, hi = (100 * s[f"{key}{end}"] for end in ("", "_lo", "_hi"))
        return f"{point:{sign}.1f}{'' if sign else '%'} [{lo:{sign}.1f}, {hi:{sign}.1f}]"

    n = f"{int(s['n_prompts'])} prompts, {int(s['n_instructions'])} instructions"
    lines = [f"| {name} ({n}) | SFT | {label} | gain (points) |", "|---|---|---|---|"]
    for figure in FIGURES:
        what = figure.replace("_", "-level ", 1)
        lines.append(
            f"| {what} | {cell(f'sft/{figure}')} | {cell(f'policy/{figure}')} | {cell(f'gain/{figure}', '+')} |"
        )
    return "\n".join(lines)


def summary_lines(summary: dict[str, Any], label: str = "trained") -> list[str]:
    """`report_lines` of every benchmark a summary holds."""
    return [line for name in names(summary) for line in report_lines(summary, name, label)]


def type_table_markdown(table: pd.DataFrame) -> str:
    """The per-type table as Markdown."""
    lines = [
        "| instruction type | prompts | SFT strict | trained strict | change (points) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in table.itertuples():
        lines.append(
            f"| {row.instruction_id} | {int(row.prompts)} | {100 * row.sft_strict:.1f}% | "
            f"{100 * row.policy_strict:.1f}% | {row.change_points:+.1f} |"
        )
    return "\n".join(lines)
