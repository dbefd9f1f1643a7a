"""Make the real tier's instruction-following data: IFEval-style prompts, and pairs sampled from the real model that
IFEval's checkers label.

    .venv/bin/python tools/sample_instruction_pairs.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf

Writes, under `--out` (``data/ifeval/``; ``conf/real.yaml`` and ``conf/real-rlvr.yaml`` read them):

- ``prompts.jsonl.gz``: `--train-prompts` training prompts (``rlhf.data.instructions.make_rows``, the training
  topics), each with IFEval's ``instruction_id_list`` and ``kwargs``: the policy stage's prompts;
- ``heldout.jsonl``: `--eval-prompts` held-out prompts about other topics, in IFEval's own layout (key, prompt,
  instruction_id_list, kwargs): the evaluation's held-out benchmark (``eval.benchmarks``);
- ``train.jsonl.gz`` and ``eval.jsonl.gz``: preference pairs in UltraFeedback-binarized's layout (``prompt``;
  ``chosen`` / ``rejected`` as [user, assistant] message lists) plus the row's ``instruction_id_list`` and
  ``kwargs``: for each of `--pair-prompts` training prompts (and each held-out prompt), the model (rendered with
  its chat template, as the pipeline renders it) samples `--samples` responses at `--temperature`; the one IFEval's
  checkers score highest (the share of the instructions followed, strict) is chosen against each distinct response
  they score lower; a prompt whose samples all score the same gives no pair. Training labels are flipped with
  probability `--label-noise`; held-out labels are the checkers'.

Deterministic for a seed on one machine and dtype (a seeded generator); on a GPU when there is one, else on the CPU
with static-cache decoding, in the dtype `runtime.dtype: auto` picks there (`--dtype`). Prints the checkers' pass
rate of the samples by instruction type: the model's own rate before any training.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from rlhf.data import instructions, verifiers
from rlhf.models.device import DTYPES, autocast, compute_dtype
from rlhf.models.gguf import resolve_model
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.stop_tokens import stop_token_ids
from rlhf.rollout.generation import GenerationSettings, response_texts, sample_responses


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--out", default="data/ifeval")
    parser.add_argument("--train-prompts", type=int, default=1024)
    parser.add_argument("--pair-prompts", type=int, default=256, help="training prompts that are sampled for pairs")
    parser.add_argument("--eval-prompts", type=int, default=160)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--label-noise", type=float, default=0.0)
    parser.add_argument("--batch-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-only", action="store_true", help="write the prompt files, sample no pairs")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="as runtime.dtype")
    parser.add_argument("--cache", default="outputs", help="where a GGUF model's dequantised folder is kept")
    return parser.parse_args(argv)


def sample_pairs(
    model, tokenizer, rows: list[dict], args: argparse.Namespace, noise: float, seed: int, passed: dict[str, list]
) -> list[dict]:
    """The best-scored sample of each prompt against each lower-scored one; each label flipped with `noise`. Each
    sample's verdict per instruction goes into `passed` (instruction id -> list of bools)."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    dtype = compute_dtype(args.dtype, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    settings = GenerationSettings(
        args.max_new_tokens,
        args.temperature,
        stop_token_ids=stop_token_ids(tokenizer, [], model.config, model.generation_config),
        pad_token_id=tokenizer.pad_token_id,
        decode="static",
    )
    pairs: list[dict] = []
    for start in range(0, len(rows), args.batch_prompts):
        batch = rows[start : start + args.batch_prompts]
        rendered = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
            )
            for r in batch
        ]
        repeated = [r for r in rendered for _ in range(args.samples)]
        enc = tokenizer(repeated, return_tensors="pt", padding=True, add_special_tokens=False)
        with autocast(device, dtype):
            resp = sample_responses(model, enc.input_ids.to(device), enc.attention_mask.to(device), settings, generator)
        texts = response_texts(tokenizer, resp)
        for i, row in enumerate(batch):
            group = texts[i * args.samples : (i + 1) * args.samples]
            ids, kwargs = row["instruction_id_list"], row["kwargs"]
            verdicts = [verifiers.score(row["prompt"], text, ids, kwargs, "ifeval") for text in group]
            scores = [verdict.share() for verdict in verdicts]
            for verdict in verdicts:
                for instruction_id, ok in zip(ids, verdict.strict, strict=True):
                    if ok is not None:
                        passed[instruction_id].append(ok)
            best = rng.choice([t for t, s in zip(group, scores, strict=True) if s == max(scores)])
            user = {"role": "user", "content": row["prompt"]}
            for worse in dict.fromkeys(t for t, s in zip(group, scores, strict=True) if s < max(scores)):
                chosen, rejected = (worse, best) if rng.random() < noise else (best, worse)
                pairs.append(
                    {
                        "prompt": row["prompt"],
                        "chosen": [user, {"role": "assistant", "content": chosen}],
                        "rejected": [user, {"role": "assistant", "content": rejected}],
                        "instruction_id_list": ids,
                        "kwargs": kwargs,
                    }
                )
        print(f"{start + len(batch)}/{len(rows)} prompts, {len(pairs)} pairs", file=sys.stderr, flush=True)
    return pairs


def write_jsonl(rows: list[dict], path: Path) -> None:
    """JSON lines, gzip-compressed for a .gz name (mtime 0: the same rows give the same bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if path.suffix == ".gz":
        with gzip.GzipFile(path, "wb", mtime=0) as raw:
            raw.write(data)
    else:
        path.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    train = instructions.make_rows(args.train_prompts, args.seed, "train")
    heldout = instructions.make_rows(args.eval_prompts, args.seed, "eval")
    write_jsonl(
        [{k: r[k] for k in ("prompt", "instruction_id_list", "kwargs")} for r in train], out / "prompts.jsonl.gz"
    )
    write_jsonl(heldout, out / "heldout.jsonl")
    if args.prompts_only:
        return 0
    source = resolve_model("--model", args.model, None, None, args.cache)
    tokenizer = load_tokenizer(source.path)
    tokenizer.padding_side = "left"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(source.path, device).eval()
    started = time.time()
    passed: dict[str, list[bool]] = defaultdict(list)
    for split, rows, noise in (("train", train[: args.pair_prompts], args.label_noise), ("eval", heldout, 0.0)):
        pairs = sample_pairs(model, tokenizer, rows, args, noise, args.seed + (split == "eval"), passed)
        write_jsonl(pairs, out / f"{split}.jsonl.gz")
        print(f"{split}: {len(pairs)} pairs from {len(rows)} prompts ({time.time() - started:.0f} s)", file=sys.stderr)
    print("the samples' strict pass rate by instruction type:", file=sys.stderr)
    for instruction_id, verdicts in sorted(passed.items(), key=lambda item: -sum(item[1]) / len(item[1])):
        print(f"  {instruction_id:48s} {sum(verdicts) / len(verdicts):6.1%} of {len(verdicts)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
