"""Serve the pipeline and sweep flows as Prefect deployments: run, watch and schedule them from the Prefect UI.

    make ui                                            # Prefect server + MLflow UI + this process
    python -m flows.serve [--config conf/default.yaml] [--sweep-space conf/sweeps/kl_coef.yaml]
                          [--sweep-cron "0 2 * * *"] [--pipeline-cron CRON] [--gpu-slots N] [--limit N]

Needs a Prefect server (``PREFECT_API_URL``, set by ``make ui``). Three deployments are created:

* ``rlhf-run/<config name>``: the whole pipeline from a short form: a config chosen from ``conf/`` (``--config``
  preselected) and a list of ``key=value`` overrides, validated as a whole (flows/form.py).
* ``rlhf-pipeline/<config name>``: the same pipeline, its form the full typed, documented ``PipelineConfig`` with
  the values of ``--config`` as defaults (every field editable: the advanced option).
* ``rlhf-sweep/<space name>``: a sweep over ``--sweep-space`` on top of ``--config``; with ``--sweep-cron`` it runs
  on that schedule (e.g. nightly). Every other example space of ``conf/sweeps/`` is a sweep deployment too, its
  space the form's defaults (method, a row per parameter, trials, concurrency, Optuna's settings).

Flow runs execute in subprocesses of this process, in the current folder (relative paths in the config resolve
here). Before serving, a tag concurrency limit is set on the tag ``gpu`` (the training and evaluation stages carry
it): one slot per GPU of the machine by default (one on a CPU-only machine), so concurrent runs take turns on the
devices instead of fighting over their memory (sweeps also pin each variant to its own device, flows/variants.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prefect import serve
from prefect.client.orchestration import get_client
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.settings import PREFECT_API_URL

from flows.form import form_parameters, rlhf_run
from flows.pipeline import rlhf_pipeline
from flows.sweep import rlhf_sweep
from rlhf.config import load_config
from rlhf.errors import UserInputError
from rlhf.models.device import device_names
from rlhf.sweeps.optuna_search import check_points
from rlhf.sweeps.space import load_space, variant_configs

GPU_TAG = "gpu"
SWEEP_EXAMPLES = Path(__file__).resolve().parent.parent / "conf" / "sweeps"  # each one a sweep deployment


def pipeline_parameters(config_path: str | Path) -> dict[str, Any]:
    """Default parameters of the pipeline deployment: the YAML config, validated and dumped to JSON."""
    return {"config": load_config(config_path).model_dump(mode="json")}


def sweep_parameters(config_path: str | Path, space_path: str | Path) -> dict[str, Any]:
    """Default parameters of the sweep deployment: the base config and the search space, validated."""
    base, space = load_config(config_path), load_space(space_path)
    if space.method == "optuna":  # every variant (grid, random) or choice (optuna) must be valid before it is offered
        check_points(base, space)
    else:
        variant_configs(base, space)
    return {"base": base.model_dump(mode="json"), "space": space.model_dump(mode="json")}


def deployments(
    config_path: str | Path,
    space_path: str | Path,
    sweep_cron: str | None = None,
    pipeline_cron: str | None = None,
) -> list[RunnerDeployment]:
    """The form, pipeline and sweep deployments (entrypoints by module path, so any working copy can run them)."""
    form = rlhf_run.to_deployment(
        name=Path(config_path).stem,
        parameters=form_parameters(config_path),
        cron=pipeline_cron,
        description=f"The RLHF pipeline: pick a config in conf/ ({config_path} preselected) and add key=value "
        "overrides (e.g. ppo.kl_coef=0.1). The full typed config is the rlhf-pipeline deployment's form.",
        tags=["rlhf"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    pipeline = rlhf_pipeline.to_deployment(
        name=Path(config_path).stem,
        parameters=pipeline_parameters(config_path),
        description=f"The RLHF pipeline with {config_path} as defaults, every field of the typed config in the run "
        "form (advanced; the rlhf-run deployment takes a config file and a few overrides).",
        tags=["rlhf"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    sweeps = []
    examples = sorted(SWEEP_EXAMPLES.glob("*.yaml"))
    for path in [Path(space_path), *(p for p in examples if p.resolve() != Path(space_path).resolve())]:
        sweep_params = sweep_parameters(config_path, path)
        space = sweep_params["space"]
        sweeps.append(
            rlhf_sweep.to_deployment(
                name=space["name"],
                parameters=sweep_params,
                cron=sweep_cron if path == Path(space_path) else None,
                description=f"Sweep {path.as_posix()} ({space['method']}) over {config_path}: the search space is "
                "the form's `space` (a row per parameter: values, or low/high), variants run max_concurrency at "
                "a time and are ranked.",
                tags=["rlhf", "sweep"],
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
        )
    return [form, pipeline, *sweeps]


def wait_for_api(timeout: float = 120.0) -> str:
    """Wait until the Prefect server answers ``/health``; returns the API URL."""
    url = PREFECT_API_URL.value()
    if not url:
        raise SystemExit("error: PREFECT_API_URL is not set; start a server with `make ui` (or `make prefect-ui`)")
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url.rstrip('/')}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"error: no Prefect server answered at {url} within {timeout:.0f}s")
        time.sleep(1.0)


def ensure_gpu_limit(slots: int = 1) -> None:
    """A tag concurrency limit on ``gpu``: at most `slots` GPU stages run at once across all flow runs."""
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag=GPU_TAG, concurrency_limit=slots)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="conf/default.yaml", help="defaults of the pipeline and sweep forms")
    parser.add_argument("--sweep-space", default="conf/sweeps/kl_coef.yaml", help="search space of the sweep")
    parser.add_argument("--sweep-cron", default=None, help="cron schedule of the sweep, e.g. '0 2 * * *' (nightly)")
    parser.add_argument("--pipeline-cron", default=None, help="cron schedule of the pipeline (none by default)")
    parser.add_argument(
        "--gpu-slots", type=int, default=None, help="GPU stages that may run at once (tag 'gpu'; default: GPUs, >= 1)"
    )
    parser.add_argument("--limit", type=int, default=None, help="flow runs this process executes at once")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the Prefect server")
    args = parser.parse_args(argv)
    try:
        served = deployments(args.config, args.sweep_space, args.sweep_cron or None, args.pipeline_cron or None)
    except UserInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    url = wait_for_api(args.wait)
    slots = args.gpu_slots or len(device_names("auto"))
    ensure_gpu_limit(slots)
    print(f"Prefect API {url}; concurrency limit: {slots} slot(s) for tag '{GPU_TAG}'", flush=True)
    serve(*served, limit=args.limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
