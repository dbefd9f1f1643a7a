"""The real model's accuracy on reasoning-gym tasks before any training: the measurement that picked the task of
conf/real-reasoning.yaml (docs/real.md).

    .venv/bin/python tools/reasoning_task_accuracy.py --tasks chain_sum basic_arithmetic leg_counting --n 64

For each task, `--n` held-out items (seed `--seed`, the generator's settings from `--configs`, a JSON object of
task -> settings) are rendered as the pipeline renders them (rlhf.data.reasoning_gym.prompt_text in the model's chat
template) and answered greedily (or at `--temperature`) in float32 on one CPU thread; prints, per task, the mean of
rlhf.data.reasoning_gym:correct (the task's score_answer, with its fallback without tags), the share of answers
right inside the tags alone (R1's strict reading), the mean of :formatted, and the mean response length in tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rlhf.config import ReasoningTaskConfig
from rlhf.data import reasoning_gym as rg
from rlhf.models.gguf import resolve_model
from rlhf.models.loading import load_causal_lm, load_tokenizer

EASY = {  # easy settings of the candidate tasks (small numbers, few terms)
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
    # no "/": reasoning-gym 0.1.25's basic_arithmetic without parentheses writes the divisor it drew, not the one its
    # answer divides by ("Calculate 5 / 33." -> "260")
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "max_digits": 2,
        "allow_parentheses": False,
        "operators": "+-*",
    },
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3},
    "gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 50},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--tasks", nargs="+", default=list(EASY))
    parser.add_argument("--configs", default=None, help="JSON: task -> generator settings (default: EASY)")
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1_000_000, help="the held-out seed (data.task.eval_seed)")
    parser.add_argument("--train-size", type=int, default=512, help="data.task.train_size (its questions left out)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    configs = json.loads(args.configs) if args.configs else EASY
    source = resolve_model("sft.model", args.model, None, None, "outputs")
    model, tokenizer = load_causal_lm(source.path, torch.device("cpu")).eval(), load_tokenizer(source.path)
    tokenizer.padding_side = "left"
    for name in args.tasks:
        start = time.perf_counter()
        task = ReasoningTaskConfig(
            name=name, config=configs.get(name, {}), train_size=args.train_size, eval_seed=args.seed, eval_size=args.n
        )
        items = rg.generate(task).heldout
        texts = [_chat(tokenizer, rg.prompt_text(e["question"])) for e in items]
        completions, lengths = [], []
        for i in range(0, len(texts), args.batch_size):
            out, n = _answer(model, tokenizer, texts[i : i + args.batch_size], args)
            completions += out
            lengths += n
        cols = [rg.columns(task, e) for e in items]
        answers, entries = [c["answer"] for c in cols], [c["entry"] for c in cols]
        score = rg.correct(texts, completions, answers, entries)
        strict = [float(rg.format_score(c) > 0) * s for c, s in zip(completions, score, strict=True)]
        fmt = rg.formatted(texts, completions)
        row = dict(task=name, n=len(items), correct=_mean(score), correct_in_tags=_mean(strict), formatted=_mean(fmt))
        row |= dict(tokens=_mean(lengths), seconds=round(time.perf_counter() - start, 1), config=task.config)
        print(json.dumps(row), flush=True)
        print("  e.g.", json.dumps(items[0]["question"]), "->", json.dumps(completions[0][:300]), flush=True)


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def _answer(model, tokenizer, texts: list[str], args) -> tuple[list[str], list[int]]:
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    sample = args.temperature > 0
    extra = {"do_sample": True, "temperature": args.temperature} if sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **extra)
    new = out[:, batch.input_ids.shape[1] :]
    ends = [(row == tokenizer.eos_token_id).nonzero() for row in new]
    lengths = [int(e[0]) + 1 if len(e) else new.shape[1] for e in ends]
    return [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(new, lengths, strict=True)], lengths


def _mean(values: list[float]) -> float:
    return round(sum(values) / max(len(values), 1), 3)


if __name__ == "__main__":
    main()
