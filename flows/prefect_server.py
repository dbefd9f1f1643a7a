"""`make ui`'s Prefect server: ``prefect server start`` on SQLite, with two changes that keep the run form's
Submit and the runs' own requests from failing while runs train (``python -m flows.prefect_server --host 127.0.0.1
--port 4200``).

Submitting the short run form (``POST /api/deployments/<id>/create_flow_run``) got "503 Service Unavailable" while
a run trained, and nothing in the server's log (Prefect logs retryable errors only with
PREFECT_SERVER_LOG_RETRYABLE_ERRORS). With that setting the log shows why: ``sqlite3.OperationalError: database is
locked`` on the ``INSERT INTO flow_run``. Prefect creates the run in one SQLite transaction that first reads the
deployment, then checks the parameters against the deployment's JSON schema, then writes. That check starts with
``jsonschema``'s check of the schema itself against the JSON Schema metaschema (draft 2020-12), and the form's
schema is large (about 220 KB: the batch rules of rlhf/config/schema_rules.py as if/then clauses): 5 to 25 s on two
busy cores, during which the server's event loop does nothing else. A running flow writes its logs, task states and
progress meanwhile; when one of those writes commits between the transaction's read and its write, SQLite refuses
the write (a reader's snapshot cannot become a writer after another commit), Prefect rolls back and answers 503.

1. The schema check is done once per schema (`check_schemas_once`): the deployments' schemas do not change while
   the server runs, and a schema that fails the check is checked again every time (and refused, as before). The
   parameters themselves are still validated against the schema on every run created.
2. Every transaction the server opens to write begins ``IMMEDIATE`` (`immediate_write_transactions`): it waits for
   SQLite's write lock, up to the 60 s busy timeout Prefect sets, before it reads, so the failure above cannot happen
   to it: the form's Submit needs no retry (`make ui-check ARGS="--submits 50"` while two runs and two sweeps
   trained: 50 of 50 created, 0.12 s median, 0.74 s at most). Prefect 3.9.1 begins most of them deferred, the one
   that takes a concurrency slot among them (``POST /api/v2/concurrency_limits/increment-with-lease`` reads the
   limits, then writes): on a loaded machine a run's request for its ``gpu`` slot met that failure at all six of its
   client's tries, and the run failed. Prefect's own code asks for ``IMMEDIATE`` (``with_for_update=True``) in a few
   places; a server on PostgreSQL is not changed.

Everything else is ``prefect server start``'s foreground server: the API, the UI and the background services in
one process, its settings from the environment.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any


def immediate_write_transactions() -> None:
    """Every transaction Prefect opens to write (``session_context(begin_transaction=True)``) starts with SQLite's
    ``BEGIN IMMEDIATE``, which waits for the write lock (the server's 60 s busy timeout), rather than ``BEGIN
    DEFERRED``, whose first write after a read fails at once when another connection committed meanwhile."""
    from prefect.server.database.configurations import AioSqliteConfiguration

    begin = AioSqliteConfiguration.begin_transaction

    def begin_immediate(self, session: Any, with_for_update: bool = False) -> Any:
        return begin(self, session, with_for_update=True)  # IMMEDIATE on SQLite; PostgreSQL ignores the flag

    AioSqliteConfiguration.begin_transaction = begin_immediate


def check_schemas_once() -> None:
    """Prefect's parameter validation checks the schema against the metaschema on every call: remember the schemas
    that passed (by their content), so that a deployment's schema is checked once."""
    from prefect.utilities.schema_tools import validation

    validator = validation._VALIDATOR  # the validator class Prefect's `validate` and `is_valid_schema` use
    check = validator.check_schema
    passed: set[str] = set()

    def check_once(schema: Any, *args: Any, **kwargs: Any) -> None:
        key = hashlib.sha256(json.dumps(schema, sort_keys=True, default=str).encode()).hexdigest()
        if key not in passed:
            check(schema, *args, **kwargs)  # raises SchemaError for a bad schema: never remembered
            passed.add(key)

    validator.check_schema = staticmethod(check_once)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4200)
    args = parser.parse_args(argv)
    import uvicorn
    from prefect.server.api.server import create_app
    from prefect.settings import (
        PREFECT_SERVER_API_HOST,
        PREFECT_SERVER_API_KEEPALIVE_TIMEOUT,
        PREFECT_SERVER_API_PORT,
        PREFECT_SERVER_LOGGING_LEVEL,
        temporary_settings,
    )

    immediate_write_transactions()
    check_schemas_once()
    with temporary_settings({PREFECT_SERVER_API_HOST: args.host, PREFECT_SERVER_API_PORT: args.port}):
        app = create_app(final=True)
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            timeout_keep_alive=PREFECT_SERVER_API_KEEPALIVE_TIMEOUT.value(),
            log_level=str(PREFECT_SERVER_LOGGING_LEVEL.value()).lower(),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
