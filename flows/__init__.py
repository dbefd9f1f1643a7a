"""Prefect flows of the pipeline. Prefect's telemetry is off unless the environment turns it on (no network)."""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
