"""The memory estimate on the command line: ``rlhf memory --config X --gpu-gb 24 80`` (or
``python -m rlhf.memory_report``) prints each stage's estimate (`rlhf.memory`) against GPU sizes."""

from __future__ import annotations

import argparse
import sys

from rlhf.config import load_config
from rlhf.errors import UserInputError
from rlhf.memory import FIT_SHARE, GIB, estimate, fmt_gib, read_model_config, shape_of


def main(argv: list[str] | None = None) -> int:
    """Print the per-stage estimate of a config for a device size: ``rlhf memory --config X --gpu-gb 24``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", default="conf/default.yaml")
    parser.add_argument("--model-config", help="a config.json (or its folder) to use instead of sft.model's")
    parser.add_argument("--gpu-gb", type=float, nargs="*", default=[24, 80], help="GPU sizes to compare against")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        shape = shape_of(read_model_config(config, args.model_config))
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.config}: {shape.params / 1e6:,.1f}M parameters (reward model {shape.reward_params / 1e6:,.1f}M)")
    for est in estimate(config, shape, "cuda"):
        fits = "  ".join(
            f"{gb:g} GiB: {'fits' if est.total <= FIT_SHARE * gb * GIB else 'does not fit'}" for gb in args.gpu_gb
        )
        print(
            f"  {est.stage:<9} {fmt_gib(est.total):>10}  (held {fmt_gib(est.persistent)}, peak phase "
            f"{fmt_gib(est.transient)})  {fits}"
        )
    # what a critic-free estimator saves: the value model, its gradients and optimizer states
    if config.algorithm == "ppo" and config.ppo.critic_free:
        with_critic = config.model_copy(update={"ppo": config.ppo.model_copy(update={"advantage_estimator": "gae"})})
        gae = next(e for e in estimate(with_critic, shape, "cuda") if e.stage == "ppo")
        ppo = next(e for e in estimate(config, shape, "cuda") if e.stage == "ppo")
        print(
            f"  ppo.advantage_estimator={config.ppo.advantage_estimator} loads no value model: "
            f"{fmt_gib(gae.total - ppo.total)} less than gae ({fmt_gib(gae.total)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
