"""Orchestration overhead: the pipeline through Prefect and MLflow against the same library calls without them.

    make bench-overhead                   # or: .venv/bin/python benchmarks/overhead_bench.py [--rounds 3]
    make bench-overhead ARGS="--config conf/smoke.yaml --rounds 1"     # a quick run

Each run is a fresh Python process with an empty output folder, MLflow store and PREFECT_HOME of its own (a temp
folder; ``--prefect-home-from DIR`` starts that home from DIR's migrated database instead of migrating a new one),
and the two variants alternate (A, B, A, B, ...):

- A, ``prefect``: what ``make run`` does (flows/pipeline.py ``main``): load the config, preflight, create the Prefect
  database, then the ``rlhf_pipeline`` flow with its six cached tasks, each stage an MLflow child run logging
  every statistic, artifact and checkpoint into a SQLite store. The ephemeral Prefect server that the first
  Prefect call starts is started explicitly before the flow, so that its start is timed apart.
- B, ``library``: the same library calls (rlhf/) in the same order with the same config, each stage writing into
  a folder of its own, no Prefect and no MLflow imported: the log callbacks are no-ops.

The stages' times are their wall times as the flow sees them (A: the `run_stage` call, i.e. the Prefect task with
its cache key, result persistence and MLflow run; B: the library call). A's MLflow time is the time inside
`rlhf.tracking.client.Tracker`'s methods; MLflow's share of a PPO update is the time the PPO training loop's
thread spends in them (the per-update `log` callback, and the writes it waits for at its resume states) over
the loop's time; the metrics writer thread's time is reported beside it, with the loop's time in A against B. The
report is overhead_report.py, A's timing overhead_clock.py. Both variants must give the same result figures
(reward-model accuracy, PPO's final score and KL, the evaluation): the comparison is like for like. The last line is
`overhead: X%` (the pipeline's, without the server start: median of A / median of B - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # flows/ and tasks/ are folders of the checkout, not installed

from overhead_clock import Clock, instrument  # noqa: E402 (after the checkout is on sys.path)
from overhead_report import STAGES, report  # noqa: E402

ENV = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # a busy machine can take longer than Prefect's default 20 s to start the ephemeral server
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
}


def overrides(folder: Path) -> list[str]:
    """The run's outputs and MLflow store in its own (empty) folder."""
    return [
        f"runtime.output_dir={folder}/outputs",
        f"tracking.uri=sqlite:///{folder}/mlflow.db",
        f"tracking.artifact_location={folder}/artifacts",
    ]


# -- A: the Prefect flow with MLflow, instrumented ------------------------------------------------------------------


def run_prefect(config_path: str, folder: Path) -> dict:
    start = time.perf_counter()  # heavy imports, inside: their time is this side's times["imports"]
    from prefect.server.api.server import SubprocessASGIServer

    import flows.pipeline as pipeline
    from flows.prefect_home import prepare_prefect_database
    from flows.summary import format_summary
    from flows.terminal import exit_code_of
    from rlhf.config import load_config
    from rlhf.preflight import preflight
    from rlhf.tracking.client import Tracker

    times: dict[str, float] = {"imports": time.perf_counter() - start}
    start = time.perf_counter()
    config = load_config(config_path, overrides(folder))
    preflight(config)
    times["preflight"] = time.perf_counter() - start
    start = time.perf_counter()
    Tracker(config.tracking.uri, config.tracking.experiment, config.tracking.artifact_location)
    times["mlflow_store"] = time.perf_counter() - start  # creating an empty store: its first run only
    clock, outputs = Clock(), {}
    instrument(clock, times, outputs)
    start = time.perf_counter()
    prepare_prefect_database()
    times["prefect_database"] = time.perf_counter() - start
    start = time.perf_counter()
    SubprocessASGIServer().start()  # what the flow's first API call would do
    times["prefect_server"] = time.perf_counter() - start
    start = time.perf_counter()
    code, summary = exit_code_of(lambda: pipeline.rlhf_pipeline(config))
    times["pipeline"] = time.perf_counter() - start
    if code != 0 or summary is None:
        raise SystemExit(f"the pipeline failed (exit code {code})")
    print(format_summary(summary))
    policy = outputs["train_policy_ppo"]
    figures = {k: v for k, v in summary.items() if isinstance(v, float)}
    figures |= {f"ppo/{k}": v for k, v in policy.metrics.items()}
    return {
        "times": times,
        "figures": figures,
        "updates": policy.updates,
        "cached": [s for s in STAGES if getattr(outputs[s], "cached", False)],
        "seconds": dict(clock.seconds),
    }


