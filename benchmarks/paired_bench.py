"""Two settings of the PPO bench compared in one process, update by update: the way to tell a change of a few percent
from the machine's drift.

    python -m benchmarks.paired_bench --b dtype=float32                     # auto (A) against float32 (B)
    python -m benchmarks.paired_bench --estimator grpo --b halves=off       # halves against whole micro-batches
    python -m benchmarks.paired_bench --shape cpu-long --a decode=dynamic --b decode=compiled --pairs 6

On a shared machine the same bench run minutes apart differs by 20% or more, and within one run update times move
as much (docs/benchmark.md "Paired comparisons"). Here A and B are two `benchmarks.ppo_bench.Bench`es on the same
shape and seed (the same random-init models and prompts), built side by side in this process; after one warm-up
update each they take turns, A B B A A B ..., so that each pair of updates sees the same machine. It prints each
phase's median for A and B, the median over pairs of B's time over A's, and in how many pairs B was faster with
the sign test's two-sided p-value; the last line is the update's (`time/total`).

A setting is `key=value` (several separated by spaces or commas):
  dtype          auto, float32, bfloat16 (`rlhf bench --dtype`)
  decode         auto, dynamic, static, compiled (`ppo.generation.decode`)
  estimator      gae, grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline
  halves         auto, on, off: a critic-free micro-batch as two halves in two threads (ExecutionPlan.split_policy)
  second_thread  auto, on, off: the value model beside the policy in the optimisation (ExecutionPlan.second_thread)
  scoring_second_thread  auto, on, off: the value and reward forwards beside the policy's in scoring
  compile_training  off, on: the training forwards under torch.compile (`runtime.compile_training`; compiled in
                 the warm-up update)
`auto` (the default of each) is the trainer's own choice on this machine.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass, field

import torch

from rlhf.models.cpu_bf16 import cpu_has_native_bf16
from rlhf.models.device import compute_dtype, configure_cpu, resolve_device

from .cli import DECODES, ESTIMATORS
from .shapes import SHAPES, cuda_refusal

CHOICES = {
    "dtype": ("auto", "float32", "bfloat16"),
    "decode": DECODES,
    "estimator": ESTIMATORS,
    "halves": ("auto", "on", "off"),
    "second_thread": ("auto", "on", "off"),
    "scoring_second_thread": ("auto", "on", "off"),
    "compile_training": ("off", "on"),
}
# the setting's name -> ExecutionPlan's field
THREADING = {
    "halves": "split_policy",
    "second_thread": "second_thread",
    "scoring_second_thread": "scoring_second_thread",
}
PHASES = ("time/generate", "time/score", "time/optimize", "time/total")


class SettingError(ValueError):
    """A setting that is not `key=value` with a known key and value: one sentence naming it."""


@dataclass
class Setting:
    dtype: str = "auto"
    decode: str = "auto"
    estimator: str = "gae"
    threading: dict[str, bool] = field(default_factory=dict)
    compile_training: str = "off"

    def describe(self) -> str:
        names = {plan_field: name for name, plan_field in THREADING.items()}
        forced = " ".join(f"{names[plan_field]}={'on' if on else 'off'}" for plan_field, on in self.threading.items())
        compiled = " compile_training=on" if self.compile_training == "on" else ""
        return f"dtype={self.dtype} decode={self.decode} estimator={self.estimator}{compiled}" + (
            f" {forced}" if forced else ""
        )


def parse_setting(text: str, which: str, estimator: str) -> Setting:
    """`--a`/`--b`'s text as a Setting; `estimator` is `--estimator`'s (the default of both)."""
    setting = Setting(estimator=estimator)
    for item in text.replace(",", " ").split():
        key, sep, value = item.partition("=")
        if not sep or key not in CHOICES:
            raise SettingError(f"--{which}: {item!r} is not one of {', '.join(f'{k}=...' for k in CHOICES)}")
        if value not in CHOICES[key]:
            raise SettingError(f"--{which}: {key} must be one of {', '.join(CHOICES[key])}, not {value!r}")
        if key in THREADING:
            if value == "auto":
                setting.threading.pop(THREADING[key], None)
            else:
                setting.threading[THREADING[key]] = value == "on"
        else:
            setattr(setting, key, value)
    return setting


def sign_test_p(wins: int, n: int) -> float:
    """Two-sided p-value of `wins` of `n` under a fair coin (ties excluded by the caller)."""
    if n == 0:
        return 1.0
    k = min(wins, n - wins)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


@dataclass
class PairedResult:
    a: list[dict[str, float]]
    b: list[dict[str, float]]

    def rows(self) -> list[tuple[str, float, float, float, int, float]]:
        """Per phase: A's median, B's median, the median of B / A over pairs, pairs where B was faster, p."""
        out = []
        for key in PHASES:
            a = [u[key] for u in self.a]
            b = [u[key] for u in self.b]
            ratios = [y / x for x, y in zip(a, b, strict=True) if x > 0]
            faster = sum(r < 1 for r in ratios)
            decided = sum(r != 1 for r in ratios)
            median_ratio = statistics.median(ratios) if ratios else float("nan")
            out.append(
                (key, statistics.median(a), statistics.median(b), median_ratio, faster, sign_test_p(faster, decided))
            )
        return out


def run_pairs(bench_a, bench_b, pairs: int, log=print) -> PairedResult:
    """One warm-up update each, then `pairs` pairs in the order A B, B A, A B, ..."""
    bench_a.update()
    bench_b.update()
    result = PairedResult([], [])
    for i in range(pairs):
        order = ((bench_a, result.a), (bench_b, result.b))
        for bench, store in order if i % 2 == 0 else order[::-1]:
            store.append(bench.update())
        a, b = result.a[-1]["time/total"], result.b[-1]["time/total"]
        log(f"pair {i + 1}/{pairs}: A {a:.3f} s, B {b:.3f} s, B/A {b / a:.3f}")
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="cpu")
    parser.add_argument("--estimator", choices=ESTIMATORS, default="gae", help="both sides' unless a setting says")
    parser.add_argument("--a", default="", help="A's setting (default: the trainer's own choices)")
    parser.add_argument("--b", default="", help="B's setting")
    parser.add_argument("--pairs", type=int, default=10, help="timed pairs of updates after the warm-up (>= 1)")
    parser.add_argument("--device", default=None, help="default: the shape's")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the shape's, 2)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = [parse_setting(args.a, "a", args.estimator), parse_setting(args.b, "b", args.estimator)]
        if args.pairs < 1:
            raise SettingError(f"--pairs must be at least 1, not {args.pairs}")
    except SettingError as error:
        print(error, file=sys.stderr)
        return 2
    shape = SHAPES[args.shape]
    if (args.device or shape.device).startswith("cuda") and not torch.cuda.is_available():
        print(cuda_refusal(args.shape), file=sys.stderr)
        return 2
    from .ppo_bench import Bench  # heavy: transformers (after the cheap refusals above)

    configure_cpu(args.threads or shape.threads)
    device = resolve_device(args.device or shape.device)
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"paired bench: shape={args.shape} device={device} threads={torch.get_num_threads()} "
        f"cpu={capability}{' native-bf16' if cpu_has_native_bf16() else ''} pairs={args.pairs}"
    )
    benches = []
    for name, setting in zip("AB", settings, strict=True):
        dtype = compute_dtype(setting.dtype, device, width=shape.n_embd)
        print(f"{name}: {setting.describe()} (dtype {str(dtype).removeprefix('torch.')})")
        benches.append(
            Bench(
                shape, device, dtype, args.pairs + 1, estimator=setting.estimator, decode=setting.decode,
                threading=setting.threading, compile_training=setting.compile_training == "on",
            )
        )  # fmt: skip
    result = run_pairs(*benches, args.pairs)
    print("phase                 A median   B median   B/A (median of pairs)   pairs B faster   sign test p")
    rows = result.rows()
    for key, a, b, ratio, faster, p in rows:
        print(f"{key:<20} {a:9.3f} s {b:9.3f} s {ratio:12.3f} {faster:16d}/{args.pairs} {p:14.3f}")
    _, _, _, ratio, faster, p = rows[-1]
    print(f"B/A time/total: {ratio:.3f} ({faster} of {args.pairs} pairs faster with B, sign test p={p:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
