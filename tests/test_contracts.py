"""The declared contracts of the micro endpoints (`sessionlog.contracts`), against the real services on a real
nats-server: every endpoint refuses a malformed request as `INVALID_REQUEST` with msgspec's path of the field at
fault, keeps serving, and its replies decode with the declared reply type on the client side."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from natsfixtures import new_session_id
from scaffold import WAIT_S, eventually
from sessiongen import streamed_turn

from services.context_deriver.service import ContextDeriverService
from services.repairer.service import RepairerService
from services.token_auditor.service import TokenAuditorService
from sessionlog import contracts
from sessionlog.audit import AuditReport
from sessionlog.errors import InvalidRequest
from sessionlog.log import SessionLog
from sessionlog.micro import ERROR_CODE_HEADER, ERROR_HEADER, UnreadableReply, ask

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def services(log: SessionLog) -> AsyncIterator[None]:
    started = [ContextDeriverService(log), RepairerService(log), TokenAuditorService(log, raw_feed=False)]
    try:
        for service in started:
            await service.start()

        async def ready() -> bool:
            return all(service.runner.health()["ready"] for service in started)

        # Every partition claimed (the first claim round done): a stats reply counts the sessions of all of them.
        # Without this wait, a loaded machine once answered stats while three partitions were still unclaimed.
        await eventually(ready, "the services ready, every partition claimed")
        yield
    finally:
        for service in reversed(started):
            await service.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def session_id(log: SessionLog, services: None) -> str:
    writer = await log.create(new_session_id("contracts"))
    await streamed_turn(writer, "one")
    await writer.flush()
    await writer.close()
    return writer.session_id


async def refusal(log: SessionLog, subject: str, body: Any) -> tuple[str | None, str]:
    """The code and message of a raw request's error reply (None and "" for a success)."""
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = await log.nc.request(subject, payload, timeout=WAIT_S)
    headers = reply.headers or {}
    return headers.get(ERROR_CODE_HEADER), headers.get(ERROR_HEADER, "")


# Per endpoint: a malformed request and the path its refusal must name. `SID` stands for a real session id.
SID = "<session>"
MALFORMED: list[tuple[contracts.Endpoint[Any, Any], dict[str, Any], str]] = [
    (contracts.DERIVE, {"session": 5}, "$.session"),
    (contracts.DERIVE, {"session": SID, "min_seq": "3"}, "$.min_seq"),
    (contracts.DERIVE, {"session": SID, "at_seq": -2}, "$.at_seq"),
    (contracts.DERIVE, {"session": SID, "page": True}, "$.page"),
    (contracts.DERIVE, {"session": SID, "timeout_ms": 1.5}, "$.timeout_ms"),
    (contracts.DERIVE, {"session": SID, "known_generation": 0, "known_count": -1}, "$.known_count"),
    (contracts.PLAN_REPLACE, {"session": SID, "event": "x"}, "$.event"),
    (contracts.PLAN_REPLACE, {"session": [SID], "event": {}}, "$.session"),
    (contracts.CLOSE, {"session": 3}, "$.session"),
    (contracts.REPORT, {"session": SID, "min_seq": -1}, "$.min_seq"),
    (contracts.REPORT, {"session": SID, "timeout_ms": "1"}, "$.timeout_ms"),
]


@pytest.mark.parametrize(("endpoint", "body", "path"), MALFORMED, ids=[f"{e.name}-{p}" for e, _, p in MALFORMED])
async def test_a_malformed_request_is_invalid_request_naming_the_path_and_the_endpoint_keeps_serving(
    log: SessionLog, session_id: str, endpoint: contracts.Endpoint[Any, Any], body: dict[str, Any], path: str
) -> None:
    body = {k: session_id if v == SID else v for k, v in body.items()}
    code, message = await refusal(log, endpoint.subject, body)
    assert code == "INVALID_REQUEST", message
    assert f"`{path}`" in message and endpoint.subject in message, message
    # A well-formed request to the same endpoint is answered, and decodes as the declared reply.
    good = {
        contracts.DERIVE: contracts.DeriveRequest(session_id),
        contracts.PLAN_REPLACE: contracts.PlanReplaceRequest(session_id, {}),
        contracts.CLOSE: contracts.SessionRequest(session_id),
        contracts.REPORT: contracts.ReportRequest(session_id),
    }[endpoint]
    reply = await ask(log.nc, endpoint, good, timeout=WAIT_S)
    assert isinstance(reply, endpoint.reply)


WITH_FIELDS = [e for e in contracts.ENDPOINTS if e is not contracts.STATS]  # stats takes `{}`: no field to get wrong


