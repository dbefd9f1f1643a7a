"""Generated tokens/s of the decode modes (`ppo.generation.decode`: dynamic, static, compiled) on a bench shape's
policy, alternating the modes round by round; the compile warm-up reported apart.

    python -m benchmarks.decode_bench --shape cpu --dtype float32 --rounds 3
    python -m benchmarks.decode_bench --shape gpt2-124m --batch 8 --device cpu --dtype bfloat16

Prints one line per mode and round, then per mode the median tokens/s and its ratio to 'dynamic'.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from rlhf.models.cpu_kernels import use_cpu_kernels
from rlhf.models.device import DTYPES, autocast, configure_cpu
from rlhf.rollout.generation import GenerationSettings, sample_responses
from rlhf.rollout.static_decode import COMPILE_LOG

from .limit import synchronize
from .shapes import SHAPES, BenchShape, model_classes, model_config


def policy_model(shape: BenchShape, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The shape's random-init policy as the trainer holds it: float32 weights under autocast, or `dtype` weights
    (float16)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = model_classes(shape)[0](model_config(shape))
    use_cpu_kernels(model)
    return model.eval()


def time_decode(
    model: torch.nn.Module, shape: BenchShape, settings: GenerationSettings, dtype: torch.dtype, batch: int, reps: int
) -> float:
    """Generated tokens/s of `reps` sampling calls (after one untimed call: warm-up, compile)."""
    device = next(model.parameters()).device
    data = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, shape.vocab_size, (batch, shape.prompt_len), generator=data).to(device)
    mask = torch.ones_like(prompts)
    gen = torch.Generator(device=device).manual_seed(0)
    with autocast(device, dtype):
        sample_responses(model, prompts, mask, settings, gen)
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            sample_responses(model, prompts, mask, settings, gen)
        synchronize(device)
    return reps * batch * settings.max_new_tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="cpu")
    parser.add_argument("--device", default=None, help="default: the shape's")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the autocast dtype")
    parser.add_argument("--batch", type=int, default=None, help="prompts a call (default: the shape's batch)")
    parser.add_argument("--modes", default="dynamic,static,compiled")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3, help="timed sampling calls a mode and round")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    device = torch.device(args.device or shape.device)
    configure_cpu(shape.threads if device.type == "cpu" else None)
    dtype = DTYPES[args.dtype]
    batch = args.batch or shape.batch_size
    model = policy_model(shape, device, dtype)
    settings = GenerationSettings(shape.response_len, temperature=1.0, stop_token_ids=(), pad_token_id=0)
    modes = args.modes.split(",")
    print(f"decode bench: shape={args.shape} batch={batch} tokens={shape.response_len} device={device} dtype={dtype}")
    figures: dict[str, list[float]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            before = COMPILE_LOG.seconds
            tps = time_decode(model, shape, replace(settings, decode=mode), dtype, batch, args.reps)
            figures[mode].append(tps)
            compile_s = COMPILE_LOG.seconds - before
            extra = f" (compile warm-up {compile_s:.1f} s, untimed)" if compile_s else ""
            print(f"round {round_ + 1} {mode:<9} {tps:10.0f} tokens/s{extra}", flush=True)
    base = statistics.median(figures[modes[0]])
    for mode in modes:
        med = statistics.median(figures[mode])
        print(f"{mode:<9} median {med:10.0f} tokens/s  {med / base:.2f}x {modes[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
