"""`make ui`'s Prefect server (flows/prefect_server.py): a deployment's parameter schema is checked against the
metaschema once, while the parameters are validated every time, and concurrency slots are taken while others write,
without a 503 (the real server). A stage's request that the server still answers 503 after Prefect's retries stops
the run with one sentence (tasks/faults.py).

The server under a training run, submitted to repeatedly: tests/test_ui_server.py."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
from prefect.utilities.schema_tools import ValidationError, validate
from prefect.utilities.schema_tools import validation as prefect_validation

from flows.prefect_server import check_schemas_once
from tasks.faults import PrefectServerBusy, busy_server_in_one_sentence
from tests.conftest import prefect_server


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


@pytest.fixture
def ui_server(tmp_path):
    """`python -m flows.prefect_server` on a free port, its SQLite database a seeded copy (no UI: not needed here)."""
    yield from prefect_server(tmp_path, ["flows.prefect_server"], {"PREFECT_UI_ENABLED": "false"})


@pytest.mark.slow
def test_slots_are_taken_while_others_write(ui_server):
    """A stage's request for a `gpu` slot (what Prefect's task engine sends, sent once here: no client retries)
    while other stages take and give back slots and runs write logs. Prefect reads the limit, then takes the slot in
    the same transaction; begun DEFERRED, SQLite refused the write whenever another write committed in between, and
    the server answered 503: 15 to 17 of these 24 requests, in three tries on 2 cores. Begun IMMEDIATE, each waits its
    turn for the write lock."""
    api = ui_server
    httpx.post(f"{api}/v2/concurrency_limits/", json={"name": "tag:gpu", "limit": 100}).raise_for_status()
    take = {"names": ["tag:gpu"], "slots": 1, "mode": "concurrency", "lease_duration": 60}
    logs = [
        {"name": "rlhf", "level": 20, "message": f"step {i}", "timestamp": "2026-01-01T00:00:00Z"} for i in range(20)
    ]
    answers: Counter[str] = Counter()

    async def stage(client: httpx.AsyncClient) -> None:
        for _ in range(3):
            try:
                taken = await client.post(f"{api}/v2/concurrency_limits/increment-with-lease", json=take)
            except httpx.TransportError as err:
                answers[type(err).__name__] += 1
                continue
            answers[f"take {taken.status_code}"] += 1
            if taken.status_code == 200:
                lease = {"lease_id": taken.json()["lease_id"]}
                given = await client.post(f"{api}/v2/concurrency_limits/decrement-with-lease", json=lease)
                answers[f"give back {given.status_code}"] += 1

    async def run_writing_logs(client: httpx.AsyncClient) -> None:
        for _ in range(3):
            try:
                await client.post(f"{api}/logs/", json=logs)
            except httpx.TransportError:  # the server's answer to the stages is what counts here
                pass

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(stage(client) for _ in range(8)), *(run_writing_logs(client) for _ in range(2)))

    asyncio.run(main())
    assert answers == {"take 200": 24, "give back 204": 24}


def test_a_slot_request_answered_503_to_the_end_is_one_sentence():
    """What Prefect's task engine raises once its client's retries of the slot request all met a 503."""
    url = "http://127.0.0.1:4200/api/v2/concurrency_limits/increment-with-lease"
    busy = httpx.Response(503, request=httpx.Request("POST", url))
    with pytest.raises(PrefectServerBusy) as raised:
        with busy_server_in_one_sentence("train_policy_ppo"):
            try:
                busy.raise_for_status()
            except httpx.HTTPStatusError as err:
                raise ConcurrencySlotAcquisitionError("Unable to acquire concurrency slots on ['tag:gpu']") from err
    assert str(raised.value) == (
        "stage train_policy_ppo stopped because the Prefect server answered 503 (its database busy) to all 6 tries "
        f"of POST {url}; start the run again (the stages that finished come from the cache), with fewer runs going "
        "at once on this server"
    )
    refused = httpx.Response(422, request=httpx.Request("POST", url))
    with pytest.raises(httpx.HTTPStatusError):  # any other answer, as it came
        with busy_server_in_one_sentence("train_policy_ppo"):
            refused.raise_for_status()
