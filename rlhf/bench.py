"""PPO throughput benchmark on the fixed shape of docs/benchmark.md (``make bench``).

Times the same update steps the trainer runs (generate and score, advantages, PPO epochs) on randomly initialised
GPT-2 models, and prints the per-phase times, peak memory and, last, ``episodes/s: X``: the median over the
updates after the first.

    python -m rlhf.bench                      # the CPU shape, torch.set_num_threads(2)
    python -m rlhf.bench --shape gpt2-124m    # the GPU shape (GPT-2 124M, batch 64, response 64, bf16)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

from rlhf.config import PPOConfig
from rlhf.generation import GenerationSettings
from rlhf.memory import peak_memory_mb
from rlhf.models.device import DTYPES, compute_dtype, resolve_device
from rlhf.models.training import disable_dropout, fuse_gelu
from rlhf.ppo.models import PPOModels
from rlhf.ppo.state import TrainerState, fresh_state
from rlhf.ppo.update import compute_advantages, generate_and_score, optimize

PHASES = ("time/generate", "time/score", "time/advantages", "time/optimize")


@dataclass(frozen=True)
class BenchShape:
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    batch_size: int
    prompt_len: int
    response_len: int
    num_mini_batches: int = 4
    num_ppo_epochs: int = 4


SHAPES = {
    # docs/benchmark.md: 4 layers, 4 heads, hidden 128, vocab 1000; 64 prompts of 16 tokens; 32 sampled tokens
    "cpu": BenchShape(n_layer=4, n_head=4, n_embd=128, vocab_size=1000, batch_size=64, prompt_len=16, response_len=32),
    # docs/benchmark.md, GPU: the GPT-2 124M shape, batch 64, response 64
    "gpt2-124m": BenchShape(
        n_layer=12, n_head=12, n_embd=768, vocab_size=50257, batch_size=64, prompt_len=16, response_len=64
    ),
}


def build_models(shape: BenchShape, device: torch.device, seed: int = 0) -> PPOModels:
    """Random-init policy (and its reference copy), and separate reward and value models of the same shape."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=shape.vocab_size,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_embd=shape.n_embd,
        n_positions=max(64, shape.prompt_len + shape.response_len),
        num_labels=1,
        pad_token_id=0,
    )
    policy = GPT2LMHeadModel(config).to(device)
    reference = copy.deepcopy(policy).requires_grad_(False)
    value = GPT2ForSequenceClassification(config).to(device)
    reward = GPT2ForSequenceClassification(config).to(device).requires_grad_(False)
    for model in (policy, reference, value, reward):
        disable_dropout(model)
        fuse_gelu(model)
        model.eval()
    return PPOModels(
        policy, reference, value, reward, tokenizer=None, reward_tokenizer=None, stop_token_ids=(), same_tokenizer=True
    )


def run_bench(
    shape: BenchShape, updates: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, float]:
    """Median timings of `updates` PPO updates; `dtype` is the autocast dtype on CUDA (float32: none)."""
    m = build_models(shape, device, seed)
    cfg = PPOConfig(
        total_episodes=shape.batch_size * updates,
        batch_size=shape.batch_size,
        num_mini_batches=shape.num_mini_batches,
        num_ppo_epochs=shape.num_ppo_epochs,
        max_new_tokens=shape.response_len,
        temperature=1.0,
        missing_eos_penalty=None,
        lr_schedule="constant",
        record_rollouts=False,
    )
    state: TrainerState = fresh_state(m, cfg, seed, device)
    # no stop tokens: every response is exactly response_len tokens (docs/benchmark.md: no stop-token truncation)
    settings = GenerationSettings(shape.response_len, temperature=1.0, stop_token_ids=(), pad_token_id=0)
    data = torch.Generator().manual_seed(seed)
    per_update: list[dict[str, float]] = []
    for update in range(updates):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        query = torch.randint(1, shape.vocab_size, (shape.batch_size, shape.prompt_len), generator=data).to(device)
        query_mask = torch.ones_like(query)
        r = generate_and_score(
            m, query, query_mask, list(range(shape.batch_size)), None, cfg, settings, state.sample_generator, dtype
        )
        compute_advantages(r, cfg, state.kl_ctl.value)
        result = optimize(m, state, r, cfg, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        timings = {**r.timings, "time/optimize": result.stats["time/optimize"], "time/total": total}
        timings["episodes/s"] = shape.batch_size / total
        per_update.append(timings)
        print(
            f"update {update + 1}/{updates}: {timings['episodes/s']:.1f} episodes/s "
            + " ".join(f"{k.split('/')[1]}={timings[k]:.3f}s" for k in PHASES),
            flush=True,
        )
    steady = per_update[1:] if len(per_update) > 1 else per_update
    summary = {k: statistics.median(u[k] for u in steady) for k in (*PHASES, "time/total", "episodes/s")}
    summary["memory/peak_mb"] = peak_memory_mb(device)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--updates", type=int, default=10, help="timed updates (the first is excluded; >= 9)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (docs/benchmark.md: 2)")
    parser.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto", help="autocast dtype on CUDA (runtime.dtype)"
    )
    parser.add_argument(
        "--peer-episodes-per-s",
        type=float,
        default=None,
        help="the peer's figure on the same shape and machine (make bench PEER=1): prints the ratio",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    shape = SHAPES[args.shape]
    dtype = compute_dtype(args.dtype, device)
    print(f"PPO bench: shape={args.shape} {shape} device={device} threads={torch.get_num_threads()} dtype={dtype}")
    summary = run_bench(shape, args.updates, device, dtype)
    print("median per update (updates after the first):")
    for key in (*PHASES, "time/total"):
        print(f"  {key:<18} {summary[key]:.4f} s")
    print(f"  peak memory        {summary['memory/peak_mb']:.0f} MiB ({'GPU' if device.type == 'cuda' else 'RSS'})")
    if args.peer_episodes_per_s:
        print(
            f"peer (TRL 0.19 PPOTrainer) episodes/s: {args.peer_episodes_per_s:.1f}; "
            f"ratio: {summary['episodes/s'] / args.peer_episodes_per_s:.2f}x"
        )
    print(f"episodes/s: {summary['episodes/s']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
