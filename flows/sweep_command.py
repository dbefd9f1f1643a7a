"""Run a sweep: the pipeline once per point of a search space, then a ranking (the flow: flows/sweep.py).

    rlhf sweep --config conf/default.yaml --space conf/sweeps/kl_coef.yaml [key.sub=value ...]
    make sweep SWEEP=conf/sweeps/kl_coef.yaml
    python -m flows.sweep --config ... --space ...

As `rlhf run` (flows/pipeline_command.py): the base config, the space and what every variant names are checked before
torch and transformers import (a bad one is one sentence and exit code 2), the temporary Prefect server starts while
they import, and the checks that need them (lengths, memory) follow, before anything is loaded.
"""

from __future__ import annotations

import argparse
import sys

from flows.pipeline_command import prepare_flow
from flows.terminal import exit_code_of
from rlhf.config import PipelineConfig, load_config
from rlhf.errors import UserInputError
from rlhf.preflight import check_inputs
from rlhf.sweeps.optuna_search import check_points
from rlhf.sweeps.space import SweepSpace, VariantList, expand, load_space


def check_variants(base: PipelineConfig, space: SweepSpace) -> list[PipelineConfig]:
    """Every variant's config (grid, random) or every choice's (Optuna: each parameter at each of its values or
    bounds), validated: a ConfigError naming the variant before anything runs."""
    return check_points(base, space) if space.method == "optuna" else VariantList(base, space).configs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="conf/default.yaml", help="base YAML config of every variant")
    parser.add_argument("--space", required=True, help="sweep space YAML, e.g. conf/sweeps/kl_coef.yaml")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides of the base config")
    args = parser.parse_args(argv)
    try:
        base = load_config(args.config, args.overrides)
        space = load_space(args.space)
        configs = check_variants(base, space)
        for config in configs:  # paths, data sources, checkpoints (no torch without one)
            check_inputs(config)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    refused = prepare_flow(configs, base.tracking)
    if refused is not None:
        return refused
    if space.method == "optuna":
        settings = space.optuna
        print(f"sweep {space.name}: {space.trials} Optuna trials ({settings.sampler}, pruner {settings.pruner})")
    else:
        print(f"sweep {space.name}: {len(configs)} variants ({space.method})")
        for variant in expand(space):
            print(f"  {variant.index:02d}  {variant.label}")

    def run() -> dict | None:
        # heavy: Prefect's client, the pipeline's stages, torch, transformers, MLflow (seconds)
        from flows.crashed_runs import crash_dead_runs
        from flows.sweep import rlhf_sweep

        crash_dead_runs("python -m flows.sweep")  # runs of killed processes become Crashed (flows/crashed_runs.py)
        return rlhf_sweep(base, space)

    code, result = exit_code_of(run)
    if result is not None:
        from flows.sweep import format_ranking  # heavy: the sweep flow (imported above in this process)

        print(format_ranking(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
