"""Multi-process PPO outside Prefect: one data-parallel training run over GPUs, nodes or CPU processes.

    torchrun --nproc_per_node 8 -m rlhf.ppo.launch --config conf/default.yaml \\
        --policy <sft checkpoint> --reward <reward model> --prompts <prompts.parquet> --out <dir> [key=value ...]
    accelerate launch --multi_gpu --num_processes 8 -m rlhf.ppo.launch ...
    accelerate launch --cpu --num_processes 2 -m rlhf.ppo.launch ...      # gloo, for trying it on a laptop

Run without a launcher it trains in one process, as the pipeline's PPO stage does. ``ppo.batch_size`` is the
global rollout batch (see docs/scaling.md section 5). Rank 0 prints the final line and, with ``--tracking-uri``,
logs the run's parameters and metrics to MLflow.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from rlhf.config import PipelineConfig, flatten, load_config
from rlhf.errors import ConfigError
from rlhf.ppo import distributed
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.trainer import TrainingInterrupted, train_ppo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf.ppo.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="pipeline YAML (ppo, runtime and seed are used)")
    parser.add_argument("--policy", required=True, help="SFT checkpoint: the initial policy and the reference")
    parser.add_argument("--reward", required=True, help="reward-model checkpoint")
    parser.add_argument("--value", default=None, help="value-model initialisation (default: the reward model)")
    parser.add_argument("--prompts", required=True, help="Parquet file with a 'prompt' column")
    parser.add_argument("--out", required=True, help="output folder: state/, rollouts/, final/ (shared by all ranks)")
    parser.add_argument("--seed", type=int, default=None, help="default: the config's seed")
    parser.add_argument("--tracking-uri", default=None, help="log to this MLflow store from rank 0")
    parser.add_argument("--experiment", default=None, help="MLflow experiment (default: tracking.experiment)")
    parser.add_argument(
        "--write-param-digest",
        action="store_true",
        help="several processes: each rank writes the digest of its final policy and value parameters to "
        "<out>/param_digest.rank<R>.txt (a check that the ranks stayed in sync)",
    )
    parser.add_argument(
        "--stop-after", type=int, default=None, help="end after N updates with the state saved, as a crash would"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, key.sub=value")
    return parser.parse_args(argv)


def read_prompts(path: str) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--prompts: {file} does not exist")
    frame = pd.read_parquet(file)
    if "prompt" not in frame.columns:
        raise ConfigError(f"--prompts: {file} has no 'prompt' column (columns: {', '.join(frame.columns)})")
    return frame["prompt"].astype(str).tolist()


LogFn = Callable[[dict[str, float], int], None]


def _tracking(args: argparse.Namespace, cfg: PipelineConfig, ctx: DistContext) -> tuple[LogFn, Callable[[bool], None]]:
    """A `log` callable (MLflow on rank 0 with --tracking-uri, else nothing) and a function that ends the run."""
    if not (ctx.is_main and args.tracking_uri):
        return (lambda metrics, step: None), (lambda failed: None)
    from rlhf.tracking import Tracker

    tracker = Tracker(args.tracking_uri, args.experiment or cfg.tracking.experiment, cfg.tracking.artifact_location)
    run_id = tracker.start_run("train_policy_ppo-launch", tags={"launcher": "rlhf.ppo.launch"})
    tracker.log_params(run_id, {**flatten(cfg.ppo, "ppo"), "seed": cfg.seed, "world_size": ctx.world_size})
    return tracker.metric_logger(run_id), (lambda failed: tracker.end_run(run_id, failed=failed))


def check_launcher() -> None:
    """`accelerate launch --cpu --num_processes N` without mpirun starts one process (accelerate's multi-CPU mode
    is MPI): say so rather than silently train on one."""
    accelerate_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true"
    if accelerate_cpu and "MASTER_ADDR" in os.environ and distributed.world_size_from_env() == 1:
        raise ConfigError(
            "accelerate launch --cpu starts a single process unless it runs under mpirun; for several CPU processes "
            "use torchrun --nproc_per_node N, or accelerate launch --multi_gpu --num_processes N with "
            "runtime.device=cpu"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_launcher()
    cfg = load_config(args.config, args.overrides)
    try:  # before any model is loaded or process group started
        distributed.check_world_size(cfg.ppo, distributed.world_size_from_env())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    prompts = read_prompts(args.prompts)
    if cfg.runtime.threads is not None:
        torch.set_num_threads(cfg.runtime.threads)
    ctx = distributed.init_distributed(cfg.runtime)
    log, end_run = _tracking(args, cfg, ctx)
    try:
        result = train_ppo(
            cfg.ppo,
            cfg.runtime,
            args.policy,
            args.reward,
            prompts,
            args.out,
            cfg.seed if args.seed is None else args.seed,
            log,
            value_path=args.value,
            stop_after=args.stop_after,
            dist=ctx,
        )
    except TrainingInterrupted as stop:
        end_run(True)
        if ctx.is_main:
            print(f"ppo: {stop}", flush=True)
        distributed.close_distributed()
        return 3
    except BaseException:
        end_run(True)
        raise
    end_run(False)
    if args.write_param_digest and result.param_digest:
        Path(args.out, f"param_digest.rank{ctx.rank}.txt").write_text(result.param_digest + "\n")
    if ctx.is_main:
        print(
            f"ppo: {result.updates} updates on {ctx.world_size} process(es); "
            f"policy {result.policy_path} (digest {result.digest[:12]})",
            flush=True,
        )
    distributed.close_distributed()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as err:  # a user's mistake: one sentence, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
