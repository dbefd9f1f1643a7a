"""The memory estimate on the command line: ``rlhf memory --config X`` (or ``python -m rlhf.memory.report``) prints
each stage's estimate for the config's own device: against this machine's RAM for a CPU config
(``runtime.device: cpu``, or ``auto`` on a machine without CUDA), against GPU sizes (24 and 80 GiB unless
``--gpu-gb`` says) for a CUDA one. ``--device cuda --gpu-gb 24`` plans a GPU run from a CPU machine, ``--device
cpu --ram-gb 16`` a CPU run of another machine."""

from __future__ import annotations

import argparse
import sys

from rlhf.config import load_config
from rlhf.errors import UserInputError
from rlhf.memory.estimates import FIT_SHARE, GIB, StageEstimate, estimate, fmt_gib, shape_of
from rlhf.memory.usage import machine_ram, process_rss
from rlhf.models.model_config import config_device_type, read_model_config


def _fits(total: float, sizes: list[tuple[str, float]]) -> str:
    return "  ".join(f"{name}: {'fits' if total <= FIT_SHARE * size else 'does not fit'}" for name, size in sizes)


def main(argv: list[str] | None = None) -> int:
    """Print the per-stage estimate of a config for its device: ``rlhf memory --config X`` (a CPU config: against
    this machine's RAM; a CUDA one: against 24 and 80 GiB GPUs, or ``--gpu-gb`` sizes)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", default="conf/default.yaml")
    parser.add_argument("--model-config", help="a config.json (or its folder) to use instead of sft.model's")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="the device to estimate for; auto: the config's runtime.device (its 'auto' resolved on this machine), "
        "or cuda when --gpu-gb is given",
    )
    parser.add_argument("--gpu-gb", type=float, nargs="*", default=None, help="GPU sizes to compare against")
    parser.add_argument("--ram-gb", type=float, nargs="*", default=None, help="RAM sizes to compare against (CPU)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        shape = shape_of(read_model_config(config.sft, config.runtime.trust_remote_code, args.model_config))
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = args.device
    if device == "auto":
        device = "cuda" if args.gpu_gb is not None else config_device_type(config.runtime.device)
    if device == "cuda":
        sizes = [(f"{gb:g} GiB", gb * GIB) for gb in (args.gpu_gb if args.gpu_gb is not None else [24, 80])]
        where = "GPU (runtime.device: " + config.runtime.device + ")"
        base = 0.0
    else:
        if args.ram_gb is not None:
            sizes = [(f"{gb:g} GiB RAM", gb * GIB) for gb in args.ram_gb]
        else:
            available, total = machine_ram()
            sizes = [(f"{fmt_gib(available)} available", available), (f"{fmt_gib(total)} RAM", total)]
        where = "CPU (runtime.device: " + config.runtime.device + "): RAM, peak resident set of each stage's process"
        base = process_rss()
    print(f"{args.config}: {shape.params / 1e6:,.1f}M parameters (reward model {shape.reward_params / 1e6:,.1f}M)")
    print(f"  on {where}")
    estimates = estimate(config, shape, device, base)
    kind = "process" if device == "cpu" else "CUDA and allocator"
    for est in estimates:
        print(
            f"  {est.stage:<9} {fmt_gib(est.total):>10}  (held {fmt_gib(est.persistent)}, peak phase "
            f"{fmt_gib(est.transient)}, {kind} {fmt_gib(est.overhead)})  "
            f"{_fits(est.total, sizes)}"
        )
    # what a critic-free estimator saves: the value model, its gradients and optimizer states
    if config.algorithm == "ppo" and config.ppo.critic_free:
        with_critic = config.model_copy(update={"ppo": config.ppo.model_copy(update={"advantage_estimator": "gae"})})
        gae = _stage(estimate(with_critic, shape, device, base), "ppo")
        ppo = _stage(estimates, "ppo")
        print(
            f"  ppo.advantage_estimator={config.ppo.advantage_estimator} loads no value model: "
            f"{fmt_gib(gae.total - ppo.total)} less than gae ({fmt_gib(gae.total)})"
        )
    return 0


def _stage(estimates: list[StageEstimate], name: str) -> StageEstimate:
    return next(e for e in estimates if e.stage == name)


if __name__ == "__main__":
    raise SystemExit(main())
