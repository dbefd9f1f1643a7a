"""The Prefect database of a process that runs flows without a Prefect server (PREFECT_API_URL unset)."""

from __future__ import annotations

from pathlib import Path

from rlhf.checkpoints import stage_lock


def prepare_prefect_database() -> None:
    """Without a Prefect server (PREFECT_API_URL unset) every pipeline process starts a temporary one, which migrates
    the database in PREFECT_HOME: two pipelines started together would run the same migrations at once (SQLite:
    'index ... already exists'). Run them here first, one process at a time; the servers then find them done."""
    import asyncio

    from prefect.settings import PREFECT_API_URL, PREFECT_HOME

    if PREFECT_API_URL.value():
        return
    from prefect.server.database import provide_database_interface

    home = Path(PREFECT_HOME.value())
    home.mkdir(parents=True, exist_ok=True)
    with stage_lock(home / "database"):
        asyncio.run(provide_database_interface().create_db())
