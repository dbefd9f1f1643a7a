"""The Prefect server's REST API as tools/ui_check.py uses it: its deployments, the flow runs it starts and waits
for, and their artifacts and logs; with the polling and the free port the check needs."""

from __future__ import annotations

import socket
import time

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


def deployment(api: str, name: str, timeout: float = 180) -> dict:
    """A served deployment (serve registers them one after the other)."""
    return wait_for(
        lambda: (r := httpx.get(f"{api}/deployments/name/{name}", timeout=10)).status_code == 200 and r.json(),
        timeout,
        f"the {name} deployment",
    )


def start_run(api: str, deployment_id: str, run: dict) -> str:
    """A flow run of the deployment with the form's parameters, as the form's Run button creates it."""
    created = httpx.post(
        f"{api}/deployments/{deployment_id}/create_flow_run", json={"parameters": {"run": run}}, timeout=30
    )
    created.raise_for_status()
    print(f"ui-check: flow run {created.json()['id']} started from the form's parameters {run}", flush=True)
    return created.json()["id"]


def wait_run(api: str, flow_run_id: str, timeout: float, states=("COMPLETED", "FAILED", "CRASHED", "CANCELLED")):
    def reached():
        state = httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=10).json()["state"]
        return state if state and state["type"] in states else None

    state = wait_for(reached, timeout, f"the flow run {flow_run_id}")
    print(f"ui-check: flow run {flow_run_id} {state['type']}", flush=True)
    return state


def artifacts_of(api: str, flow_run_id: str) -> dict[str, dict]:
    """The flow run's keyed artifacts (its tasks' too) by key."""
    found = httpx.post(
        f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}, timeout=10
    ).json()
    return {a["key"]: a for a in found if a.get("key")}


def logs_of(api: str, flow_run_id: str) -> list[str]:
    found = httpx.post(
        f"{api}/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}, timeout=10
    ).json()
    return [log["message"] for log in found]
