"""Prefect flows of the pipeline. Prefect's telemetry is off unless the environment turns it on (no network)."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# A temporary Prefect server (no PREFECT_API_URL) gets 20 s to start by default; a busy machine needs longer.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
