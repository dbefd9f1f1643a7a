"""What several reward functions cost against one function doing the same work (reward.functions, TRL's
reward_funcs):

    .venv/bin/python benchmarks/reward_functions_bench.py [--batch 64] [--rounds 200]

The work is the reasoning-gym route's (conf/real-reasoning.yaml): correctness (the task's own score_answer) and the
answer's format, on a batch of real responses to the route's held-out items. Variant A is one function that computes
both and returns `correct + 0.2 * formatted`; variant B is the list `[correct, formatted]` with weights
`[1.0, 0.2]`, which keeps each function's scores apart. Each variant runs the policy stage's path for one update:
the functions' call (`RewardFunctions.parts`, `combine`), the scores as tensors (the (F, b) parts too) and the
per-function statistics (`rewards/<name>/mean`, `/std`). Rounds alternate A and B; the report is each variant's
median and the difference per update, with the share of an update of the route (`--update-seconds`, measured:
docs/real.md). Needs the `reasoning` extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlhf.config import ReasoningTaskConfig
from rlhf.data import reasoning_gym
from rlhf.ppo.stats import function_rollout_stats
from rlhf.rollout.reward_function import RewardFunction, RewardFunctions
from rlhf.rollout.rows import RowColumns

CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "allow_parentheses": False}


def both(prompts, completions, answer, entry):
    """One function doing the list's work: correctness plus a fifth of the format score."""
    right = reasoning_gym.correct(prompts, completions, answer, entry)
    form = reasoning_gym.formatted(prompts, completions)
    return [r + 0.2 * f for r, f in zip(right, form, strict=True)]


def batch(size: int) -> tuple[list[str], list[str], RowColumns]:
    """`size` held-out items with responses like the policy's: right, wrong, tagged and untagged, in turn."""
    task = ReasoningTaskConfig(name="basic_arithmetic", config={**CONFIG, "operators": ["+", "-", "*"]})
    items = reasoning_gym.generate(task).heldout[:size]
    prompts = [reasoning_gym.prompt_text(e["question"]) for e in items]
    responses = []
    for i, entry in enumerate(items):
        answer = str(entry["answer"]) if i % 2 == 0 else str(int(entry["answer"]) + 1)
        responses.append(f"<answer>{answer}</answer>" if i % 3 == 0 else f"{entry['question']} = {answer}")
    truth = [reasoning_gym.columns(task, entry) for entry in items]  # row columns are kept as JSON text
    # the items' prompts are distinct: each serves as its row's key
    rows = {p: [json.dumps(t[n]) for n in ("answer", "entry")] for p, t in zip(prompts, truth, strict=True)}
    return prompts, responses, RowColumns(["answer", "entry"], rows, "held-out items")


def one_update(functions: RewardFunctions, prompts: list[str], responses: list[str]) -> float:
    """Seconds of the scoring path of one update for `functions` (as rlhf.rollout.scoring.function_scores and the
    trainer's statistics run it)."""
    started = time.perf_counter()
    parts = functions.parts(prompts, responses, prompts)
    torch.tensor(functions.combine(parts), dtype=torch.float32)
    stacked = torch.tensor(parts, dtype=torch.float32).view(len(parts), len(responses))
    function_rollout_stats(stacked, functions.names)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="responses an update (the route's ppo.batch_size)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--update-seconds", type=float, default=22.5, help="one update of the route, measured")
    args = parser.parse_args(argv)
    prompts, responses, columns = batch(args.batch)
    one = RewardFunctions((RewardFunction(f"{__name__}:both", both),), (1.0,)).with_columns(columns)
    listed = RewardFunctions(
        (
            RewardFunction("rlhf.data.reasoning_gym:correct", reasoning_gym.correct),
            RewardFunction("rlhf.data.reasoning_gym:formatted", reasoning_gym.formatted),
        ),
        (1.0, 0.2),
    ).with_columns(columns)
    assert one(prompts, responses, prompts) == listed(prompts, responses, prompts)  # the same scores: like for like
    times: dict[str, list[float]] = {"one function": [], "two functions": []}
    for _ in range(args.rounds):
        times["one function"].append(one_update(one, prompts, responses))
        times["two functions"].append(one_update(listed, prompts, responses))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:<14} {median * 1e3:8.3f} ms an update of {args.batch} responses (median of {args.rounds})")
    extra = medians["two functions"] - medians["one function"]
    share = extra / args.update_seconds
    print(f"difference     {extra * 1e3:+8.3f} ms an update: {share:+.4%} of a {args.update_seconds} s update")


if __name__ == "__main__":
    main()
