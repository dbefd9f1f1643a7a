"""Prefect flows of the pipeline. Prefect's telemetry is off unless the environment turns it on (no network), and
flow runs send a heartbeat every HEARTBEAT_S seconds (read by Prefect when it is imported, so set here, before)."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# A temporary Prefect server (no PREFECT_API_URL) gets 20 s to start by default; a busy machine needs longer.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Every flow run's heartbeat (Prefect's default is 180 s): the zombie automation of flows/crashed_runs.py marks a run
# Crashed when none came for 3 of these. A worker's runs get it from prefect.yaml; served runs from flows/serve.py.
HEARTBEAT_S = 30
os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(HEARTBEAT_S))