@pytest.mark.parametrize("endpoint", WITH_FIELDS, ids=lambda e: e.name)
@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b'{"session": null}'])
async def test_a_body_that_is_not_a_request_object_is_invalid_request(
    log: SessionLog, services: None, endpoint: contracts.Endpoint[Any, Any], payload: bytes
) -> None:
    code, message = await refusal(log, endpoint.subject, payload)
    assert code == "INVALID_REQUEST", message


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b"null"])
async def test_stats_takes_an_object_or_nothing(log: SessionLog, services: None, payload: bytes) -> None:
    code, message = await refusal(log, contracts.STATS.subject, payload)
    assert code == "INVALID_REQUEST", message
    assert (await refusal(log, contracts.STATS.subject, b""))[0] is None


async def test_the_declared_replies_carry_what_a_refusal_needs(log: SessionLog, session_id: str) -> None:
    derived = await ask(log.nc, contracts.DERIVE, contracts.DeriveRequest(session=session_id), timeout=WAIT_S)
    messages = msgspec.json.decode(derived.messages)
    assert len(derived.seqs) == len(messages) > 0 and derived.open_step is None
    assert derived.header_seq is not None and derived.header_reason == "initial"
    closed = await ask(log.nc, contracts.CLOSE, contracts.SessionRequest(session_id), timeout=WAIT_S)
    assert closed == contracts.CloseReply(session_id, [])
    report = await ask(log.nc, contracts.REPORT, contracts.ReportRequest(session_id), timeout=WAIT_S)
    assert isinstance(report, AuditReport) and report.session == session_id
    stats = await ask(log.nc, contracts.STATS, contracts.StatsRequest(), timeout=WAIT_S)
    assert stats.sessions >= 1
    # The client decodes with the declared types too: a reply of another shape is refused, not guessed at.
    wrong = contracts.Endpoint(contracts.CONTEXT, "stats", contracts.StatsRequest, contracts.CloseReply)
    with pytest.raises(UnreadableReply, match="missing required field `session`"):
        await ask(log.nc, wrong, contracts.StatsRequest(), timeout=WAIT_S)


async def test_a_request_decodes_only_as_declared() -> None:
    with pytest.raises(InvalidRequest, match=r"`\$\.min_seq`"):
        contracts.DERIVE.decode_request(b'{"session": "s", "min_seq": true}')
    with pytest.raises(InvalidRequest, match="not JSON"):
        contracts.CLOSE.decode_request(b"{")
    # An empty body is `{}`; unknown keys are ignored, so an older service answers a newer client.
    assert contracts.STATS.decode_request(b"") == contracts.StatsRequest()
    assert contracts.CLOSE.decode_request(b'{"session": "s", "later": 1}') == contracts.SessionRequest("s")


async def test_a_deriver_reply_outside_the_contract_sends_the_gateway_to_the_stream_for_a_while(
    log: SessionLog, session_id: str
) -> None:
    from services.gateway.derivation import ContextDeriverClient, StreamSource

    subject = "test.contracts.derive." + new_session_id("s")
    asked: list[bytes] = []

    async def older_deriver(msg: Any) -> None:  # answers without `open_step`, `seqs`, ...
        asked.append(msg.data)
        await msg.respond(json.dumps({"session": session_id, "seq": 0, "messages": []}).encode())

    sub = await log.nc.subscribe(subject, cb=older_deriver)
    try:
        client = ContextDeriverClient(log.nc, StreamSource(log, wait_s=0.3), timeout_s=2.0, subject=subject)
        first = await client.derive(session_id, None)
        second = await client.derive(session_id, None)
    finally:
        await sub.unsubscribe()
    assert first.source == second.source == "stream" and client.fallbacks == 2
    assert len(asked) == 1, "the deriver is not asked again right after a reply that does not read"
    assert first.header is not None and second.header is not None and first.header.seq == second.header.seq


async def test_an_error_reply_whose_body_is_not_an_object_still_raises_its_typed_error(log: SessionLog) -> None:
    """A peer's error body that is not an object (or carries no integer seq) must not turn the refusal into an
    AttributeError: the code in the headers is the error."""
    from sessionlog.errors import SessionNotFound
    from sessionlog.micro import call

    subject = "test.contracts.refuse." + new_session_id("s")

    async def refuser(msg: Any) -> None:
        headers = {ERROR_CODE_HEADER: "SESSION_NOT_FOUND", ERROR_HEADER: "session x not found"}
        await log.nc.publish(msg.reply, b"[1]", headers=headers)

    sub = await log.nc.subscribe(subject, cb=refuser)
    try:
        with pytest.raises(SessionNotFound, match="session x not found") as raised:
            await call(log.nc, subject, {"session": "x"}, timeout=WAIT_S)
    finally:
        await sub.unsubscribe()
    assert raised.value.seq is None