# -- B: the library alone ---------------------------------------------------------------------------------------------


def run_library(config_path: str, folder: Path) -> dict:
    """The library calls of tasks/stages.py and tasks/policy_stages.py, in the flow's order, with no-op log callbacks;
    no Prefect, no MLflow."""
    start = time.perf_counter()  # heavy imports, inside: their time is this side's times["imports"]
    from rlhf.checkpoints import write_manifest
    from rlhf.config import load_config
    from rlhf.data import prepare
    from rlhf.data.lengths import LengthLimits
    from rlhf.eval import evaluate as evaluation
    from rlhf.models.device import configure_cpu
    from rlhf.models.loading import load_tokenizer
    from rlhf.models.stop_tokens import same_vocabulary
    from rlhf.ppo.launch import train_policy
    from rlhf.ppo.run import PolicyInputs
    from rlhf.preflight import preflight
    from rlhf.train import reward, sft

    times: dict[str, float] = {"imports": time.perf_counter() - start}
    start = time.perf_counter()
    config = load_config(config_path, overrides(folder))
    preflight(config)
    times["preflight"] = time.perf_counter() - start
    if config.runtime.ppo_processes > 1:
        raise SystemExit("the library variant runs PPO in one process (runtime.ppo_processes: 1)")
    runtime, out, seed = config.runtime, folder / "outputs", config.seed

    def noop(metrics: dict[str, float], step: int) -> None:
        return None

    def stage(name: str, call):
        configure_cpu(runtime.threads)
        begin = time.perf_counter()
        result = call(out / name)
        times[name] = time.perf_counter() - begin
        return result

    pipeline_start = time.perf_counter()
    data = stage(
        "prepare_preferences",
        lambda d: prepare.prepare_preferences(config.data, d, LengthLimits.from_config(config)),
    )
    demos, pairs = f"{data.folder}/sft.parquet", f"{data.folder}/train.parquet"
    if config.sft.model is not None and not config.sft.finetune:
        policy_sft = stage("supervised_finetune", lambda d: sft.load_existing(config.sft, runtime))
    elif config.sft.model is None:
        policy_sft = stage(
            "supervised_finetune", lambda d: sft.bootstrap_sft(config.sft, runtime, demos, pairs, d, seed, noop)
        )
    else:
        policy_sft = stage("supervised_finetune", lambda d: sft.finetune_sft(config.sft, runtime, demos, d, seed, noop))
    rm = stage(
        "train_reward_model",
        lambda d: reward.train_reward_model(
            config.reward, runtime, policy_sft.path, pairs, f"{data.folder}/eval.parquet", d, seed, noop
        ),
    )

    def init(d: Path) -> bool:
        trust = runtime.trust_remote_code
        same = same_vocabulary(
            load_tokenizer(policy_sft.path, trust_remote_code=trust), load_tokenizer(rm.path, trust_remote_code=trust)
        )
        d.mkdir(parents=True, exist_ok=True)
        write_manifest(d, stage="init", policy_init=policy_sft.path, value_init=rm.path, same_tokenizer=same)
        return same

    stage("init_policy_models", init)
    gold = prepare.gold_scorer(data.manifest)
    eval_file = f"{data.folder}/eval.parquet"
    ppo = stage(
        "train_policy_ppo",
        lambda d: train_policy(
            PolicyInputs.prepared(
                config.ppo,
                runtime,
                seed,
                data.folder,
                policy_path=policy_sft.path,
                reward_path=rm.path,
                out_dir=str(d),
                value_path=rm.path,
            )  # fmt: skip
        ),
    )
    result = stage(
        "evaluate_policies",
        lambda d: evaluation.evaluate_policies(
            config.eval, config.ppo, runtime, ppo.policy_path, policy_sft.path, rm.path, eval_file, d, gold, noop
        ),
    )
    times["pipeline"] = time.perf_counter() - pipeline_start
    times["ppo_loop"] = times["train_policy_ppo"]  # the stage is the training loop's call
    figures = {"reward/best_eval_accuracy": rm.metrics["reward/best_eval_accuracy"], **result.summary}
    figures |= {f"ppo/{k}": v for k, v in ppo.metrics.items()}
    return {"times": times, "figures": figures, "updates": ppo.updates}


