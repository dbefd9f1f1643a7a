"""The Prefect server's REST API as tools/ui_check.py uses it: its deployments, the flow runs it starts and waits
for, and their artifacts and logs; with the polling and the free port the check needs. Raw HTTP, as the UI sends it,
not Prefect 3.9's client (`read_deployment_by_name`, `run_deployment`, `wait_for_flow_run`, `api_healthcheck`): that
client retries 429, 502 and 503 answers, which would hide what the form's own requests get."""

from __future__ import annotations

import socket
import statistics
import time
from datetime import datetime, timedelta, timezone

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        time.sleep(1.0)
    raise SystemExit(f"ui-check: {what} did not happen within {timeout:.0f}s")


def deployment(api: str, name: str, timeout: float = 600) -> dict:
    """A served deployment (serve registers them one after the other: minutes on a loaded 2-core machine)."""
    return wait_for(
        lambda: (r := httpx.get(f"{api}/deployments/name/{name}", timeout=60)).status_code == 200 and r.json(),
        timeout,
        f"the {name} deployment",
    )


def start_run(api: str, deployment_id: str, run: dict) -> str:
    """A flow run of the deployment with the form's parameters, as the form's Run button creates it (a form's first
    run after the server started waits for its one schema check: tens of seconds on a loaded machine)."""
    created = httpx.post(
        f"{api}/deployments/{deployment_id}/create_flow_run", json={"parameters": {"run": run}}, timeout=180
    )
    created.raise_for_status()
    print(f"ui-check: flow run {created.json()['id']} started from the form's parameters {run}", flush=True)
    return created.json()["id"]


def wait_run(api: str, flow_run_id: str, timeout: float, states=("COMPLETED", "FAILED", "CRASHED", "CANCELLED")):
    def reached():
        state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=60).json()["state"]
        return state if state and state["type"] in states else None

    state = wait_for(reached, timeout, f"the flow run {flow_run_id}")
    print(f"ui-check: flow run {flow_run_id} {state['type']}", flush=True)
    return state


def artifacts_of(api: str, flow_run_id: str) -> dict[str, dict]:
    """The flow run's keyed artifacts (its tasks' too) by key."""
    found = httpx.post(
        f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}, timeout=60
    ).json()
    return {a["key"]: a for a in found if a.get("key")}


def logs_of(api: str, flow_run_id: str, timeout: float = 60) -> list[str]:
    found = httpx.post(
        f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}, timeout=timeout
    ).json()
    return [log["message"] for log in found]


def training(api: str, flow_run_id: str) -> bool:
    """A training task of the flow run has logged a step ('sft step 10 of 20: ...')."""
    return any(" step " in message for message in logs_of(api, flow_run_id, timeout=30))


def submit_repeatedly(api: str, deployment_id: str, run: dict, count: int) -> tuple[list[int], list[float]]:
    """The run form's Submit `count` times, each sent once (no retry by this client), a flow run scheduled a day ahead
    so that no runner starts it; the runs are deleted afterwards. Returns the status codes and the seconds each took."""
    when = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
    body = {"parameters": {"run": run}, "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": when}}}
    codes, seconds, created = [], [], []
    for _ in range(count):
        started = time.monotonic()
        answer = httpx.post(f"{api}/deployments/{deployment_id}/create_flow_run", json=body, timeout=180)
        seconds.append(time.monotonic() - started)
        codes.append(answer.status_code)
        if answer.status_code == 201:
            created.append(answer.json()["id"])
    for flow_run_id in created:
        httpx.delete(f"{api}/flow_runs/{flow_run_id}", timeout=30)
    ordered = sorted(seconds)
    print(
        f"ui-check: {count} submits: {codes.count(201)} created; seconds median {statistics.median(ordered):.2f}, "
        f"p95 {ordered[round(0.95 * (count - 1))]:.2f}, max {ordered[-1]:.2f}",
        flush=True,
    )
    return codes, seconds
