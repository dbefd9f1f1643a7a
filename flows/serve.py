"""Serve the pipeline and sweep flows as Prefect deployments: run, watch and schedule them from the Prefect UI.

    make ui                                            # Prefect server + MLflow UI + this process
    python -m flows.serve [--config conf/default.yaml] [--sweep-space conf/sweeps/kl_coef.yaml]
                          [--sweep-cron "0 2 * * *"] [--pipeline-cron CRON] [--gpu-slots N] [--limit N]

Needs a Prefect server (``PREFECT_API_URL``, set by ``make ui``). Four deployments are created, each named for its
form:

* ``rlhf-run/run-pipeline``: the whole pipeline from a short form: a config chosen from ``conf/`` (``--config``
  preselected), the PPO batch sizes and a list of ``key=value`` overrides, validated as a whole (flows/form.py);
  with ``--pipeline-cron`` it runs on that schedule.
* ``rlhf-pipeline/run-pipeline-every-setting``: the same pipeline, its form the full typed, documented
  ``PipelineConfig`` with the values of ``--config`` as defaults (every field editable: the advanced option; also
  the deployment a sweep space's ``deployment`` names to run its variants on workers).
* ``rlhf-sweep-run/run-sweep``: a sweep from a short form: its base config as ``rlhf-run/run-pipeline`` takes it, a
  search space chosen from ``conf/sweeps/`` (``--sweep-space`` preselected) and ``key=value`` overrides of the space
  (flows/form.py); with ``--sweep-cron`` it runs on that schedule (e.g. nightly).
* ``rlhf-sweep/run-sweep-every-setting``: the same sweep, its form the full typed base config and search space (a
  row per parameter, trials, concurrency, Optuna's settings) with the values of ``--config`` and ``--sweep-space``.

Flow runs execute in subprocesses of this process, in the current folder (relative paths in the config resolve
here). Before serving, a tag concurrency limit is set on the tag ``gpu`` (the training and evaluation stages carry
it): one slot per GPU of the machine by default (one on a CPU-only machine), so concurrent runs take turns on the
devices instead of fighting over their memory (sweeps also pin each variant to its own device, flows/variants.py).
Served runs send a heartbeat every 30 s, and an automation marks Crashed a run whose heartbeats stop (its process was
killed; flows/crashed_runs.py).
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

from flows import HEARTBEAT_S
from flows.crashed_runs import ensure_zombie_automation
from flows.form import form_parameters, rlhf_run, rlhf_sweep_run, sweep_form_parameters
from flows.pipeline import rlhf_pipeline
from flows.sweep import rlhf_sweep
from flows.sweep_command import check_variants
from rlhf.config import load_config
from rlhf.errors import UserInputError
from rlhf.models.device import device_names
from rlhf.stages import GPU_TAG
from rlhf.sweeps.space import load_space

# how often the served process asks the server for runs submitted from the forms: Prefect's default, 10 s, was most of
# the 10 to 16 s between Submit and a run starting (a query a second is nothing to a local server)
POLL_S = 1.0
# The deployments' names say what each does: the pipeline and the sweep from a short form, and each with every field
# of its typed config (the Deployments page lists them in this order)
PIPELINE_FORM, PIPELINE_FULL = "run-pipeline", "run-pipeline-every-setting"
SWEEP_FORM, SWEEP_FULL = "run-sweep", "run-sweep-every-setting"


def pipeline_parameters(config_path: str | Path) -> dict[str, Any]:
    """Default parameters of the pipeline deployment: the YAML config, validated and dumped to JSON."""
    return {"config": load_config(config_path).model_dump(mode="json")}


def sweep_parameters(config_path: str | Path, space_path: str | Path) -> dict[str, Any]:
    """Default parameters of the sweep deployment: the base config and the search space, validated."""
    base, space = load_config(config_path), load_space(space_path)
    check_variants(base, space)  # every variant (grid, random) or choice (optuna) must be valid before it is offered
    return {"base": base.model_dump(mode="json"), "space": space.model_dump(mode="json")}


def deployments(
    config_path: str | Path,
    space_path: str | Path,
    sweep_cron: str | None = None,
    pipeline_cron: str | None = None,
) -> list[RunnerDeployment]:
    """The short-form and every-setting deployments of the pipeline and of the sweep (entrypoints by module path, so
    any working copy can run them)."""
    form = rlhf_run.to_deployment(
        name=PIPELINE_FORM,
        parameters=form_parameters(config_path),
        cron=pipeline_cron,
        description=f"The RLHF pipeline: pick a config in conf/ ({config_path} preselected) and add key=value "
        f"overrides (e.g. ppo.kl_coef=0.1). The same pipeline with every field of the typed config in its form: "
        f"rlhf-pipeline/{PIPELINE_FULL}.",
        tags=["rlhf"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    pipeline = rlhf_pipeline.to_deployment(
        name=PIPELINE_FULL,
        parameters=pipeline_parameters(config_path),
        description=f"The RLHF pipeline with {config_path} as defaults, every field of the typed config in the run "
        f"form (advanced: the same pipeline as rlhf-run/{PIPELINE_FORM}, which takes a config file and a few "
        "overrides).",
        tags=["rlhf"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    sweep_form = rlhf_sweep_run.to_deployment(
        name=SWEEP_FORM,
        parameters=sweep_form_parameters(config_path, space_path),
        cron=sweep_cron,
        description=f"A sweep: pick a base config in conf/ ({config_path} preselected) and a search space in "
        f"conf/sweeps/ ({Path(space_path).as_posix()} preselected), and add key=value overrides of either (e.g. "
        "trials=4 for the space); the variants run max_concurrency at a time and are ranked. Every field of the "
        f"typed base config and space: rlhf-sweep/{SWEEP_FULL}.",
        tags=["rlhf", "sweep"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    sweep = rlhf_sweep.to_deployment(
        name=SWEEP_FULL,
        parameters=sweep_parameters(config_path, space_path),
        description=f"A sweep with {config_path} as its base and {Path(space_path).as_posix()} as its space, every "
        "field of both in the run form: the space's `parameters` (a row per parameter: values, or low/high), "
        f"trials, concurrency, Optuna's settings (advanced: the same sweep as rlhf-sweep-run/{SWEEP_FORM}, which "
        "picks them from conf/).",
        tags=["rlhf", "sweep"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    return [form, pipeline, sweep_form, sweep]


def wait_for_api(timeout: float = 120.0) -> str:
    """Wait until the Prefect server answers ``/health``; returns the API URL. (Prefect 3.9's `api_healthcheck()`
    retries a timed-out request with backoff, PREFECT_CLIENT_MAX_RETRIES times: a 5-second GET per try is plainer.)"""
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
    try:  # served runs send heartbeats; a run whose heartbeats stop (killed) becomes Crashed
        ensure_zombie_automation()
    except Exception as err:  # noqa: BLE001 (a server without automations still serves)
        print(f"warning: no automation marks killed runs Crashed: {err}", file=sys.stderr)
    serve(*served, limit=args.limit, heartbeat_seconds=HEARTBEAT_S, query_seconds=POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