# -- the driver: fresh processes, alternating -------------------------------------------------------------------------


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0]) if Path("/proc/loadavg").is_file() else float("nan")


def run_child(variant: str, config: str, folder: Path, quiet: bool, prefect_home_from: str | None = None) -> dict:
    """One variant in a fresh process (its own PREFECT_HOME, output folder and MLflow store); its wall time from
    spawn to exit is `process`. `prefect_home_from`: a Prefect home whose migrated database (prefect.db and its
    database.ready mark) the run's home starts from, as on a machine that ran the pipeline before."""
    folder.mkdir(parents=True)
    if prefect_home_from:
        (folder / "prefect").mkdir()
        for name in ("prefect.db", "database.ready"):
            shutil.copyfile(Path(prefect_home_from) / name, folder / "prefect" / name)
    result_file = folder / "result.json"
    env = {**os.environ, **ENV, "PREFECT_HOME": str(folder / "prefect"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)  # an ephemeral server of its own, as `make run` without a server
    command = [sys.executable, __file__, "--variant", variant, "--config", config, "--folder", str(folder)]
    log = open(folder / "output.log", "w") if quiet else None  # noqa: SIM115 (closed below)
    load_before, start = load1(), time.perf_counter()
    try:
        subprocess.run(command + ["--result", str(result_file)], env=env, cwd=REPO, check=True, stdout=log, stderr=log)
    except subprocess.CalledProcessError:
        if log is not None:
            log.close()
            print((folder / "output.log").read_text()[-4000:], file=sys.stderr)
        raise
    wall = time.perf_counter() - start
    if log is not None:
        log.close()
    result = json.loads(result_file.read_text())
    result["times"]["process"] = wall
    result["load"] = (load_before + load1()) / 2
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="conf/default.yaml", help="pipeline config (conf/smoke.yaml: quick)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of A then B (each a fresh process)")
    parser.add_argument("--variants", default="prefect,library", help="which to run, in this order, each round")
    parser.add_argument("--json", help="also write every run's times and figures to this file")
    parser.add_argument(
        "--prefect-home-from",
        metavar="DIR",
        help="start each run's Prefect home from this one's migrated database (default: an empty home, migrated)",
    )
    parser.add_argument("--verbose", action="store_true", help="show the runs' output (default: logged, hidden)")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="report on runs saved with --json; runs nothing")
    parser.add_argument("--variant", choices=("prefect", "library"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    config = str((REPO / args.config).resolve()) if not Path(args.config).is_absolute() else args.config
    if args.variant:  # a child: one run
        run = run_prefect if args.variant == "prefect" else run_library
        Path(args.result).write_text(json.dumps(run(config, Path(args.folder))))
        return 0
    runs: dict[str, list[dict]] = {"prefect": [], "library": []}
    if args.report:
        for saved in args.report:
            for variant, found in json.loads(Path(saved).read_text()).items():
                runs[variant] += found
        print("\n".join(report(runs, args.config)))
        return 0
    with tempfile.TemporaryDirectory(prefix="overhead-bench-") as tmp:
        for round_ in range(args.rounds):
            for variant in args.variants.split(","):
                folder = Path(tmp) / f"{variant}-{round_}"
                result = run_child(variant, config, folder, not args.verbose, args.prefect_home_from)
                runs[variant].append(result)
                if args.json:  # after every run: an interrupted bench keeps what it measured
                    Path(args.json).write_text(json.dumps(runs, indent=1))
                print(
                    f"round {round_ + 1}/{args.rounds} {variant:<8} pipeline {result['times']['pipeline']:.2f} s, "
                    f"process {result['times']['process']:.2f} s, load {result['load']:.2f}",
                    flush=True,
                )
    if not runs["prefect"]:
        return 0  # the library alone: its runs are in --json (`--report` compares saved runs)
    print("\n".join(report(runs, args.config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
