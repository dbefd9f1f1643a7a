"""`make ui`'s Prefect server (flows/prefect_server.py): a request answered 503 (SQLite busy) is tried again, and a
deployment's parameter schema is checked against the metaschema once, while the parameters are validated every time.

The server under a training run, submitted to repeatedly: tests/test_ui_server.py."""

from __future__ import annotations

import asyncio

import pytest
from prefect.utilities.schema_tools import ValidationError, validate
from prefect.utilities.schema_tools import validation as prefect_validation

from flows.prefect_server import BUSY, RetryBusyRequests, check_schemas_once


def _asgi_call(app, body: bytes, path: str = "/api/deployments/d/create_flow_run") -> tuple[int, bytes]:
    """One POST through an ASGI app, its body in two parts; returns (status, response body)."""
    parts = [body[:3], body[3:]]
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app({"type": "http", "method": "POST", "path": path, "root_path": ""}, receive, send))
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _busy_then_created(busy_answers: int, raise_after_busy: bool = False):
    """An app that answers 503 `busy_answers` times (as Prefect does for 'database is locked'; Starlette raising the
    error again after answering, with `raise_after_busy`), then 201 with the request's body."""
    seen: list[bytes] = []

    async def app(scope, receive, send) -> None:
        assert scope["root_path"] == "", "the scope the client sent, not one an earlier try changed"
        scope["root_path"] += "/api"  # as Starlette's Mount does
        message = await receive()
        seen.append(message["body"])
        status = BUSY if len(seen) <= busy_answers else 201
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"busy" if status == BUSY else message["body"]})
        if status == BUSY and raise_after_busy:
            raise RuntimeError("database is locked")

    return app, seen


@pytest.mark.parametrize("raise_after_busy", [False, True])
def test_a_busy_answer_is_retried_with_the_same_body(raise_after_busy):
    app, seen = _busy_then_created(2, raise_after_busy)
    status, body = _asgi_call(RetryBusyRequests(app, retries=3, wait_s=0.01), b'{"run": 1}')
    assert (status, body) == (201, b'{"run": 1}')
    assert seen == [b'{"run": 1}'] * 3  # the whole body each time


def test_the_last_busy_answer_reaches_the_client():
    app, seen = _busy_then_created(5)
    assert _asgi_call(RetryBusyRequests(app, retries=2, wait_s=0.01), b"{}") == (BUSY, b"busy")
    assert len(seen) == 3


def test_only_the_forms_submit_is_retried():
    """Prefect's Python clients (serve, the runs) retry a 503 themselves, each try within their own timeout."""
    app, seen = _busy_then_created(1)
    assert _asgi_call(RetryBusyRequests(app, retries=2, wait_s=0.01), b"{}", "/api/deployments/") == (BUSY, b"busy")
    assert len(seen) == 1


def test_the_schema_is_checked_once_and_the_parameters_every_time(monkeypatch):
    validator = prefect_validation._VALIDATOR
    checked: list[dict] = []
    check = validator.check_schema

    def counted(schema, *args, **kwargs):
        checked.append(schema)
        return check(schema, *args, **kwargs)

    monkeypatch.setattr(validator, "check_schema", staticmethod(counted))  # restored after the test
    check_schemas_once()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"]}
    validate({"n": 2}, schema, raise_on_error=True)
    validate({"n": 3}, schema, raise_on_error=True)
    assert len(checked) == 1
    with pytest.raises(ValidationError, match="0 is less than the minimum of 1"):
        validate({"n": 0}, schema, raise_on_error=True)
    bad = {"type": "object", "properties": {"n": {"type": "no-such-type"}}}
    for _ in range(2):  # a schema that fails the check is checked (and refused) every time
        with pytest.raises(Exception, match="no-such-type"):
            validate({"n": 1}, bad, raise_on_error=True)
    assert len(checked) == 3
