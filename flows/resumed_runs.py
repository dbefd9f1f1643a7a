"""The link from a rerun to the crashed run it resumed: when a stage of this pipeline continued the stage run of an
earlier, killed flow run (tasks/stage_runs.py tags the pipeline run with it; flows/crashed_runs.py marks the killed
run Crashed), the summary, the MLflow pipeline run and the Prefect flow run name it."""

from __future__ import annotations

from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectNotFound

from tasks.stage_runs import RESUMED_FROM_TAG
from tasks.tracking import TrackingContext, tracker_for

RESUMED_TAG = "resumed-from"  # the Prefect tag `resumed-from:<flow run name>` of a rerun that resumed a crashed run
RESUMED_FROM_RUN_TAG = "rlhf.resumed_from_run"  # the MLflow pipeline run of the flow run a rerun resumed


def resume_links(tracking: TrackingContext) -> dict[str, str]:
    """When a stage of this pipeline continued the stage run of an earlier, killed flow run (tasks/stage_runs.py tags
    the pipeline run with it), summary entries that name it (MLflow tags of the pipeline run, rows of the printed
    summary and of the evaluation table): its flow run id and name (`rlhf.resumed_from_flow_run[_name]`), its MLflow
    pipeline run (`rlhf.resumed_from_run`) and per stage `stage.<stage>.resumed_from`; and the Prefect tag
    ``resumed-from:<its name>`` on this flow run."""
    from prefect import get_run_logger

    tracker = tracker_for(tracking)
    tags = tracker.get_run(tracking.parent_run_id).data.tags
    earlier = tags.get(RESUMED_FROM_TAG)
    if not earlier:
        return {}
    suffix = ".resumed_from_flow_run"
    stages = {key.removesuffix(suffix): value for key, value in tags.items() if key.endswith(suffix)}
    names = {flow_run: flow_run for flow_run in {earlier, *stages.values()}}
    elsewhere = []  # flow runs of another Prefect server (`make run`'s temporary one, for a run resumed under make ui)
    try:
        with get_client(sync_client=True) as client:
            for flow_run in names:
                try:
                    names[flow_run] = client.read_flow_run(UUID(flow_run)).name
                except ObjectNotFound:
                    elsewhere.append(flow_run)
            context = FlowRunContext.get()
            if context is not None and context.flow_run is not None:
                current = client.read_flow_run(context.flow_run.id)
                resumed = {f"{RESUMED_TAG}:{names[flow_run]}" for flow_run in names}
                client.update_flow_run(current.id, tags=sorted({*current.tags, *resumed}))
    except Exception as err:  # noqa: BLE001 (a link, never a failed run)
        get_run_logger().warning("could not name the flow run this run resumed in Prefect: %r", err)
    for flow_run in elsewhere:
        get_run_logger().info(
            "this run resumed the saved state of flow run %s, which ran on another Prefect server (such as the "
            "temporary one of `make run`): it is named by its id",
            flow_run,
        )
    links = {RESUMED_FROM_TAG: earlier, f"{RESUMED_FROM_TAG}_name": names[earlier]}
    if (mlflow_run := tracker.pipeline_run_of_flow_run(earlier)) is not None:
        links[RESUMED_FROM_RUN_TAG] = mlflow_run
    return links | {f"{stage}.resumed_from": names[flow_run] for stage, flow_run in stages.items()}
