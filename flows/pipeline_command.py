"""Run the RLHF pipeline flow on a config: preferences -> SFT -> reward model -> init -> PPO (or DPO) -> evaluation.

Run it with ``make run``, ``rlhf run`` or ``python -m flows.pipeline``, with ``--config FILE`` and ``key.sub=value``
overrides. The config and what it names (paths, the data source, the SFT checkpoint) are checked first: a bad key,
value or file is one sentence and exit code 2, within a second or two where no checkpoint is named. The temporary
Prefect server then starts while torch, transformers and the flow import (`flows.temporary_server`: about 8 s of a
smoke run's 37 on a quiet 2-core machine), and the checks that need them (lengths against the model's positions,
memory against the device) follow, before any model is loaded. The flow itself is flows/pipeline.py.
"""

from __future__ import annotations

import argparse
import sys

from flows.prefect_home import prepare_prefect_database
from flows.temporary_server import start_early, stop_early
from flows.terminal import Interrupted, exit_code_of, stop_on_signals, stopped_before_the_flow
from rlhf.config import PipelineConfig, TrackingConfig, load_config
from rlhf.errors import UserInputError
from rlhf.preflight import check_fit, check_inputs


def prepare_flow(configs: list[PipelineConfig], tracking: TrackingConfig) -> int | None:
    """After the configs and their inputs are checked (`check_inputs`): the Prefect database, Ctrl-C and SIGTERM
    handling, the temporary server started, then `check_fit` of each config while torch and transformers import.
    Returns 2 (the error printed, the server stopped) where one does not fit, 130 or 143 where Ctrl-C or SIGTERM
    came meanwhile, else None."""
    prepare_prefect_database()
    stop_on_signals(tracking)  # Ctrl-C and SIGTERM: state kept, runs KILLED, no server left
    start_early()  # while the checks below and the flow's modules import torch and transformers
    try:
        for config in configs:
            check_fit(config)  # lengths, memory: before any model is loaded
    except UserInputError as err:
        stop_early()
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:  # Ctrl-C or SIGTERM while torch and transformers import
        stop_early()
        return stopped_before_the_flow(stop.signum)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="conf/default.yaml", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. ppo.kl_coef=0.1")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        check_inputs(config)  # paths, the data source, the checkpoint (no torch without one)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    refused = prepare_flow([config], config.tracking)
    if refused is not None:
        return refused

    def run() -> dict | None:
        from flows.pipeline import rlhf_pipeline  # heavy: the flow's stages, torch, transformers, MLflow (seconds)

        return rlhf_pipeline(config)

    code, summary = exit_code_of(run)
    if summary is not None:
        from flows.summary import format_summary  # heavy: Prefect tasks and MLflow

        print(format_summary(summary))
    return code


if __name__ == "__main__":
    sys.exit(main())
