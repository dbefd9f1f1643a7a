"""Multi-process PPO outside Prefect: one data-parallel training run over GPUs, nodes or CPU processes.

    torchrun --nproc_per_node 8 -m rlhf.ppo.launch --config conf/default.yaml \\
        --policy <sft checkpoint> --reward <reward model> --prompts <prompts.parquet> --out <dir> [key=value ...]
    accelerate launch --multi_gpu --num_processes 8 -m rlhf.ppo.launch ...
    accelerate launch --cpu --num_processes 2 -m rlhf.ppo.launch ...      # gloo, for trying it on a laptop

Run without a launcher it trains in one process. ``ppo.batch_size`` is the global rollout batch (see
docs/scaling.md section 5). Rank 0 prints the final line and, with ``--tracking-uri``, logs the run's parameters
and metrics to MLflow (into an existing run with ``--run-id``).

The pipeline's PPO stage calls :func:`train_policy`, one entry point whatever the number of processes, with the
run's `PolicyInputs`, built once: in one process it trains in place (:func:`rlhf.ppo.trainer.train_ppo`); with
``runtime.ppo_processes`` > 1 it runs :func:`run_data_parallel`, which writes the inputs as they are to one file,
starts this module on it (``--inputs FILE``) under ``torchrun --standalone`` on the local machine and reads the
outcome back from a small JSON file (torchrun does not pass its workers' exit codes on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

from rlhf.checkpoints import atomic_write_text
from rlhf.config import TrackingConfig, flatten, load_config
from rlhf.errors import ConfigError
from rlhf.metrics import (
    EPISODES_PER_S,
    OBJECTIVE_GOLD,
    OBJECTIVE_KL,
    OBJECTIVE_KL_COEF,
    OBJECTIVE_SCORES,
    POLICY_APPROXKL,
    POLICY_CLIPFRAC,
)
from rlhf.models.device import configure_cpu
from rlhf.ppo import distributed
from rlhf.ppo.distributed import DistContext
from rlhf.ppo.run import EvalCallback, PolicyInputs, no_log
from rlhf.ppo.trainer import PPOResult, TrainingInterrupted, train_ppo
from rlhf.tracking.metrics_writer import LogFn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rlhf.ppo.launch", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--inputs", default=None, help="the run's inputs as `train_policy` wrote them (in place of the options below)"
    )
    parser.add_argument("--config", default=None, help="pipeline YAML (ppo, runtime, reward and seed are used)")
    parser.add_argument("--policy", help="SFT checkpoint: the initial policy and the reference")
    parser.add_argument("--reward", help="reward-model checkpoint (empty: reward.function scores)")
    parser.add_argument("--value", default=None, help="value-model initialisation (default: the reward model)")
    parser.add_argument("--prompts", help="Parquet file with a 'prompt' column")
    parser.add_argument("--out", help="output folder: state/, rollouts/, final/ (shared by all ranks)")
    parser.add_argument("--seed", type=int, default=None, help="default: the config's seed")
    parser.add_argument("--tracking-uri", default=None, help="log to this MLflow store from rank 0")
    parser.add_argument("--experiment", default=None, help="MLflow experiment (default: tracking.experiment)")
    parser.add_argument(
        "--run-id", default=None, help="with --tracking-uri: log into this existing MLflow run and leave it open"
    )
    parser.add_argument(
        "--data-manifest", default=None, help="manifest.json of the prepared data: log gold scores when it has them"
    )
    parser.add_argument(
        "--eval-prompts",
        default=None,
        help="Parquet file with a 'prompt' column (the held-out split): ppo.eval_every's periodic evaluation uses its "
        "first ppo.eval_n_prompts distinct prompts",
    )
    parser.add_argument(
        "--result", default=None, help="rank 0 writes the outcome (status, paths, digest, final statistics) here"
    )
    parser.add_argument("--print-every", type=int, default=0, help="rank 0 prints key statistics every N updates")
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
    args = parser.parse_args(argv)
    if args.inputs is None and not (args.policy and args.reward is not None and args.prompts and args.out):
        parser.error("give --inputs FILE, or --policy, --reward, --prompts and --out")
    return args


def inputs_from_args(args: argparse.Namespace) -> tuple[PolicyInputs, TrackingConfig]:
    """The run's inputs: the file of `--inputs`, or the pipeline config and the paths given as options; and the
    config's tracking section, for the launcher's own MLflow run (the default with `--inputs`)."""
    if args.inputs:
        return PolicyInputs.read(args.inputs), TrackingConfig()
    cfg = load_config(args.config, args.overrides)
    inputs = PolicyInputs(
        cfg.ppo, cfg.runtime, cfg.seed if args.seed is None else args.seed, args.policy, args.reward or None,
        args.prompts, args.out, value_path=args.value or None, reward=cfg.reward, eval_file=args.eval_prompts,
        data_manifest=args.data_manifest, stop_after=args.stop_after,
    )  # fmt: skip
    return inputs, cfg.tracking


def _tracking(
    args: argparse.Namespace, inputs: PolicyInputs, tracking: TrackingConfig, ctx: DistContext
) -> tuple[LogFn, Callable[[bool], None]]:
    """A `log` callable (MLflow on rank 0 with --tracking-uri, else nothing) and a function that ends the run
    (a no-op for a run named by --run-id: its owner ends it)."""
    printer = _printer(args.print_every, inputs.ppo.num_updates) if ctx.is_main and args.print_every > 0 else None
    if not (ctx.is_main and args.tracking_uri):
        return (printer or (lambda metrics, step: None)), (lambda failed: None)
    from rlhf.tracking.client import Tracker  # heavy: MLflow, on rank 0 only (the other ranks log nothing)

    tracker = Tracker(args.tracking_uri, args.experiment or tracking.experiment, tracking.artifact_location)
    if args.run_id:
        run_id, end = args.run_id, (lambda failed: None)
    else:
        run_id = tracker.start_run("train_policy_ppo-launch", tags={"launcher": "rlhf.ppo.launch"})
        tracker.log_params(run_id, {**flatten(inputs.ppo, "ppo"), "seed": inputs.seed, "world_size": ctx.world_size})
        end = lambda failed: tracker.end_run(run_id, failed=failed)  # noqa: E731
    logger = tracker.metric_logger(run_id)
    if printer is None:
        return logger, end

    def log(metrics: dict[str, float], step: int) -> None:
        logger(metrics, step)
        printer(metrics, step)

    return log, end


# The line rank 0 prints for an update (`--print-every`); the pipeline's PPO task reads the step from it.
UPDATE_LINE = "ppo update {step}: {stats}"
UPDATE_LINE_PATTERN = r"^ppo update (\d+):"


def _printer(every: int, total: int) -> LogFn:
    """Print key statistics every `every` updates and at the last one (the pipeline's progress bar reads them: the
    watched numbers of tasks/progress.py, score, KL, KL coefficient and gold score, are among them)."""
    keys = (
        OBJECTIVE_SCORES,
        OBJECTIVE_KL,
        OBJECTIVE_KL_COEF,
        OBJECTIVE_GOLD,
        POLICY_APPROXKL,
        POLICY_CLIPFRAC,
        EPISODES_PER_S,
    )

    def show(metrics: dict[str, float], step: int) -> None:
        if step % every == 0 or step == total:
            shown = ", ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
            print(UPDATE_LINE.format(step=step, stats=shown), flush=True)

    return show


def _write_result(path: str | None, status: str, **fields) -> None:
    """Rank 0 (or a process that failed before the group started) records the outcome for the caller."""
    if path and int(os.environ.get("RANK", "0")) == 0:
        atomic_write_text(Path(path), json.dumps({"status": status, **fields}, default=str))


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
    try:
        return _main(args)
    except ConfigError as err:
        _write_result(args.result, "config_error", message=str(err))
        raise


def _main(args: argparse.Namespace) -> int:
    check_launcher()
    inputs, tracking = inputs_from_args(args)
    # before any model is loaded or process group started
    world_size = distributed.world_size_from_env()
    distributed.check_world_size(inputs.ppo, world_size)
    distributed.check_sharding(inputs.ppo, inputs.runtime, world_size)
    run = inputs.policy_run(digests=args.write_param_digest)  # the prompts read: a missing file is one sentence
    configure_cpu(inputs.runtime.threads)
    ctx = distributed.init_distributed(inputs.runtime)
    run.log, end_run = _tracking(args, inputs, tracking, ctx)
    try:
        result = train_ppo(run, ctx)
    except TrainingInterrupted as stop:
        end_run(True)
        if ctx.is_main:
            print(f"ppo: {stop}", flush=True)
        _write_result(args.result, "interrupted", message=str(stop))
        distributed.close_distributed()
        return 3
    except BaseException as err:
        end_run(True)
        _write_result(args.result, "failed", message=f"{type(err).__name__}: {err}")
        raise
    end_run(False)
    _write_result(args.result, "completed", **dataclasses.asdict(result), world_size=ctx.world_size)
    if args.write_param_digest and result.param_digest:
        Path(inputs.out_dir, f"param_digest.rank{ctx.rank}.txt").write_text(result.param_digest + "\n")
    if ctx.is_main:
        print(
            f"ppo: {result.updates} updates on {ctx.world_size} process(es); "
            f"policy {result.policy_path} (digest {result.digest[:12]})",
            flush=True,
        )
    distributed.close_distributed()
    return 0


def run_data_parallel(
    inputs: PolicyInputs,
    processes: int,
    *,
    tracking_uri: str | None = None,
    run_id: str | None = None,
    echo: Callable[[str], None] = print,
    print_every: int = 10,
) -> PPOResult:
    """PPO as `processes` data-parallel processes on this machine (``torchrun --standalone``: one per GPU, or gloo
    processes on CPU), for a Python caller such as the pipeline's PPO stage. The inputs are written as they are to
    ``<out>/launch_inputs.yaml``, which every process reads (``--inputs``). Blocks until they end and echoes their
    output line by line. Resumes from ``out_dir/state`` like :func:`train_ppo`. Rank 0 logs into the MLflow run
    `run_id` of `tracking_uri` and runs the periodic evaluation (no `on_eval` across processes).

    Raises :class:`TrainingInterrupted` (``stop_after``), :class:`ConfigError` (the launcher's one sentence), or
    ``RuntimeError`` with the tail of the output when the processes failed otherwise.
    """
    out = Path(inputs.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs_file, result_file = out / "launch_inputs.yaml", out / "launch_result.json"
    inputs.write(inputs_file)
    result_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command += ["-m", "rlhf.ppo.launch", "--inputs", str(inputs_file)]
    command += ["--result", str(result_file), "--print-every", str(print_every)]
    if tracking_uri:
        command += ["--tracking-uri", tracking_uri] + (["--run-id", run_id] if run_id else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # torchrun sets 1 thread per process (with a banner) unless told; share the cores out instead
    threads = inputs.runtime.threads or max(1, (os.cpu_count() or 1) // processes)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    tail: deque[str] = deque(maxlen=30)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip():
                echo(line.rstrip())
                tail.append(line)
    outcome = json.loads(result_file.read_text()) if result_file.is_file() else {"status": "crashed"}
    status = outcome.pop("status")
    if status == "completed" and proc.returncode == 0:
        outcome.pop("world_size", None)
        return PPOResult(**outcome)
    if status == "interrupted":
        raise TrainingInterrupted(outcome["message"])
    if status == "config_error":
        raise ConfigError(outcome["message"])
    raise RuntimeError(
        f"data-parallel PPO ({processes} processes) exited with code {proc.returncode} "
        f"({outcome.get('message', status)}); last output:\n" + "".join(tail)
    )


def train_policy(
    inputs: PolicyInputs,
    *,
    processes: int = 1,
    log: LogFn | None = None,
    on_eval: EvalCallback | None = None,
    echo: Callable[[str], None] = print,
    tracking_uri: str | None = None,
    run_id: str | None = None,
) -> PPOResult:
    """The policy stage on `inputs` (`PolicyInputs.prepared`: the SFT checkpoint, the reward model, the prepared
    data), in one process or in `processes` data-parallel ones on this machine; resumes from ``out_dir/state``.

    One process (:func:`rlhf.ppo.trainer.train_ppo`): `log` gets the logged updates' metrics (None: nothing logs)
    and `on_eval` the periodic evaluations. Several (:func:`run_data_parallel`): rank 0 logs the metrics into the
    MLflow run `run_id` of `tracking_uri` itself, `echo` gets the processes' output line by line, and `log` and
    `on_eval` are not called. Raises :class:`TrainingInterrupted` after `inputs.stop_after` updates, with the state
    saved.
    """
    if processes > 1:
        return run_data_parallel(inputs, processes, tracking_uri=tracking_uri, run_id=run_id, echo=echo)
    return train_ppo(inputs.policy_run(log or no_log, on_eval))


def _exit(code: int) -> None:
    """End a launched rank's process once its work is written (results, checkpoints, the MLflow run ended, the process
    group destroyed): with `os._exit` where torchrun started several processes, skipping the interpreter's teardown.
    Tearing down modules that still reference gloo objects (FSDP's and torch.distributed.checkpoint's) sometimes
    aborted a rank that had finished ("terminate called without an active exception", SIGABRT: seen once in about
    twenty FSDP runs on the 2-core CI machine, also a known flake of PyTorch's own gloo tests), failing a run whose
    outputs were all saved."""
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed.world_size_from_env() > 1:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    try:
        _exit(main())
    except ConfigError as err:  # a user's mistake: one sentence, no traceback
        print(f"error: {err}", file=sys.stderr)
        _exit(2)
