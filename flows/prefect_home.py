"""The Prefect database of a process that runs flows without a Prefect server (PREFECT_API_URL unset)."""

from __future__ import annotations

import os
from pathlib import Path

from rlhf.checkpoints import stage_lock

# A Prefect server keeps the leases of concurrency slots in memory by default: a restarted server has none left, so a
# slot taken before the restart is never given back, and every later `gpu` stage on that server waits for good.
# Prefect's file-backed lease storage keeps them in $PREFECT_HOME/concurrency_leases: they survive the restart, and are
# released by their task or expire as usual. Set for the servers of `make ui` and `rlhf serve`.
PERSISTENT_LEASES = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}

# Written into PREFECT_HOME once its database is migrated and its block types registered: the Prefect version that
# did it. A later process with the same version skips both (5 s of a pipeline's start; a new database takes 20 s).
READY_FILE = "database.ready"


def prepare_prefect_database() -> None:
    """Without a Prefect server (PREFECT_API_URL unset) every pipeline process starts a temporary one, which migrates
    the database in PREFECT_HOME and registers Prefect's block types in it: two pipelines started together would run
    the same migrations at once (SQLite: 'index ... already exists'), and on a new database insert the same block
    schemas at once ('UNIQUE constraint failed: block_schema.checksum', a traceback in both runs' output). Do both
    here first, one process at a time; the servers then find them done. Skipped where `READY_FILE` says this
    Prefect version did it and the SQLite file is still there. Once the database is ready, this process's temporary
    server is told not to check it again (`_skip_server_database_setup`)."""
    import asyncio

    import prefect
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_URL, PREFECT_HOME

    if PREFECT_API_URL.value():
        return
    home = Path(PREFECT_HOME.value())
    home.mkdir(parents=True, exist_ok=True)
    url = str(PREFECT_API_DATABASE_CONNECTION_URL.value() or "")
    database = Path(url.split(":///", 1)[1]) if url.startswith("sqlite") and ":///" in url else None
    ready, stamp = home / READY_FILE, f"prefect {prefect.__version__}\n"
    with stage_lock(home / "database"):
        if not (database is not None and database.is_file() and ready.is_file() and ready.read_text() == stamp):
            asyncio.run(_create_database())
            ready.write_text(stamp)
    _skip_server_database_setup()


def _skip_server_database_setup() -> None:
    """The temporary server a flow starts inherits this process's environment: with the database migrated and the
    block types registered, it need not load Prefect's ~150 migration scripts to find nothing to do, nor compare the
    block types again (seconds of every pipeline's start). A value the user set is kept."""
    os.environ.setdefault("PREFECT_API_DATABASE_MIGRATE_ON_START", "false")
    os.environ.setdefault("PREFECT_API_BLOCKS_REGISTER_ON_START", "false")


async def _create_database() -> None:
    """Migrate the database; register the block types where none are (a new database), as a server does at its start."""
    from prefect.server.database import provide_database_interface
    from prefect.server.models.block_registration import run_block_auto_registration
    from prefect.server.models.block_schemas import read_block_schemas
    from prefect.settings import PREFECT_API_BLOCKS_REGISTER_ON_START

    db = provide_database_interface()
    await db.create_db()
    if not PREFECT_API_BLOCKS_REGISTER_ON_START.value():
        return
    async with db.session_context() as session:
        registered = await read_block_schemas(session=session, limit=1)
    if not registered:
        session = await db.session()
        async with session:  # as the server's start does it
            await run_block_auto_registration(session=session)
