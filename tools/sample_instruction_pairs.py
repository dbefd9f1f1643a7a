"""Sample the preference pairs of the real tier's instruction task from the real model, labelled by the checker.

    .venv/bin/python tools/sample_instruction_pairs.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf

For each prompt of `rlhf.data.instructions.make_prompts` (train and eval splits), the model (rendered with its chat
template, as the pipeline renders it) samples `--samples` responses at `--temperature`; the one the checker scores
highest is chosen against each distinct response it scores lower (a prompt whose samples all score the same gives no
pair). Training labels are flipped with
probability `--label-noise` (human-like noise); held-out labels are the checker's. The files are written in
UltraFeedback-binarized's layout (`prompt`; `chosen` / `rejected` as [user, assistant] message lists) as
``<out>/train.jsonl.gz`` and ``<out>/eval.jsonl.gz``, which ``conf/real.yaml`` reads. Deterministic for a seed on one
machine (sampling uses a seeded generator); on a GPU when there is one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from pathlib import Path

import torch

from rlhf.data import instructions
from rlhf.models.gguf import resolve_model
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.stop_tokens import stop_token_ids
from rlhf.rollout.generation import GenerationSettings, response_texts, sample_responses


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", default="data/instructions")
    parser.add_argument("--train-prompts", type=int, default=480)
    parser.add_argument("--eval-prompts", type=int, default=160)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--label-noise", type=float, default=0.1)
    parser.add_argument("--batch-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", default="outputs", help="where a GGUF model's dequantised folder is kept")
    return parser.parse_args(argv)


def sample_pairs(model, tokenizer, prompts: list[str], args: argparse.Namespace, noise: float, seed: int) -> list[dict]:
    """The best-scored sample of each prompt against each lower-scored one; each label flipped with `noise`."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    settings = GenerationSettings(
        args.max_new_tokens,
        args.temperature,
        stop_token_ids=stop_token_ids(tokenizer, [], model.config, model.generation_config),
        pad_token_id=tokenizer.pad_token_id,
    )
    rows: list[dict] = []
    for start in range(0, len(prompts), args.batch_prompts):
        batch = prompts[start : start + args.batch_prompts]
        rendered = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in batch
        ]
        repeated = [r for r in rendered for _ in range(args.samples)]
        enc = tokenizer(repeated, return_tensors="pt", padding=True, add_special_tokens=False)
        resp = sample_responses(model, enc.input_ids.to(device), enc.attention_mask.to(device), settings, generator)
        texts = response_texts(tokenizer, resp)
        for i, prompt in enumerate(batch):
            group = texts[i * args.samples : (i + 1) * args.samples]
            scores = instructions.gold_reward([rendered[i]] * len(group), group)
            best = rng.choice([t for t, s in zip(group, scores, strict=True) if s == max(scores)])
            user = {"role": "user", "content": prompt}
            for worse in dict.fromkeys(t for t, s in zip(group, scores, strict=True) if s < max(scores)):
                chosen, rejected = (worse, best) if rng.random() < noise else (best, worse)
                rows.append(
                    {
                        "prompt": prompt,
                        "chosen": [user, {"role": "assistant", "content": chosen}],
                        "rejected": [user, {"role": "assistant", "content": rejected}],
                    }
                )
        print(f"{start + len(batch)}/{len(prompts)} prompts, {len(rows)} pairs", file=sys.stderr, flush=True)
    return rows


def write_jsonl_gz(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(path, "wb", mtime=0) as raw:  # mtime 0: the same rows give the same bytes
        raw.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    source = resolve_model("--model", args.model, None, None, args.cache)
    tokenizer = load_tokenizer(source.path)
    tokenizer.padding_side = "left"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(source.path, device).eval()
    started = time.time()
    for split, n, noise in (("train", args.train_prompts, args.label_noise), ("eval", args.eval_prompts, 0.0)):
        prompts = instructions.make_prompts(n, args.seed, split)
        rows = sample_pairs(model, tokenizer, prompts, args, noise, seed=args.seed + (split == "eval"))
        write_jsonl_gz(rows, Path(args.out) / f"{split}.jsonl.gz")
        print(f"{split}: {len(rows)} pairs from {n} prompts ({time.time() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
