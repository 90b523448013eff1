"""Record mode end to end: a real nats-server, the gateway and the scripted provider over HTTP, and a client that
knows nothing of sessionlog (plain OpenAI-shaped requests made with httpx) under `/record/{session}/v1`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
from natsfixtures import new_session_id
from scaffold import Opened, eventually

from services.gateway import GatewayConfig, ScriptedProvider, ServerThread, UpstreamConfig, build_app, record_events
from services.gateway import record as record_module
from services.gateway.record_events import DryRun, Exchange
from services.repairer.service import RepairerService
from sessionlog.audit import RawAssembler, audit_session
from sessionlog.cli import main as cli_main
from sessionlog.embedded import free_port
from sessionlog.errors import HeaderDiverges, SessionLogError
from sessionlog.jsonl import read_jsonl
from sessionlog.log import SessionLog
from sessionlog.openai_wire import ends_with_done, parse_raw_response
from sessionlog.reader import RawFeed, StreamReader, read_raw_exchanges
from sessionlog.session import Session
from sessionlog.settings import Settings
from sessionlog.wire import Divergence, canonical, to_wire

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(90)]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            "strict": True,
        },
    }
]
READ_CALL = {"id": "call_1", "name": "read_file", "arguments": '{"path": "notes.txt"}'}
SYSTEM = {"role": "system", "content": "You are a careful assistant."}
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def provider() -> Iterator[ScriptedProvider]:
    yield ScriptedProvider()


@pytest.fixture(scope="module")
def provider_server(provider: ScriptedProvider) -> Iterator[ServerThread]:
    with ServerThread(provider.app()) as server:
        yield server


def record_settings(provisioned: Settings, **changes: Any) -> Settings:
    keys = {digest(KEY_A): "tenant-a", digest(KEY_B): "tenant-b"}
    return provisioned.model_copy(update={"gateway_keys": keys, **changes})


def record_config(settings: Settings, provider_url: str) -> GatewayConfig:
    upstream = UpstreamConfig("scripted", provider_url + "/v1", timeout_s=2.0, connect_timeout_s=1.0)
    return GatewayConfig(upstream=upstream, derivation="stream", derive_wait_s=0.5, raw_stream=settings.raw_stream)


@pytest.fixture(scope="module")
def gateway(provisioned: Settings, provider_server: ServerThread) -> Iterator[ServerThread]:
    settings = record_settings(provisioned)
    with ServerThread(build_app(settings, record_config(settings, provider_server.url))) as server:
        yield server


@pytest.fixture(scope="module")
def refusing_gateway(provisioned: Settings, provider_server: ServerThread) -> Iterator[ServerThread]:
    settings = record_settings(provisioned, gateway_history_edits="refuse")
    with ServerThread(build_app(settings, record_config(settings, provider_server.url))) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def http(gateway: ServerThread) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {KEY_A}"}) as client:
        yield client


@pytest.fixture(autouse=True)
def fresh_provider(provider: ScriptedProvider) -> None:
    provider.load([])
    provider.clear()


def base(server: ServerThread, session_id: str) -> str:
    return f"{server.url}/record/{session_id}/v1"


async def complete(
    http: httpx.AsyncClient, server: ServerThread, session_id: str, body: dict[str, Any]
) -> httpx.Response:
    return await http.post(base(server, session_id) + "/chat/completions", content=msgspec.json.encode(body))


def sse_message(data: bytes) -> dict[str, Any]:
    """The assistant message a streaming client assembles and appends (content null when there is no text)."""
    raw = parse_raw_response(data)
    message: dict[str, Any] = {"role": "assistant", "content": raw.text or None}
    if raw.tool_calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, name, arguments in raw.tool_calls
        ]
    return message


async def hang_up_at(http: httpx.AsyncClient, url: str, body: dict[str, Any], marker: bytes) -> None:
    """Stream a request and close the connection as soon as the bytes received hold `marker`."""
    async with http.stream("POST", url + "/chat/completions", json=body) as response:
        assert response.status_code == 200
        seen = b""
        async for data in response.aiter_bytes():
            seen += data
            if marker in seen:
                break


async def load(log: SessionLog, session_id: str) -> Session:
    _, session, _ = await log.load(session_id)
    return session


def types(session: Session) -> list[str]:
    return [e.type for e in session if e.type != "assistant/chunk"]


async def raw_exchanges(log: SessionLog, settings: Settings, session_id: str, count: int) -> list[Any]:
    """The gateway's raw tee for the session (waits until `count` exchanges are there)."""
    js = log.js

    async def read() -> list[Any]:
        sub = await js.subscribe(f"sessionlog.raw.{session_id}", stream=settings.raw_stream, ordered_consumer=True)
        assembler = RawAssembler()
        out = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.3)
                except Exception:
                    break
                out += assembler.take(dict(msg.headers or {}), msg.data)
        finally:
            await sub.unsubscribe()
        return out

    found: list[Any] = []

    async def enough() -> bool:
        nonlocal found
        found = await read()
        return len(found) >= count

    await eventually(enough, f"{count} raw exchanges of {session_id}")
    return found


def theorem_requests(session: Session) -> list[dict[str, Any]]:
    """For each step with chunks or a message: to_wire of the prefix before its answer (SPEC 6's theorem)."""
    out = []
    for event in session:
        first_answer = event.type == "assistant/chunk" or (
            event.type == "assistant/message"
            and event.surface_op == "append"
            and event.data.message.source.kind == "model"
        )
        if not first_answer:
            continue
        turn, step = event.data.turn, event.data.step
        if any(r["key"] == (turn, step) for r in out):
            continue
        prefix = Session(e.raw for e in list(session)[: event.seq])
        header = prefix.fold_request_header()
        assert header is not None
        out.append({"key": (turn, step), "request": to_wire(prefix.derive_messages(), header)})
    return [r["request"] for r in out]


def without_transport(body: bytes) -> dict[str, Any]:
    request = msgspec.json.decode(body)
    request.pop("stream", None)
    request.pop("stream_options", None)
    return request  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------- the happy paths


async def test_a_streamed_tool_loop_is_logged_and_the_provider_receives_the_derivation(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, provisioned: Settings
) -> None:
    sid = new_session_id("rec")
    provider.load([
        {"reasoning_content": "I should read it.", "text": "Let me look.", "tool_calls": [READ_CALL]},
        {"text": "The notes say hello."},
    ])  # fmt: skip
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "What do my notes say?"}]
    common = {"model": "scripted-model", "tools": TOOLS, "temperature": 1.0, "parallel_tool_calls": False,
              "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    first = await complete(http, gateway, sid, {**common, "messages": messages})
    assert first.status_code == 200, first.text
    reply = sse_message(first.content)
    assert reply["tool_calls"][0]["id"] == "call_1"
    # what a real client does: append the returned message as it holds it (no reasoning, `name` on the tool message)
    messages += [reply, {"role": "tool", "tool_call_id": "call_1", "name": "read_file", "content": "hello"}]
    second = await complete(http, gateway, sid, {**common, "messages": messages})
    assert second.status_code == 200, second.text
    assert sse_message(second.content)["content"] == "The notes say hello."

    session = await load(log, sid)
    assert types(session) == [
        "turn/start", "step/start", "request/header", "user/message",
        "assistant/message", "tool/call",
        "tool/result", "step/end", "step/start",
        "assistant/message", "step/end", "turn/end",
    ]  # fmt: skip
    assert session.open_turn is None
    header = session.fold_request_header()
    assert header is not None
    assert msgspec.json.decode(header.raw)["tools"][0]["strict"] is True
    # the provider received exactly the derivation before each step's answer, canonical bytes
    received = [without_transport(b) for b in provider.received]
    assert [canonical(r) for r in received] == [canonical(r) for r in theorem_requests(session)]
    assert received[1]["messages"][2]["reasoning_content"] == "I should read it."  # kept though the client dropped it
    assert received[1]["parallel_tool_calls"] is False and received[1]["temperature"] == 1.0
    # the audit, against the raw tee, finds nothing
    raw = await raw_exchanges(log, provisioned, sid, 2)
    report = audit_session(session, raw, session_id=sid).report()
    assert report.findings == [] and report.raw_matched == 2


async def test_a_non_streaming_exchange_logs_the_message_and_its_usage(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, provisioned: Settings
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "Hi there.", "usage": {"prompt_tokens": 11, "completion_tokens": 3}}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    response = await complete(http, gateway, sid, body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "Hi there."
    session = await load(log, sid)
    assert types(session) == ["turn/start", "step/start", "request/header", "user/message", "assistant/message",
                              "step/end", "turn/end"]  # fmt: skip
    message = next(e for e in session if e.type == "assistant/message")
    assert msgspec.json.decode(message.raw)["data"]["usage"] == {"inputTokens": 11, "outputTokens": 3}
    assert without_transport(provider.received[0])["messages"] == [{"role": "user", "content": "Hi"}]
    raw = await raw_exchanges(log, provisioned, sid, 1)
    assert audit_session(session, raw, session_id=sid).report().findings == []


async def test_models_are_listed_under_the_record_base_url(http: httpx.AsyncClient, gateway: ServerThread) -> None:
    response = await http.get(base(gateway, new_session_id("rec")) + "/models")
    assert response.status_code == 200, response.text
    assert response.json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------- history edits


async def two_turns(http: httpx.AsyncClient, server: ServerThread, provider: ScriptedProvider, sid: str) -> list[Any]:
    """Two plain turns through record mode; returns the messages the client holds after them."""
    provider.load([{"text": "First answer."}, {"text": "Second answer."}])
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "First question?"}]
    for question in ("Second question?", None):
        response = await complete(http, server, sid, {"model": "scripted-model", "messages": messages})
        assert response.status_code == 200, response.text
        messages.append(response.json()["choices"][0]["message"])
        if question:
            messages.append({"role": "user", "content": question})
    return messages


async def test_a_client_compaction_is_logged_as_a_replacement_with_provenance_and_the_transcript_keeps_it(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    await two_turns(http, gateway, provider, sid)
    before = await load(log, sid)
    originals = [e.seq for e in before.transcript()]
    compacted = [SYSTEM, {"role": "user", "content": "Summary: two questions, two answers."},
                 {"role": "user", "content": "Third question?"}]  # fmt: skip
    provider.load([{"text": "Third answer."}])
    response = await complete(http, gateway, sid, {"model": "scripted-model", "messages": compacted})
    assert response.status_code == 200, response.text
    session = await load(log, sid)
    replace = next(e for e in session if e.is_replace)
    assert replace.type == "user/message"
    assert replace.surface_op == {"op": "replace", "start": originals[0], "end": originals[-1]}
    assert replace.source_event_seqs == sorted(before.surface.nodes)  # every shadowed node
    assert [e.seq for e in session.transcript()][: len(originals)] == originals  # the originals stay
    assert without_transport(provider.received[-1])["messages"] == compacted
    assert canonical(theorem_requests(session)[-1]) == canonical(without_transport(provider.received[-1]))
    assert session.open_turn is None and session.generation == 1


async def test_a_compaction_that_keeps_the_last_exchange_replaces_only_what_it_summarises(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, provisioned: Settings
) -> None:
    """The common framework compaction: older messages become one summary, the latest exchange is kept as it was.
    Only the summarised nodes are shadowed; what the client kept is not logged a second time."""
    sid = new_session_id("rec")
    held = await two_turns(http, gateway, provider, sid)  # [system, u1, a1, u2, a2]
    before = await load(log, sid)
    nodes = list(before.surface.nodes)
    compacted = [SYSTEM, {"role": "user", "content": "Summary: the first question was answered."},
                 *held[3:], {"role": "user", "content": "Third question?"}]  # fmt: skip
    provider.load([{"text": "Third answer."}])
    response = await complete(http, gateway, sid, {"model": "scripted-model", "messages": compacted})
    assert response.status_code == 200, response.text
    session = await load(log, sid)
    replaces = [e for e in session if e.is_replace]
    assert len(replaces) == 1 and replaces[0].type == "user/message"
    assert replaces[0].surface_op == {"op": "replace", "start": nodes[0], "end": nodes[1]}
    assert replaces[0].source_event_seqs == nodes[:2]
    assert list(session.surface.nodes[1:3]) == nodes[2:4]  # the kept exchange is the same events, not copies
    shown = [e.data.content[0].text for e in session.transcript() if e.type == "user/message"]
    assert shown == ["First question?", "Second question?", "Third question?"]  # each once, originals kept
    assert without_transport(provider.received[-1])["messages"] == compacted
    assert canonical(theorem_requests(session)[-1]) == canonical(without_transport(provider.received[-1]))
    report = audit_session(session, await raw_exchanges(log, provisioned, sid, 3), session_id=sid).report()
    assert report.findings == []


async def test_a_compaction_in_the_middle_of_a_tool_loop_logs_the_result_in_its_step_then_the_summary(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, provisioned: Settings
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "First answer."}, {"text": "", "tool_calls": [READ_CALL]}, {"text": "It says hello."}])
    body = {"model": "scripted-model", "tools": TOOLS}
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "First question?"}]
    first = await complete(http, gateway, sid, {**body, "messages": messages})
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "Read my notes"}]
    second = await complete(http, gateway, sid, {**body, "messages": messages})
    assert second.status_code == 200, second.text
    messages.append(second.json()["choices"][0]["message"])
    nodes = list((await load(log, sid)).surface.nodes)
    compacted = [SYSTEM, {"role": "user", "content": "Summary: a first question was answered."}, *messages[3:],
                 {"role": "tool", "tool_call_id": "call_1", "content": "hello"}]  # fmt: skip
    third = await complete(http, gateway, sid, {**body, "messages": compacted})
    assert third.status_code == 200, third.text
    session = await load(log, sid)
    replace = next(e for e in session if e.is_replace)
    assert replace.surface_op == {"op": "replace", "start": nodes[0], "end": nodes[1]}
    result = next(e for e in session if e.type == "tool/result")
    assert result.seq < replace.seq and result.data.step == 1 and result.data.turn == 2  # in the call's own step
    assert without_transport(provider.received[-1])["messages"] == compacted
    assert canonical(theorem_requests(session)[-1]) == canonical(without_transport(provider.received[-1]))
    assert session.open_turn is None
    report = audit_session(session, await raw_exchanges(log, provisioned, sid, 3), session_id=sid).report()
    assert report.findings == []


async def test_a_truncation_and_an_edited_tool_result_are_logged_without_splitting_a_tool_pair(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, provisioned: Settings
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "", "tool_calls": [READ_CALL]}, {"text": "It says hello."}, {"text": "Again."}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read my notes"}]
    body = {"model": "scripted-model", "tools": TOOLS}
    first = await complete(http, gateway, sid, {**body, "messages": messages})
    messages += [first.json()["choices"][0]["message"], {"role": "tool", "tool_call_id": "call_1", "content": "hello"}]
    second = await complete(http, gateway, sid, {**body, "messages": messages})
    assert second.status_code == 200, second.text
    # the framework shortens the tool output it keeps in context, drops the last answer, and asks again
    edited = [*messages[:2], {"role": "tool", "tool_call_id": "call_1", "content": "hel…"}]
    third = await complete(http, gateway, sid, {**body, "messages": edited})
    assert third.status_code == 200, third.text
    session = await load(log, sid)
    replace = next(e for e in session if e.is_replace)
    assert replace.type == "assistant/message"  # starts at the call, so the pair stays whole
    sent = without_transport(provider.received[-1])["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"] and sent[2]["content"] == "hel…"
    assert session.open_turn is None
    assert msgspec.json.decode(replace.raw)["data"]["message"]["source"]["kind"] == "client"  # not a new answer
    report = audit_session(session, await raw_exchanges(log, provisioned, sid, 3), session_id=sid).report()
    assert report.findings == [] and report.raw_matched == 3
    assert report.ledger.total.requests == 3 and report.ledger_difference == []


async def test_the_refuse_policy_refuses_a_history_edit_and_the_provider_receives_nothing(
    http: httpx.AsyncClient, refusing_gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    await two_turns(http, refusing_gateway, provider, sid)
    length = len(await load(log, sid))
    provider.clear()
    compacted = [SYSTEM, {"role": "user", "content": "Summary."}, {"role": "user", "content": "Third?"}]
    response = await complete(http, refusing_gateway, sid, {"model": "scripted-model", "messages": compacted})
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "DERIVATION_DIVERGES"
    assert response.headers["x-should-retry"] == "false"
    assert provider.received == []
    assert len(await load(log, sid)) == length


# ---------------------------------------------------------------------------------------------- one at a time, tenants


async def test_a_concurrent_request_is_session_busy_and_the_session_is_free_after_the_reply(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "slow", "delay_s": 1.0}, {"text": "next"}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    slow = asyncio.ensure_future(complete(http, gateway, sid, body))

    async def provider_has_it() -> bool:
        return len(provider.received) == 1

    await eventually(provider_has_it, "the first request reaching the provider")
    busy = await complete(http, gateway, sid, body)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "SESSION_BUSY"
    assert busy.headers["x-should-retry"] == "false"
    first = await slow
    assert first.status_code == 200
    follow = [*body["messages"], first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    nxt = await complete(http, gateway, sid, {"model": "scripted-model", "messages": follow})
    assert nxt.status_code == 200, nxt.text
    assert len(provider.received) == 2


async def test_a_session_belongs_to_the_tenant_that_created_it(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "yours"}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    assert (await complete(http, gateway, sid, body)).status_code == 200
    header = await log.header(sid)
    assert header is not None and msgspec.json.decode(header)["tenant"] == "tenant-a"
    url = base(gateway, sid) + "/chat/completions"
    async with httpx.AsyncClient(timeout=10) as other:
        foreign = await other.post(url, json=body, headers={"authorization": f"Bearer {KEY_B}"})
        assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "SESSION_NOT_FOUND"
        for headers in ({}, {"authorization": "Bearer sk-wrong"}):
            anonymous = await other.post(url, json=body, headers=headers)
            assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "UNAUTHORIZED"
    assert len(provider.received) == 1


async def test_another_tenants_key_gets_not_found_while_the_session_answers_too(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider
) -> None:
    """Found probing record mode, 2026-12-05: while the session was answering, another tenant's key got 409
    SESSION_BUSY, which told it that the session exists and is in use; it gets 404 as when the session is idle."""
    sid = new_session_id("rec")
    provider.load([{"text": "mine"}, {"text": "a slow answer of many words", "chunk_delay_s": 0.3}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    assert (await complete(http, gateway, sid, body)).status_code == 200
    url = base(gateway, sid) + "/chat/completions"
    follow = {**body, "stream": True, "messages": [*body["messages"], {"role": "assistant", "content": "mine"},
                                                    {"role": "user", "content": "more"}]}  # fmt: skip
    async with http.stream("POST", url, content=msgspec.json.encode(follow)) as streaming:
        assert streaming.status_code == 200
        lines = streaming.aiter_lines()
        await anext(lines)  # the session is answering now
        async with httpx.AsyncClient(timeout=10) as other:
            foreign = await other.post(url, json=body, headers={"authorization": f"Bearer {KEY_B}"})
        assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "SESSION_NOT_FOUND", foreign.text
        rest = [line async for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and len(rest) > 3  # the answer was still streaming when the other key came


async def test_a_tenant_whose_request_is_still_unchecked_does_not_make_the_session_another_tenants(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a first request with another tenant's key is still being checked against the log, the session is not
    known to be that tenant's: a request meanwhile is busy (409), not told the session is not found (found reviewing
    the early tenant check, 2026-12-05)."""
    sid = new_session_id("rec")
    real_header = SessionLog.header

    async def slow_header(self: SessionLog, session_id: str) -> bytes | None:
        if session_id == sid:
            await asyncio.sleep(0.5)  # tenant B's request is being checked against the log
        return await real_header(self, session_id)

    monkeypatch.setattr(SessionLog, "header", slow_header)
    provider.load([{"text": "yours"}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    url = base(gateway, sid) + "/chat/completions"
    async with httpx.AsyncClient(timeout=10) as other:
        first = asyncio.ensure_future(other.post(url, json=body, headers={"authorization": f"Bearer {KEY_B}"}))
        await asyncio.sleep(0.2)
        meanwhile = await complete(http, gateway, sid, body)
        assert (await first).status_code == 200
    assert meanwhile.status_code == 409 and meanwhile.json()["error"]["code"] == "SESSION_BUSY", meanwhile.text


# ---------------------------------------------------------------------------------------------- failures


async def test_a_client_that_disconnects_mid_stream_leaves_an_aborted_turn_and_its_next_request_extends_the_log(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "one two three four five six seven eight", "chunk_delay_s": 0.2}, {"text": "ok"}])
    messages = [{"role": "user", "content": "count"}]
    body = {"model": "scripted-model", "stream": True, "messages": messages}
    await hang_up_at(http, base(gateway, sid), body, b'"content":"one')  # the user pressed stop after the first word

    async def aborted() -> bool:
        session = await load(log, sid)
        return session.open_turn is None and any(e.type == "turn/end" for e in session)

    await eventually(aborted, "the turn ended after the disconnect")
    session = await load(log, sid)
    end = [e for e in session if e.type == "turn/end"][-1]
    assert msgspec.json.decode(end.raw)["data"]["reason"] == {"kind": "aborted", "reason": {"kind": "user"}}
    assert any(e.type == "assistant/chunk" for e in session)
    assert not any(e.type == "assistant/message" for e in session)
    again = [*messages, {"role": "user", "content": "again"}]
    follow = await complete(http, gateway, sid, {"model": "scripted-model", "messages": again})
    assert follow.status_code == 200, follow.text
    assert not any(e.is_replace for e in await load(log, sid))


async def test_a_client_that_hangs_up_after_the_last_line_has_the_whole_answer_logged_as_complete(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, provisioned: Settings
) -> None:
    """The OpenAI Python SDK closes a stream as soon as it reads `data: [DONE]`; a provider may keep its body open a
    moment after it. The answer was whole: it is logged as complete, not as a turn the user aborted (found when the
    full suite ran loaded, `test_the_openai_python_sdk_unmodified_streaming_and_not_with_a_tool_loop`)."""
    sid = new_session_id("rec")
    provider.load([{"text": "all of it", "end_delay_s": 1.0}])
    body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "say it"}]}
    await hang_up_at(http, base(gateway, sid), body, b"data: [DONE]")  # at once, as the SDK does

    async def closed() -> bool:
        return (await load(log, sid)).open_turn is None

    await eventually(closed, "the turn ended")
    session = await load(log, sid)
    end = [e for e in session if e.type == "turn/end"][-1]
    assert msgspec.json.decode(end.raw)["data"]["reason"] == {"kind": "completed"}
    (message,) = [e for e in session if e.type == "assistant/message"]
    assert msgspec.json.decode(message.raw)["data"]["message"]["content"] == [{"type": "text", "text": "all of it"}]
    (raw,) = await raw_exchanges(log, provisioned, sid, 1)
    assert raw.outcome == "complete"


@pytest.mark.parametrize(
    ("chunks", "done"),
    [
        ([b'data: {"x":1}\n\n', b"data: [DONE]\n\n"], True),
        ([b'data: {"x":1}\n\ndata: [DO', b"NE]\n\n"], True),  # the last line split over two pieces
        ([b"data:[DONE]\r\n\r\n"], True),
        ([b'data: {"x":1}\n\ndata: [DONE]'], True),
        ([b'data: {"x":1}\n\n'], False),
        ([b'data: {"text":"data: [DONE]"}\n\n'], False),  # the words inside a chunk's text
        ([b"data: [DONE]\n\n", b'data: {"x":1}\n\n'], False),  # a line after it: not the stream's end
        ([], False),
    ],
)
async def test_the_end_of_a_stream_is_its_done_line_however_the_bytes_were_cut(chunks: list[bytes], done: bool) -> None:
    assert ends_with_done(chunks) is done


async def test_a_provider_error_ends_the_turn_as_an_error_and_a_retry_continues(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    provider.load([{"status": 500, "error": "overloaded"}, {"text": "fine now"}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    failed = await complete(http, gateway, sid, body)
    assert failed.status_code >= 500
    session = await load(log, sid)
    end = [e for e in session if e.type == "turn/end"][-1]
    reason = msgspec.json.decode(end.raw)["data"]["reason"]
    assert reason["kind"] == "error" and reason["error"]["status"] == 500
    assert reason["error"]["code"] == "UPSTREAM_ERROR"
    retried = await complete(http, gateway, sid, body)
    assert retried.status_code == 200, retried.text
    session = await load(log, sid)
    assert [e.type for e in session if e.type.startswith("turn/")] == ["turn/start", "turn/end"] * 2
    assert not any(e.is_replace for e in session)
    assert without_transport(provider.received[1]) == without_transport(provider.received[0])


@pytest.mark.parametrize("stream", [True, False])
async def test_an_error_the_provider_sends_inside_a_200_answer_ends_the_turn_as_an_error(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    provisioned: Settings,
    stream: bool,
) -> None:
    """A provider that fails once it has sent its status sends an error object instead of (or after) chunks; the SDKs
    raise it. The turn ends as an error naming it, so the client's retry extends the log (found probing record mode,
    2026-12-05: logged as a completed answer, 'partial' or empty, and the retry then logged as a history edit)."""
    sid = new_session_id("rec")
    provider.load([{"text": "partial answer that breaks", "error_after": 2, "error": "overloaded"}, {"text": "fine"}])
    body = {"model": "scripted-model", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    failed = await complete(http, gateway, sid, body)
    assert failed.status_code == 200 and b'"overloaded"' in failed.content  # relayed as the provider sent it
    session = await load(log, sid)
    assert [e.type for e in session if e.type in ("assistant/message", "tool/call")] == []
    end = [e for e in session if e.type == "turn/end"][-1]
    reason = msgspec.json.decode(end.raw)["data"]["reason"]
    assert reason["kind"] == "error" and reason["error"]["code"] == "UPSTREAM_ERROR", reason
    assert "overloaded" in reason["error"]["message"] and "scripted_error" in reason["error"]["message"]
    retried = await complete(http, gateway, sid, body)
    assert retried.status_code == 200, retried.text
    session = await load(log, sid)
    assert [e.type for e in session if e.type.startswith("turn/")] == ["turn/start", "turn/end"] * 2
    assert not any(e.is_replace for e in session)
    report = audit_session(session, await raw_exchanges(log, provisioned, sid, 2), session_id=sid).report()
    assert report.findings == []


async def test_a_client_that_gives_up_on_an_answer_and_asks_again_at_once_is_answered_not_refused_busy(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The OpenAI SDK whose read timeout fires mid-answer closes the connection and sends the request again at once.
    The gateway ends the first answer (aborted) once it has seen the disconnect; the retry, which can come before
    that, waits for it instead of getting a final 409 SESSION_BUSY (found probing record mode, 2026-12-05: 2 of 7
    retries refused on a loaded machine). Here the end of the first answer is made to come late, to show it."""
    real_ended = Exchange.ended

    async def late_ended(self: Exchange, outcome: str, status: int, **kwargs: Any) -> bool:
        if outcome == "client_disconnected":
            await asyncio.sleep(0.3)  # the disconnect seen only after the retry came (a loaded machine)
        return await real_ended(self, outcome, status, **kwargs)

    monkeypatch.setattr(Exchange, "ended", late_ended)
    sid = new_session_id("rec")
    provider.load([{"text": "a slow answer of many words", "chunk_delay_s": 2.0}, {"text": "fast"}])
    body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    url = base(gateway, sid) + "/chat/completions"
    async with http.stream("POST", url, content=msgspec.json.encode(body)) as first:
        assert first.status_code == 200
        async for _line in first.aiter_lines():
            break  # the first line, then the client gives up and hangs up
    retried = await http.post(url, content=msgspec.json.encode(body), timeout=10)
    assert retried.status_code == 200, retried.text
    session = await load(log, sid)
    reasons = [msgspec.json.decode(e.raw)["data"]["reason"]["kind"] for e in session if e.type == "turn/end"]
    assert reasons == ["aborted", "completed"]


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_with_two_tool_calls_of_one_id_ends_the_turn_as_an_error_naming_it(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, stream: bool
) -> None:
    """A provider's answer whose two tool calls share an id cannot be logged as calls (no result could say which it
    answers): the turn ends as an error naming the id, and the client's echo of the answer is refused with 422
    naming the second call. Found probing record mode, 2026-12-05: logging the answer failed, the turn was left
    open, and the echo got 409 STRUCTURE_INVALID citing seqs the log does not have."""
    sid = new_session_id("rec")
    twice = [{**READ_CALL, "id": "dup"}, {**READ_CALL, "id": "dup", "arguments": '{"path": "b.txt"}'}]
    provider.load([{"text": "", "tool_calls": twice}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read both"}]
    body = {"model": "scripted-model", "tools": TOOLS, "stream": stream, "messages": messages}
    answered = await complete(http, gateway, sid, body)
    assert answered.status_code == 200, answered.text  # the client has the provider's answer as it was
    session = await load(log, sid)
    assert [e.type for e in session][-2:] == ["step/end", "turn/end"]
    assert not [e for e in session if e.type in ("assistant/message", "tool/call")]
    reason = msgspec.json.decode(session[len(session) - 1].raw)["data"]["reason"]
    assert reason["kind"] == "error" and "'dup'" in reason["error"]["message"], reason
    echo = {"role": "assistant", "content": None,
            "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"],
                                                                              "arguments": c["arguments"]}}
                           for c in twice]}  # fmt: skip
    before = await log.reader.events(sid)
    refused = await complete(http, gateway, sid, {**body, "stream": False, "messages": [
        *messages, echo, {"role": "tool", "tool_call_id": "dup", "content": "a"},
        {"role": "tool", "tool_call_id": "dup", "content": "b"}]})  # fmt: skip
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == "$.messages[1].tool_calls[1].id"
    assert await log.reader.events(sid) == before


@pytest.mark.parametrize("status", [200, 429])
async def test_the_providers_retry_and_rate_limit_headers_reach_the_client(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, status: int
) -> None:
    """`retry-after-ms` and `x-ratelimit-*` are what the SDKs read to pace a client (found probing record mode,
    2026-12-05: only `retry-after` was relayed, and only on errors); the gateway's own headers stay."""
    sid = new_session_id("rec")
    sent = {"retry-after": "2", "retry-after-ms": "1500", "x-ratelimit-remaining-requests": "7",
            "x-ratelimit-reset-tokens": "6m0s", "x-provider-private": "not relayed"}  # fmt: skip
    provider.load([{"text": "ok", "status": status, "error": "slow down", "headers": sent}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    answer = await complete(http, gateway, sid, body)
    assert answer.status_code == status, answer.text
    for name in ("retry-after", "retry-after-ms", "x-ratelimit-remaining-requests", "x-ratelimit-reset-tokens"):
        assert answer.headers.get(name) == sent[name], (name, dict(answer.headers))
    assert "x-provider-private" not in answer.headers and answer.headers["x-sessionlog-request-id"]


async def test_a_second_result_for_a_call_is_refused_as_a_second_result(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """Found probing record mode, 2026-12-05: two results for one call were refused saying that no assistant
    message made the call, which one had."""
    sid = new_session_id("rec")
    provider.load([{"text": "", "tool_calls": [READ_CALL]}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read my notes"}]
    body = {"model": "scripted-model", "tools": TOOLS, "messages": messages}
    first = await complete(http, gateway, sid, body)
    assert first.status_code == 200, first.text
    result = {"role": "tool", "tool_call_id": "call_1", "content": "hello"}
    messages += [first.json()["choices"][0]["message"], result, {**result, "content": "hello again"}]
    before = await log.reader.events(sid)
    refused = await complete(http, gateway, sid, {**body, "messages": messages})
    assert refused.status_code == 409, refused.text
    assert "a second tool result for call 'call_1'" in refused.json()["error"]["message"]
    assert await log.reader.events(sid) == before


async def test_a_request_that_waits_too_long_for_the_answer_before_it_to_be_logged_is_a_503_to_retry(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The answer before it is over but its logging does not end (the log unavailable): the request waits, then is
    503 `LOG_UNAVAILABLE`, which the SDKs retry. It was 409 `SESSION_BUSY` with `x-should-retry: false`, though the
    session was answering nothing (found probing record mode with nats-server stopped, 2026-12-05)."""
    monkeypatch.setattr(record_module, "_FINISH_WAIT_S", 0.3)
    real_ended = Exchange.ended

    async def stuck_ended(self: Exchange, outcome: str, status: int, **kwargs: Any) -> bool:
        self.finishing()
        await asyncio.sleep(1.5)  # the end cannot be flushed for a while
        return await real_ended(self, outcome, status, **kwargs)

    monkeypatch.setattr(Exchange, "ended", stuck_ended)
    sid = new_session_id("rec")
    provider.load([{"text": "first"}, {"text": "second"}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    first = asyncio.ensure_future(complete(http, gateway, sid, body))
    await asyncio.sleep(0.5)  # the provider has answered; the gateway is logging the end
    follow = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "first"},
                                   {"role": "user", "content": "more"}]}  # fmt: skip
    waited = await complete(http, gateway, sid, follow)
    assert waited.status_code == 503 and waited.json()["error"]["code"] == "LOG_UNAVAILABLE", waited.text
    assert "x-should-retry" not in waited.headers
    assert (await first).status_code == 200
    assert (await complete(http, gateway, sid, follow)).status_code == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_whose_end_cannot_be_logged_never_reaches_the_client_as_complete(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    """The log is unavailable when the answer ends: the client gets an error where it would have got `data: [DONE]`
    (the SDKs raise it) or, not streamed, 503 LOG_UNAVAILABLE instead of the answer, so it never goes on from an answer
    the log does not hold. Found probing record mode with nats-server stopped, 2026-12-05: the client had the whole
    answer, the log 9 of 20 chunks and no end, and the next request logged the answer as the client's own message."""
    from sessionlog.errors import LogUnavailable

    async def unavailable(self: Exchange, *args: Any) -> None:
        raise LogUnavailable("publish the end of the answer: no responders (nats-server stopped)")

    monkeypatch.setattr(Exchange, "_log_end", unavailable)
    sid = new_session_id("rec")
    provider.load([{"text": "an answer the log will not hold"}])
    body = {"model": "scripted-model", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    answered = await complete(http, gateway, sid, body)
    if stream:
        assert answered.status_code == 200
        lines = [line for line in answered.text.splitlines() if line.startswith("data: ")]
        assert "data: [DONE]" not in lines, lines
        error = msgspec.json.decode(lines[-1][6:])["error"]
        assert error["code"] == "LOG_UNAVAILABLE", lines[-1]
        assert any('"content":"an ' in line for line in lines[:-1])  # the text came as it streamed, then the error
    else:
        assert answered.status_code == 503 and answered.json()["error"]["code"] == "LOG_UNAVAILABLE", answered.text
        assert "x-should-retry" not in answered.headers


@contextlib.asynccontextmanager
async def gateway_process(
    url: str, provider_server: ServerThread
) -> AsyncIterator[tuple[subprocess.Popen[bytes], str]]:
    """A gateway in a process of its own (1 s leases), serving once this yields (the process and its URL); killed
    at the end if it still runs."""
    port = free_port()
    env = {
        **os.environ,
        "SESSIONLOG_NATS_URL": url,
        "SESSIONLOG_GATEWAY_PORT": str(port),
        "SESSIONLOG_PROVIDER_BASE_URL": provider_server.url + "/v1",
        "SESSIONLOG_LEASE_TTL_S": "1",
        "SESSIONLOG_METRICS_PORT": "0",
        "SESSIONLOG_GATEWAY_KEYS": msgspec.json.encode({digest(KEY_A): "tenant-a"}).decode(),
    }
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen([sys.executable, "-m", "services.gateway", "--derivation", "stream"], env=env, cwd=root,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        gateway_url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=10) as client:

            async def up() -> bool:
                try:
                    return (await client.get(gateway_url + "/healthz")).status_code == 200
                except httpx.HTTPError:
                    return process.poll() is not None  # ends the wait; the assert below says why

            await eventually(up, "the gateway process serving")
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        yield process, gateway_url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@contextlib.asynccontextmanager
async def a_repairer(url: str) -> AsyncIterator[None]:
    """A repairer (1 s leases, 0.3 s grace) running while the block runs."""
    async with Opened(url, lease_ttl_s=1, repair_grace_s=0.3) as opened:
        service = opened.keep_service(RepairerService(await opened.connect()))
        await service.start()
        yield


async def repaired_by_a_repairer(url: str, log: SessionLog, sid: str, what: str) -> None:
    """A repairer started for the purpose closes the session's open turn."""

    async def closed() -> bool:
        return (await load(log, sid)).open_turn is None

    async with a_repairer(url):
        await eventually(closed, what)


async def test_a_gateway_killed_mid_stream_leaves_an_open_turn_that_the_repairer_closes(
    provider_server: ServerThread, provider: ScriptedProvider, log: SessionLog, url: str
) -> None:
    sid = new_session_id("rec")
    async with (
        gateway_process(url, provider_server) as (process, gateway_url),
        httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {KEY_A}"}) as client,
    ):
        provider.load([{"text": "one two three four five six seven eight nine ten", "chunk_delay_s": 0.3}])
        body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "count"}]}
        url_ = f"{gateway_url}/record/{sid}/v1/chat/completions"

        async def chunks_logged() -> bool:
            try:
                return any(e.type == "assistant/chunk" for e in await load(log, sid))
            except SessionLogError:
                return False

        async with client.stream("POST", url_, json=body) as response:
            assert response.status_code == 200
            seen = b""
            async for data in response.aiter_bytes():
                seen += data
                if b'"content":"two' in seen:
                    await eventually(chunks_logged, "the first chunks durable")
                    # mid-stream, the client still reading: the turn stays open under a lease nobody refreshes
                    process.send_signal(signal.SIGKILL)
                    process.wait(timeout=10)
                    break
    session = await load(log, sid)
    assert session.open_turn is not None and session.open_step is not None
    length = len(session)
    await repaired_by_a_repairer(url, log, sid, "the repairer closing the turn")
    session = await load(log, sid)
    closers = [e.type for e in list(session)[length:]]
    assert closers == ["step/end", "turn/end"]
    assert msgspec.json.decode(session[len(session) - 1].raw)["data"]["reason"] == {"kind": "interrupted"}


# ---------------------------------------------------------------------------------------------- the tools on the result


async def cli(monkeypatch: pytest.MonkeyPatch, settings: Settings, *argv: str) -> int:
    monkeypatch.setenv("SESSIONLOG_NATS_URL", settings.nats_url or "")
    return await asyncio.to_thread(cli_main, list(argv))


async def test_export_check_derive_transcript_and_audit_agree_with_what_the_provider_received(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    provisioned: Settings,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    sid = new_session_id("rec")
    await two_turns(http, gateway, provider, sid)
    provider.load([{"text": "Third answer.", "usage": {"prompt_tokens": 30, "completion_tokens": 2}}])
    compacted = [SYSTEM, {"role": "user", "content": "Summary."}, {"role": "user", "content": "Third question?"}]
    assert (await complete(http, gateway, sid, {"model": "scripted-model", "messages": compacted})).status_code == 200
    await raw_exchanges(log, provisioned, sid, 3)
    out = tmp_path / "rec.jsonl"
    assert await cli(monkeypatch, provisioned, "export", sid, "-o", str(out)) == 0
    assert await cli(monkeypatch, provisioned, "check", str(out)) == 0
    assert "ok: " in capfd.readouterr().out
    session = Session(read_jsonl(out).events)
    requests = theorem_requests(session)
    assert [canonical(r) for r in requests] == [canonical(without_transport(b)) for b in provider.received]
    answer = next(e.seq for e in reversed(list(session)) if e.type == "assistant/message")
    assert await cli(monkeypatch, provisioned, "derive", str(out), "--at", str(answer - 1)) == 0
    derived = msgspec.json.decode(capfd.readouterr().out)
    texts = [block["text"] for message in derived for block in message["content"]]
    assert texts == [m["content"] for m in compacted[1:]]  # what the provider received, message for message
    assert await cli(monkeypatch, provisioned, "transcript", str(out), "--json") == 0
    shown = capfd.readouterr().out
    assert "First question?" in shown and "Second answer." in shown  # the compaction erased nothing
    assert await cli(monkeypatch, provisioned, "audit", sid, "--local", "--json") == 0
    report = msgspec.json.decode(capfd.readouterr().out)
    assert report["findings"] == [] and report["ledger_difference"] == []
    assert report["provider_ledger"]["total"]["requests"] == 3 == report["ledger"]["total"]["requests"]


async def test_a_long_sessions_raw_tee_stores_requests_as_deltas_that_every_reader_rebuilds_byte_for_byte(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, provisioned: Settings
) -> None:
    sid = new_session_id("rec")
    system = {"role": "system", "content": "You are a careful assistant. " * 200}  # about 6 KB repeated every time
    messages: list[dict[str, Any]] = [system]
    rounds = 6
    for n in range(rounds):
        provider.load([{"text": f"Answer {n}.", "usage": {"prompt_tokens": 10 + n, "completion_tokens": 2}}])
        messages.append({"role": "user", "content": f"Question {n}?"})
        body = {"model": "scripted-model", "messages": messages, "stream": n % 2 == 1}
        assert (await complete(http, gateway, sid, body)).status_code == 200
        messages.append({"role": "assistant", "content": f"Answer {n}."})
    await raw_exchanges(log, provisioned, sid, rounds)
    # the stream: the first request whole, every later one a delta of the one before, much smaller than its body
    stored: list[tuple[dict[str, str], bytes, int]] = []
    reader = StreamReader(log.nc, provisioned.raw_stream)
    batch, _ = await reader.direct_batch(f"sessionlog.raw.{sid}", 1)
    for message in batch:
        if message.headers.get("Sessionlog-Kind") == "request":
            stored.append((message.headers, message.data, message.stream_seq))
    assert len(stored) == rounds and "Sessionlog-Base" not in stored[0][0]
    assert all(h["Sessionlog-Base"] and int(h["Sessionlog-Root-Seq"]) == stored[0][2] for h, _, _ in stored[1:])
    assert all(len(data) < 600 for _, data, _ in stored[1:])
    # a reader of the whole subject rebuilds exactly the bytes the provider received
    exchanges = await read_raw_exchanges(log.nc, provisioned.raw_stream, sid)
    assert [e.request for e in exchanges] == list(provider.received)
    session = await load(log, sid)
    report = audit_session(session, exchanges, session_id=sid).report()
    assert report.findings == [] and report.raw_matched == rounds
    # a feed that starts at the fourth request (a token-auditor replica from its checkpoint) reads the bases again
    feed = RawFeed(reader)
    late: list[Any] = []
    for message in batch:
        if message.stream_seq >= stored[3][2]:
            late += await feed.take(message.subject, message.stream_seq, message.headers, message.data)
    assert [e.request for e in late] == list(provider.received)[3:]


async def test_audit_exits_non_zero_when_there_are_findings(
    log: SessionLog, provisioned: Settings, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    writer = await log.create(new_session_id("bad"))
    try:
        await writer.emit("turn/start", {"turn": 1})
        await writer.emit("step/start", {"turn": 1, "step": 1})
        for chunk in ({"type": "block-start", "index": 0, "blockType": "text"},
                      {"type": "text-delta", "index": 0, "text": "streamed"},
                      {"type": "finish", "reason": {"kind": "stop"}}):  # fmt: skip
            await writer.emit("assistant/chunk", {"turn": 1, "step": 1, "chunk": chunk})
        message = {"id": "a1", "role": "assistant", "source": {"kind": "model"},
                   "content": [{"type": "text", "text": "something else"}]}  # fmt: skip
        await writer.emit("assistant/message", {"turn": 1, "step": 1, "message": message}, surface_op="append",
                          source_event_seqs=[2, 3, 4])  # fmt: skip
        await writer.emit("step/end", {"turn": 1, "step": 1})
        await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    finally:
        await writer.close()
    assert await cli(monkeypatch, provisioned, "audit", writer.session_id, "--local") == 1
    assert "MESSAGE_DIFFERS_FROM_CHUNKS" in capfd.readouterr().out


async def test_a_session_held_by_a_writer_that_does_not_answer_is_a_503_to_retry_when_its_lease_expires(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """Held by a writer no gateway replica speaks for (an agent writing the session itself, or a gateway killed
    whose lease has not expired yet): 503 `SESSION_HELD` that says the holder does not answer and names its lease,
    with `retry-after` (its TTL), so that the SDKs retry when it can succeed. It was 409 `SESSION_BUSY` saying "another
    gateway replica that is answering it", then 409 with `x-should-retry: false` saying the holder does not answer,
    which made an unmodified client crash after any gateway kill -9 (found probing record mode, 2026-12-05)."""
    sid = new_session_id("rec")
    writer = await log.create(sid, tenant="tenant-a")
    try:
        provider.load([{"text": "never"}])
        body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
        refused = await complete(http, gateway, sid, body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "SESSION_HELD", refused.text
        message = refused.json()["error"]["message"]
        assert "does not answer" in message and "held by" in message and "answering it" not in message, message
        assert refused.headers["retry-after"] == str(math.ceil(log.settings.lease_ttl_s))
        assert "x-should-retry" not in refused.headers
        assert provider.received == []
    finally:
        await writer.close()


async def test_a_second_replica_takes_an_idle_session_over_and_is_refused_a_busy_one(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provisioned: Settings,
    provider_server: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
) -> None:
    sid = new_session_id("rec")
    settings = record_settings(provisioned)
    with ServerThread(build_app(settings, record_config(settings, provider_server.url))) as replica:
        provider.load([{"text": "", "tool_calls": [READ_CALL]}, {"text": "done", "delay_s": 1.0}, {"text": "after"}])
        messages: list[dict[str, Any]] = [{"role": "user", "content": "read"}]
        body = {"model": "scripted-model", "tools": TOOLS}
        first = await complete(http, gateway, sid, {**body, "messages": messages})
        assert first.status_code == 200, first.text
        # the turn is open (a tool call is pending) and the first replica holds the session; the second asks for it
        messages += [first.json()["choices"][0]["message"], {"role": "tool", "tool_call_id": "call_1", "content": "x"}]
        slow = asyncio.ensure_future(complete(http, replica, sid, {**body, "messages": messages}))

        async def provider_has_it() -> bool:
            return len(provider.received) == 2

        await eventually(provider_has_it, "the second request reaching the provider through the replica")
        busy = await complete(http, gateway, sid, {**body, "messages": messages})  # the replica is answering
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "SESSION_BUSY"
        second = await slow
        assert second.status_code == 200, second.text
        messages += [second.json()["choices"][0]["message"], {"role": "user", "content": "and now?"}]
        back = await complete(http, gateway, sid, {**body, "messages": messages})  # and back to the first replica
        assert back.status_code == 200, back.text
    session = await load(log, sid)
    assert types(session).count("turn/end") == 2 and not any(e.is_replace for e in session)
    assert [canonical(r) for r in theorem_requests(session)] == [
        canonical(without_transport(b)) for b in provider.received
    ]


@pytest.mark.parametrize("letting_go", ["restart", "idle"])
async def test_a_tool_loop_across_a_gateway_restart_or_an_idle_let_go_goes_on_in_the_same_turn(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provisioned: Settings,
    provider_server: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    url: str,
    letting_go: str,
) -> None:
    """A gateway that lets go of a session while the client runs a tool (it restarts, or the session was idle past
    `SESSIONLOG_GATEWAY_RECORD_IDLE_S`) parks its lease: a repairer leaves the turn open, and the client's result
    goes on in it. (It was closed as interrupted, as if a writer had died, and the result logged as an edit; found
    by probing record mode, 2026-12-05.)"""
    sid = new_session_id("rec")
    provider.load([{"text": "", "tool_calls": [READ_CALL]}, {"text": "It says hello."}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read my notes"}]
    body = {"model": "scripted-model", "tools": TOOLS}
    settings = record_settings(provisioned, lease_ttl_s=1, gateway_record_idle_s=1.0)
    with ServerThread(build_app(settings, record_config(settings, provider_server.url))) as letting:
        first = await complete(http, letting, sid, {**body, "messages": messages})
        assert first.status_code == 200, first.text
        if letting_go == "idle":

            async def parked() -> bool:
                lease = await log.leases.current(sid)
                return lease is not None and lease.parked

            await eventually(parked, "the idle session's lease parked")
    length = len(await load(log, sid))
    lease = await log.leases.current(sid)
    assert lease is not None and lease.parked, lease
    async with a_repairer(url):
        await asyncio.sleep(2.5)  # past the 1 s lease TTL and the repairer's grace, several rounds
    assert len(await load(log, sid)) == length, "the parked turn was closed"
    messages += [first.json()["choices"][0]["message"], {"role": "tool", "tool_call_id": "call_1", "content": "hello"}]
    second = await complete(http, gateway, sid, {**body, "messages": messages})
    assert second.status_code == 200, second.text
    session = await load(log, sid)
    assert types(session) == [
        "turn/start", "step/start", "request/header", "user/message", "assistant/message", "tool/call",
        "tool/result", "step/end", "step/start", "assistant/message", "step/end", "turn/end",
    ]  # fmt: skip
    assert not any(e.is_replace for e in session) and b"interrupted" not in b"".join(e.raw for e in session)


async def test_a_tool_loop_whose_gateway_is_killed_goes_on_with_the_real_result_as_an_edit(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider_server: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    url: str,
) -> None:
    """A gateway killed while the client runs a tool parks nothing: its lease expires, the repairer closes the
    turn (`TOOL_OUTCOME_UNKNOWN`), and the client's real result is logged as an edit that keeps the synthetic one
    in the transcript."""
    sid = new_session_id("rec")
    provider.load([{"text": "", "tool_calls": [READ_CALL]}, {"text": "It says hello."}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read my notes"}]
    body = {"model": "scripted-model", "tools": TOOLS}
    async with gateway_process(url, provider_server) as (process, gateway_url):
        async with httpx.AsyncClient(timeout=10, headers={"authorization": f"Bearer {KEY_A}"}) as client:
            first = await client.post(f"{gateway_url}/record/{sid}/v1/chat/completions",
                                      json={**body, "messages": messages})  # fmt: skip
            assert first.status_code == 200, first.text
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    await repaired_by_a_repairer(url, log, sid, "the repairer closing the tool loop's turn")
    messages += [first.json()["choices"][0]["message"], {"role": "tool", "tool_call_id": "call_1", "content": "hello"}]
    second = await complete(http, gateway, sid, {**body, "messages": messages})
    assert second.status_code == 200, second.text
    session = await load(log, sid)
    synthetic = next(e for e in session if e.type == "tool/result")
    assert msgspec.json.decode(synthetic.raw)["data"]["error"]["code"] == "TOOL_OUTCOME_UNKNOWN"
    replace = next(e for e in session if e.is_replace)
    assert synthetic.seq in replace.source_event_seqs
    assert without_transport(provider.received[-1])["messages"][-1] == {
        "role": "tool", "tool_call_id": "call_1", "content": "hello"
    }  # fmt: skip
    assert synthetic.seq in [e.seq for e in session.transcript()]  # what happened stays in the transcript
    assert session.open_turn is None and session.generation == 1


async def test_a_changed_field_is_a_new_request_header_and_1_for_1_0_is_no_change(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "a"}, {"text": "b"}, {"text": "c"}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "one"}]
    for temperature in (1.0, 1, 0.5):  # a Node client sends 1 where Python sent 1.0: the same value
        body = {"model": "scripted-model", "temperature": temperature, "response_format": {"type": "text"}}
        response = await complete(http, gateway, sid, {**body, "messages": messages})
        assert response.status_code == 200, response.text
        messages += [response.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    session = await load(log, sid)
    headers = [msgspec.json.decode(e.raw)["data"] for e in session if e.type == "request/header"]
    assert [h["reason"] for h in headers] == ["initial", "change"]
    assert [h["header"]["config"]["temperature"] for h in headers] == [1.0, 0.5]
    assert headers[0]["header"]["config"]["responseFormat"] == {"type": "text"}
    sent = [without_transport(b) for b in provider.received]
    assert [r["temperature"] for r in sent] == [1.0, 1.0, 0.5] and sent[1]["response_format"] == {"type": "text"}
    assert type(sent[1]["temperature"]) is float  # the logged value, not the client's `1`


async def test_logging_a_chunk_never_holds_the_next_one_back(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay passes each piece of a streamed answer on as it comes, whatever logging the pieces before it costs:
    the chunks are logged in order, behind the relay, and all of them before the turn ends. (Logged inline, a piece
    waited until the chunks of the piece before it were logged.) Only the last line, `data: [DONE]`, waits until the
    answer is logged: a client never has an answer as complete that the log does not hold."""
    sid = new_session_id("rec")
    provider.load([{"text": "one two three four five six seven eight nine ten", "chunk_delay_s": 0.02}])
    started = finished = 0
    relayed_during_a_log = 0
    real_chunk, real_relayed = Exchange._chunk, Exchange.relayed

    async def slow_chunk(self: Exchange, chunk: dict[str, Any]) -> None:
        nonlocal started, finished
        started += 1
        await asyncio.sleep(0.1)  # a slow log, five times the provider's pace
        await real_chunk(self, chunk)
        finished += 1

    async def watched_relayed(self: Exchange, data: bytes) -> None:
        nonlocal relayed_during_a_log
        if started > finished:
            relayed_during_a_log += 1  # the relay went on while a chunk was being logged
        await real_relayed(self, data)

    monkeypatch.setattr(Exchange, "_chunk", slow_chunk)
    monkeypatch.setattr(Exchange, "relayed", watched_relayed)
    body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "Count"}]}
    reply = {"role": "assistant", "content": "one two three four five six seven eight nine ten"}
    follow = {**body, "stream": False, "messages": [*body["messages"], reply, {"role": "user", "content": "More"}]}
    lines: list[str] = []
    logged_at_done = -1
    next_request: asyncio.Task[httpx.Response] | None = None
    async with http.stream("POST", base(gateway, sid) + "/chat/completions", content=msgspec.json.encode(body)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if line == "data: [DONE]":
                logged_at_done = finished
                provider.load([{"text": "eleven"}])
                # As an SDK does: the answer is complete at [DONE], and the next request goes out at once, while
                # the gateway still logs this answer's chunks. It waits for them; it is not refused as busy.
                next_request = asyncio.create_task(complete(http, gateway, sid, follow))
    assert lines[-1] == "data: [DONE]" and len(lines) >= 5
    assert relayed_during_a_log > 0, "every piece of the answer waited for the logging of the one before"
    assert logged_at_done == started, "the last line reached the client before every chunk was logged"
    assert next_request is not None
    response = await next_request
    assert response.status_code == 200, response.text

    async def ended() -> bool:
        session = await load(log, sid)
        return bool(session) and session[len(session) - 1].type == "turn/end"

    await eventually(ended, "the turn logged to its end")
    session = await load(log, sid)
    first_turn = [e for e in session if e.type == "assistant/chunk" and msgspec.json.decode(e.raw)["data"]["turn"] == 1]
    chunks = [msgspec.json.decode(e.raw)["data"]["chunk"] for e in first_turn]
    assert finished == len(chunks)  # every chunk logged before the end
    text = "".join(c["text"] for c in chunks if c["type"] == "text-delta")
    assert text == "one two three four five six seven eight nine ten"  # and in order
    assert [e.type for e in session].count("turn/end") == 2


async def test_relayed_bytes_are_read_and_logged_only_once_the_event_loop_could_sleep() -> None:
    """The relay writes a piece of the answer to the client and goes back to waiting for the next one: reading and
    logging the piece there and then made each line reach the client a few µs later than through the gateway
    without logging (the client, woken on the gateway's CPU, waited for it). The piece is kept and read on a timer."""
    sink = DryRun(1 << 20)
    await sink.emit("turn/start", {"turn": 1})
    await sink.emit("step/start", {"turn": 1, "step": 1})
    finished: list[bool] = []
    exchange = Exchange("s", sink, "scripted", lambda: finished.append(True), lambda broken: None, {}, b"", 1, 1)  # type: ignore[arg-type]
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}  # fmt: skip
    await exchange.relayed(b"data: " + msgspec.json.encode(chunk) + b"\n\ndata: [DONE]\n\n")
    assert finished == [] and len(sink.session) == 2, "the relayed bytes were read before the loop could sleep"
    await asyncio.sleep(record_events.READ_AFTER_S * 20)
    assert finished == [True]
    chunks = [msgspec.json.decode(e.raw)["data"]["chunk"] for e in list(sink.session)[2:]]
    assert chunks == [{"type": "block-start", "index": 0, "blockType": "text"},
                      {"type": "text-delta", "index": 0, "text": "hi"}]  # fmt: skip


async def test_an_answer_end_whose_logging_is_cancelled_counts_as_not_logged() -> None:
    """A shutdown that cancels the logging of an answer's end: the end is not taken for durable and the session's
    writer is let go as broken (found reviewing, 2026-12-05: it counted as logged, the session freed as whole)."""

    class SlowSink(DryRun):
        async def flush(self) -> None:
            await asyncio.sleep(30)

    sink = SlowSink(1 << 20)
    await sink.emit("turn/start", {"turn": 1})
    await sink.emit("step/start", {"turn": 1, "step": 1})
    await sink.emit("request/header", {"header": {"config": {"provider": "p", "model": "m"}}, "reason": "initial"})
    freed: list[bool] = []
    exchange = Exchange("s", sink, "scripted", lambda: None, freed.append, {}, b"", 1, 1)  # type: ignore[arg-type]
    body = msgspec.json.encode({"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]})
    ending = asyncio.ensure_future(exchange.ended("forwarded", 200, body=body))
    await asyncio.sleep(0.05)  # waiting for the flush
    ending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await ending
    assert exchange.logged is False and freed == [True]


async def test_a_request_sent_at_the_last_line_waits_for_the_answer_not_yet_read(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SDK sends its next request as soon as it reads `data: [DONE]`, which the gateway relays before it reads it:
    the session is known to be finishing by then (the request reads what was relayed), and the request waits for
    the answer's logging instead of being refused as busy. The reading is put off long here to show it."""
    monkeypatch.setattr(record_events, "READ_AFTER_S", 30.0)
    sid = new_session_id("rec")
    provider.load([{"text": "first answer", "end_delay_s": 0.5}, {"text": "second"}])
    body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "one"}]}
    reply = {"role": "assistant", "content": "first answer"}
    follow = {"model": "scripted-model", "messages": [*body["messages"], reply, {"role": "user", "content": "two"}]}
    next_request: asyncio.Task[httpx.Response] | None = None
    async with http.stream("POST", base(gateway, sid) + "/chat/completions", content=msgspec.json.encode(body)) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                next_request = asyncio.create_task(complete(http, gateway, sid, follow))  # the stream still open
    assert next_request is not None
    response = await next_request
    assert response.status_code == 200, response.text
    session = await load(log, sid)
    assert [e.type for e in session].count("turn/end") == 2
    answers = [msgspec.json.decode(e.raw)["data"]["message"]["content"]
               for e in session if e.type == "assistant/message"]  # fmt: skip
    assert answers == [[{"type": "text", "text": "first answer"}], [{"type": "text", "text": "second"}]]


async def test_a_client_that_hangs_up_right_after_the_last_line_gets_a_completed_turn(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "short answer"}])
    body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.stream("POST", base(gateway, sid) + "/chat/completions", json=body) as response:
        seen = b""
        async for data in response.aiter_bytes():
            seen += data
            if b"[DONE]" in seen:
                break  # as SDKs may: stop at [DONE] and close

    async def ended() -> bool:
        return any(e.type == "turn/end" for e in await load(log, sid))

    await eventually(ended, "the turn ended")
    session = await load(log, sid)
    end = [e for e in session if e.type == "turn/end"][-1]
    assert msgspec.json.decode(end.raw)["data"]["reason"] == {"kind": "completed"}
    assert [e.type for e in session][-3:] == ["assistant/message", "step/end", "turn/end"]


@pytest.mark.parametrize(
    ("message", "status", "code"),
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}, 422,
         "UNSUPPORTED_CONTENT"),
        ({"role": "tool", "tool_call_id": "call_nobody_made", "content": "x"}, 409, "DERIVATION_DIVERGES"),
        ({"role": "developer", "content": "be terse"}, 422, "UNSUPPORTED_CONTENT"),
        ({"content": "no role"}, 422, "UNSUPPORTED_CONTENT"),
    ],
    ids=["image-part", "tool-result-without-call", "developer-message-after-the-first", "no-role"],
)  # fmt: skip
async def test_what_cannot_be_logged_is_refused_and_leaves_the_log_and_the_provider_untouched(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    message: dict[str, Any],
    status: int,
    code: str,
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "first"}, {"text": "never"}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert first.status_code == 200
    before = [e.raw for e in await load(log, sid)]
    messages += [first.json()["choices"][0]["message"], message]
    refused = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert refused.status_code == status and refused.json()["error"]["code"] == code, refused.text
    assert refused.headers["x-should-retry"] == "false"
    assert [e.raw for e in await load(log, sid)] == before and len(provider.received) == 1
    messages[-1] = {"role": "user", "content": "fine"}  # the session goes on
    assert (await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})).status_code == 200


@pytest.mark.parametrize(
    ("first", "second", "where"),
    [
        ([SYSTEM, {"role": "system", "content": "Summary: earlier work"}, {"role": "user", "content": "hi"}], None,
         "$.messages[1]"),
        ([SYSTEM, {"role": "user", "content": "hi", "name": "bob"}], None, "$.messages[1]"),
        ([SYSTEM, {"role": "user", "content": "hi"}], [{"role": "system", "content": "Summary: so far"}],
         "$.messages[3]"),
    ],
    ids=["second-system-message", "unloggable-field-after-system", "system-message-appended-later"],
)  # fmt: skip
async def test_a_refused_message_after_the_system_message_is_named_by_its_own_index(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    first: list[dict[str, Any]],
    second: list[dict[str, Any]] | None,
    where: str,
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "first"}])
    messages = first
    if second is not None:
        reply = await complete(http, gateway, sid, {"model": "scripted-model", "messages": first})
        assert reply.status_code == 200, reply.text
        messages = [*first, reply.json()["choices"][0]["message"], *second]
    before = await log.reader.events(sid)
    received = len(provider.received)
    refused = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "UNSUPPORTED_CONTENT"
    assert error["message"].startswith(f"UNSUPPORTED_CONTENT: {where}:"), error["message"]
    assert error["param"] == where
    assert len(provider.received) == received
    assert await log.reader.events(sid) == before


DEEP = b"[" * 20_000 + b"]" * 20_000


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"scripted-model","messages":' + DEEP + b"}",
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi","x":' + DEEP + b"}]}",
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"}],"tools":' + DEEP + b"}",
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"}],"temperature":' + DEEP + b"}",
        b'{"model":"scripted-model","messages":[{"role":"user","content":"\\x"}]}',
        b'{"model":"scripted-model","messages":[{"role":"user","content":"\xff"}]}',
        b'{"model":"scripted-model\xff","messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"}]',
        b"[1,2]",
        b'{"model":"scripted-model","messages":{"role":"user"}}',
        b'{"model":["m"],"messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"scripted-model","messages":[{"role":7,"content":"hi"}]}',
        b'{"model":"scripted-model","messages":[{"role":"assistant","tool_calls":[{"id":1,"function":"f"}]}]}',
        b"",
        b'{"model":"scripted-model","stream":"yes","messages":[{"role":"user","content":"hi"},'
        b'{"role":"assistant","content":"first"},{"role":"user","content":"more"}]}',
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"},'
        b'{"role":"assistant","content":"first","reasoning_content":7},{"role":"user","content":"more"}]}',
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"}],"functions":[{"name":"f"}]}',
    ],
    ids=["deep-messages", "deep-in-a-message", "deep-tools", "deep-field", "bad-escape", "bad-utf8",
         "bad-utf8-in-model", "not-json", "not-an-object", "messages-an-object", "model-a-list", "role-a-number",
         "bad-tool-call", "empty", "stream-a-string", "reasoning-a-number", "legacy-functions"],
)  # fmt: skip
async def test_a_bad_body_to_the_record_route_is_a_typed_4xx_and_changes_nothing(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, body: bytes
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "first"}])
    good = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    assert (await complete(http, gateway, sid, good)).status_code == 200
    before = [e.raw for e in await load(log, sid)]
    reply = await http.post(base(gateway, sid) + "/chat/completions", content=body)
    assert 400 <= reply.status_code < 500, f"{reply.status_code} {reply.text[:300]}"
    assert reply.json()["error"]["code"] in ("INVALID_REQUEST", "UNSUPPORTED_CONTENT"), reply.text[:300]
    assert reply.headers["x-should-retry"] == "false"
    assert len(provider.received) == 1
    assert [e.raw for e in await load(log, sid)] == before


async def test_an_idle_session_is_let_go_and_its_lease_released(
    http: httpx.AsyncClient, provisioned: Settings, provider_server: ServerThread, provider: ScriptedProvider,
    log: SessionLog,
) -> None:  # fmt: skip
    sid = new_session_id("rec")
    settings = record_settings(provisioned, gateway_record_idle_s=1.0)
    with ServerThread(build_app(settings, record_config(settings, provider_server.url))) as short_lived:
        provider.load([{"text": "hi"}])
        body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
        assert (await complete(http, short_lived, sid, body)).status_code == 200
        assert await log.leases.current(sid) is not None  # held between requests

        async def released() -> bool:
            return await log.leases.current(sid) is None

        await eventually(released, "the idle session's lease released")
        provider.load([{"text": "again"}])
        follow = [*body["messages"], {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
        again = await complete(http, short_lived, sid, {"model": "scripted-model", "messages": follow})
        assert again.status_code == 200, again.text  # taken up again from the log
        assert not any(e.is_replace for e in await load(log, sid))


@pytest.mark.parametrize(
    "body",
    [
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"}]',
        b'{"model":"scripted-model","messages":[{"role":"user","content":[{"type":"image_url","image_url":"x"}]}]}',
        b'{"model":"scripted-model","messages":[{"role":"tool","tool_call_id":"call_nobody_made","content":"x"}]}',
        b'{"model":"scripted-model","messages":[{"role":"system","content":"only a system message"}]}',
        b'{"model":["m"],"messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"scripted-model","messages":[{"role":"user","content":"' + b"x" * 700_000 + b'"}]}',
        b'{"model":"scripted-model","top_1_only":1,"messages":[{"role":"user","content":"hi"}]}',
        b'{"model":"scripted-model","messages":[{"role":"system","content":"s","name":"boss"},'
        b'{"role":"user","content":"hi"}]}',
        # refused only as its events are written (found probing record mode, 2026-12-05: each left an empty session)
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function",'
        b'"function":{"name":"f","parameters":' + b'{"type":"object","properties":{"x":' * 40 + b"{}" + b"}}" * 40
        + b"}}]}",
        b'{"model":"scripted-model","messages":[{"role":"system","content":"' + b"x" * 600_000 + b'"},'
        b'{"role":"user","content":"hi"}]}',
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,'
        b'"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}},{"id":"c1",'
        b'"type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1",'
        b'"content":"x"},{"role":"user","content":"and?"}]}',
        b'{"model":"scripted-model","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,'
        b'"tool_calls":[{"id":"c1","type":"function","function":{"name":null,"arguments":"{}"}}]},'
        b'{"role":"tool","tool_call_id":"c1","content":"x"},{"role":"user","content":"and?"}]}',
    ],
    ids=["not-json", "unloggable-message", "tool-result-without-call", "no-conversation", "model-a-list",
         "message-too-large-for-an-event", "field-whose-name-would-not-come-back", "name-on-the-system-message",
         "tool-schema-too-deep-for-an-event", "system-prompt-too-large-for-an-event", "duplicate-tool-call-ids",
         "tool-call-without-a-name"],
)  # fmt: skip
async def test_a_refused_first_request_creates_no_session(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, body: bytes
) -> None:
    sid = new_session_id("rec")
    reply = await http.post(base(gateway, sid) + "/chat/completions", content=body)
    assert 400 <= reply.status_code < 500, f"{reply.status_code} {reply.text[:300]}"
    assert reply.headers["x-should-retry"] == "false"
    assert await log.header(sid) is None  # nothing visible: no header, no events
    assert await log.reader.events(sid) == []
    assert len(provider.received) == 0
    provider.load([{"text": "first"}])  # and the session can still be created by a good first request
    good = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    assert (await complete(http, gateway, sid, good)).status_code == 200


async def test_a_streamed_answers_chunks_are_logged_in_records_of_the_record_window(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """A streamed answer's chunks are batched over `SESSIONLOG_GATEWAY_RECORD_WINDOW_MS` (20 ms) rather than the
    writers' 2 ms: one record per piece of the answer cost the machine a NATS message, a store and an ack each, and
    made the pieces reach the client later than through the gateway without logging. The end is flushed at once."""
    sid = new_session_id("rec")
    words = " ".join(f"w{i}" for i in range(40))
    provider.load([{"text": words, "chunk_delay_s": 0.004}])
    body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "Count"}]}
    started = time.monotonic()
    async with http.stream("POST", base(gateway, sid) + "/chat/completions", content=msgspec.json.encode(body)) as r:
        assert r.status_code == 200
        first = last = 0.0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                last = time.monotonic()
                first = first or last
    assert last - first > 0.1, "the answer streamed over its pieces' delays"
    records = await log.reader.records(sid)
    with_chunks = [r for r in records if any(b'"assistant/chunk"' in raw for raw in r.events)]
    chunks = sum(raw.count(b'"assistant/chunk"') for r in records for raw in r.events)
    assert chunks >= 40
    # One record per piece before (41 for these 40); batched, several pieces share a record. A busy machine can
    # publish more often than the window (a batch is sent as soon as the one before it is acknowledged), so the
    # bound is loose: at most half as many records as pieces.
    assert len(with_chunks) <= chunks // 2, f"{len(with_chunks)} records for {chunks} chunks over {last - started:.3f}s"
    session = await load(log, sid)
    assert types(session)[-2:] == ["step/end", "turn/end"]


async def test_fields_given_as_null_and_an_empty_tools_array_are_fields_not_given(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """The OpenAI Python SDK sends `"temperature": null` for `temperature=None`, and frameworks send `tools: []`
    when an agent has no tools: the same request as without them, logged and forwarded without them."""
    sid = new_session_id("rec")
    provider.load([{"text": "one"}, {"text": "two"}])
    nulls = {"temperature": None, "stop": None, "max_tokens": None, "seed": None, "audio": None, "tools": []}
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "hi"}]
    for stream in (False, True):
        body = {"model": "scripted-model", "messages": messages, "stream": stream, **nulls}
        reply = await complete(http, gateway, sid, body)
        assert reply.status_code == 200, reply.text
        text = parse_raw_response(reply.content).text if stream else reply.json()["choices"][0]["message"]["content"]
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    session = await load(log, sid)
    headers = [e for e in session if e.type == "request/header"]
    assert len(headers) == 1  # the second request changed nothing
    config = msgspec.json.decode(headers[0].raw)["data"]["header"]["config"]
    assert set(config) == {"provider", "model"} and "tools" not in msgspec.json.decode(headers[0].raw)["data"]["header"]
    for received in provider.received:
        assert not set(nulls) & set(msgspec.json.decode(received))
    assert session.open_turn is None


async def one_answered_request(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, sid: str
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """A session with one answered request (the provider scripted for one more): the client's messages with the
    answer appended, and the log's events as raw bytes."""
    provider.load([{"text": "first"}, {"text": "second"}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert first.status_code == 200, first.text
    return [*messages, first.json()["choices"][0]["message"]], [e.raw for e in await load(log, sid)]


async def test_a_message_too_large_for_an_event_is_refused_and_the_session_is_free_at_once(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """The refusal comes from the writer once the request's first events are queued: they are dropped, and the
    session's lease is let go with them, so the client's next request is answered, not told SESSION_BUSY until the
    lease expired."""
    sid = new_session_id("rec")
    messages, before = await one_answered_request(http, gateway, provider, log, sid)
    huge = [*messages, {"role": "user", "content": "x" * 700_000}]
    refused = await complete(http, gateway, sid, {"model": "scripted-model", "messages": huge})
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "EVENT_TOO_LARGE", refused.text
    assert [e.raw for e in await load(log, sid)] == before and len(provider.received) == 1
    small = [*messages, {"role": "user", "content": "a smaller question"}]
    again = await complete(http, gateway, sid, {"model": "scripted-model", "messages": small})
    assert again.status_code == 200, again.text


def _disagreeing(*_: Any, **__: Any) -> Divergence:
    """A check that disagrees with the plan, injected in place of `compare_request`."""
    return Divergence(HeaderDiverges.code, "$.temperature", "a disagreement injected by the test")


async def test_a_check_that_fails_after_the_plan_passed_leaves_the_log_unchanged(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan and the check agree on every request a client can send (a disagreement is a gateway bug, as
    `null` fields were); if they ever disagree, the request is refused before anything of it is published."""
    sid = new_session_id("rec")
    messages, before = await one_answered_request(http, gateway, provider, log, sid)
    messages.append({"role": "user", "content": "more"})

    with monkeypatch.context() as patched:
        patched.setattr(record_module, "compare_request", _disagreeing)
        refused = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == HeaderDiverges.code, refused.text
    assert [e.raw for e in await load(log, sid)] == before and len(provider.received) == 1
    again = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert again.status_code == 200, again.text


async def test_a_request_refused_while_the_client_runs_a_tool_parks_the_session_and_its_turn_stays_open(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request refused once its events were queued lets the writer go; if the log's turn was open (the client
    runs a tool), its lease is parked, so a repairer does not close that turn before the client's corrected
    request comes."""
    sid = new_session_id("rec")
    provider.load([{"text": "", "tool_calls": [READ_CALL]}, {"text": "It says hello."}])
    body = {"model": "scripted-model", "tools": TOOLS}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Read my notes"}]
    first = await complete(http, gateway, sid, {**body, "messages": messages})
    assert first.status_code == 200, first.text
    before = [e.raw for e in await load(log, sid)]
    messages += [first.json()["choices"][0]["message"], {"role": "tool", "tool_call_id": "call_1", "content": "hello"}]

    with monkeypatch.context() as patched:
        patched.setattr(record_module, "compare_request", _disagreeing)
        refused = await complete(http, gateway, sid, {**body, "messages": messages})
    assert refused.status_code == 409, refused.text

    async def parked() -> bool:
        lease = await log.leases.current(sid)
        return lease is not None and lease.parked

    await eventually(parked, "the refused session's lease parked")
    async with a_repairer(url):
        await asyncio.sleep(2.0)  # past the 1 s lease TTL and the repairer's grace
    assert [e.raw for e in await load(log, sid)] == before, "the open turn was closed"
    again = await complete(http, gateway, sid, {**body, "messages": messages})
    assert again.status_code == 200, again.text
    assert not any(e.is_replace for e in await load(log, sid))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_refusal_is_logged_as_what_the_model_said_and_the_sdks_echo_of_it_extends_the_log(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    provisioned: Settings,
    stream: bool,
) -> None:
    """OpenAI answers a refusal as `content: null` and `refusal`; the SDK's message, appended as it is, carries
    both. The refusal is the text the model said: logged as the answer's text, and the echo is that message."""
    sid = new_session_id("rec")
    provider.load([{"refusal": "I can't help with that."}, {"text": "Sure."}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Do something you won't."}]
    reply = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages, "stream": stream})
    assert reply.status_code == 200, reply.text
    if stream:
        lines = [msgspec.json.decode(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
        refusal = "".join(c["choices"][0]["delta"].get("refusal") or "" for c in lines if c["choices"])
        echoed = {"role": "assistant", "content": None, "refusal": refusal}
    else:
        echoed = reply.json()["choices"][0]["message"]
    assert echoed["refusal"] == "I can't help with that." and echoed["content"] is None
    messages += [echoed, {"role": "user", "content": "Then something else."}]
    follow = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert follow.status_code == 200, follow.text
    session = await load(log, sid)
    answer = next(e for e in session if e.type == "assistant/message")
    assert msgspec.json.decode(answer.raw)["data"]["message"]["content"] == [
        {"type": "text", "text": "I can't help with that."}
    ]
    assert not any(e.is_replace for e in session)  # the echo extended the log
    assert msgspec.json.decode(provider.received[1])["messages"][1] == {
        "role": "assistant",
        "content": "I can't help with that.",
    }
    report = audit_session(session, await raw_exchanges(log, provisioned, sid, 2), session_id=sid).report()
    assert report.findings == [] and report.raw_matched == 2  # the raw answer's refusal is the logged text


async def test_more_than_one_choice_is_refused_before_anything_is_logged(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """A step logs one answer: `n: 2` would have the provider answer twice and the log keep the first choice only,
    so it is refused (422, nothing logged, nothing sent); `n: 1` is the default spelled out."""
    sid = new_session_id("rec")
    provider.load([{"text": "one"}])
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    refused = await complete(http, gateway, sid, body)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "UNSUPPORTED_CONTENT", refused.text
    assert "$.n" in refused.json()["error"]["message"]
    assert await log.header(sid) is None and len(provider.received) == 0
    assert (await complete(http, gateway, sid, {**body, "n": 1})).status_code == 200


async def test_an_empty_system_message_is_no_system_message_and_logs_one_header(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    sid = new_session_id("rec")
    provider.load([{"text": "one"}, {"text": "two"}, {"text": "three"}])
    messages: list[dict[str, Any]] = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]
    for n in range(3):
        reply = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
        assert reply.status_code == 200, reply.text
        messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"more {n}"}]
    headers = [e for e in await load(log, sid) if e.type == "request/header"]
    assert len(headers) == 1, [msgspec.json.decode(h.raw)["data"] for h in headers]


@pytest.mark.parametrize(
    ("call_id", "finish", "stream"),
    [("", None, False), ("call_s", "stop", True), ("call_s", "stop", False)],
    ids=["empty-call-id", "streamed-calls-finished-as-stop", "whole-calls-finished-as-stop"],
)  # fmt: skip
async def test_a_tool_call_with_an_empty_id_or_a_stop_finish_goes_on_and_audits_clean(
    http: httpx.AsyncClient,
    gateway: ServerThread,
    provider: ScriptedProvider,
    log: SessionLog,
    provisioned: Settings,
    call_id: str,
    finish: str | None,
    stream: bool,
) -> None:
    """Found by probing with the SDKs (2026-12-05): a provider's call with `id: ""` was logged, then its echo was
    refused (the turn could never go on); a streamed call finished `stop` (some servers do) was audited as
    `RAW_STREAM_DIFFERS`. Both now go on, and the audit finds nothing."""
    sid = new_session_id("rec")
    call = {"id": call_id, "name": "read_file", "arguments": '{"path": "notes.txt"}'}
    first_reply: dict[str, Any] = {"tool_calls": [call]}
    if finish is not None:
        first_reply["finish_reason"] = finish
    provider.load([first_reply, {"text": "done"}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "read it"}]
    body = {"model": "scripted-model", "tools": TOOLS, "stream": stream}
    first = await complete(http, gateway, sid, {**body, "messages": messages})
    assert first.status_code == 200, first.text
    reply = sse_message(first.content) if stream else first.json()["choices"][0]["message"]
    messages += [reply, {"role": "tool", "tool_call_id": call_id, "content": "hello"}]
    second = await complete(http, gateway, sid, {**body, "messages": messages})
    assert second.status_code == 200, second.text
    session = await load(log, sid)
    assert session.open_turn is None and types(session)[-1] == "turn/end"
    report = audit_session(session, await raw_exchanges(log, provisioned, sid, 2), session_id=sid).report()
    assert report.findings == [] and report.raw_matched == 2


async def test_the_sdks_parse_echo_and_a_system_messages_name_are_an_echo_and_a_refusal(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """The SDKs' `parse()` message carries `parsed` (its content as JSON): appended as it is, it extends the log
    (it was refused with 422). A `name` on the system message has no place in the header: refused with 422, where
    it used to reach the provider dropped."""
    sid = new_session_id("rec")
    content = '{"city": "Paris"}'
    provider.load([{"text": content}, {"text": "ok"}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "where?"}]
    first = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert first.status_code == 200, first.text
    echo = {**first.json()["choices"][0]["message"], "parsed": {"city": "Paris"}}
    messages += [echo, {"role": "user", "content": "and?"}]
    second = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert second.status_code == 200, second.text
    assert not [e for e in await load(log, sid) if e.is_replace]  # no history edit
    before = [e.raw for e in await load(log, sid)]
    named = [{"role": "system", "content": "s", "name": "boss"}, *messages]
    refused = await complete(http, gateway, sid, {"model": "scripted-model", "messages": named})
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "UNSUPPORTED_CONTENT", refused.text
    assert refused.json()["error"]["param"] == "$.messages[0]"
    assert [e.raw for e in await load(log, sid)] == before and len(provider.received) == 2


async def test_half_a_surrogate_pair_is_a_400_that_names_it_on_a_first_and_a_later_request(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """A Node client's string cut inside an emoji arrives as a lone `\\ud83d` escape: 400 `INVALID_REQUEST` that
    says so (it said "Input data was truncated"), on a session's first request and on a later one, whose new
    messages the gateway decodes alone; nothing is logged."""
    sid = new_session_id("rec")
    provider.load([{"text": "one"}, {"text": "never"}])
    cut = b'{"model":"scripted-model","messages":[{"role":"user","content":"cut \\ud83d"}]}'
    first = await http.post(base(gateway, sid) + "/chat/completions", content=cut)
    assert first.status_code == 400 and "surrogate" in first.json()["error"]["message"], first.text
    assert await log.header(sid) is None
    ok = await complete(
        http, gateway, sid, {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert ok.status_code == 200, ok.text
    before = [e.raw for e in await load(log, sid)]
    history = [{"role": "user", "content": "hi"}, ok.json()["choices"][0]["message"]]
    later = msgspec.json.encode({"model": "scripted-model", "messages": history})[:-2]
    later += b',{"role":"user","content":"cut \\ud83d"}]}'
    refused = await http.post(base(gateway, sid) + "/chat/completions", content=later)
    assert refused.status_code == 400 and "surrogate" in refused.json()["error"]["message"], refused.text
    assert [e.raw for e in await load(log, sid)] == before and len(provider.received) == 1


async def test_a_first_developer_message_is_the_system_prompt_sent_as_developer(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """OpenAI's reasoning models take the system prompt as a `developer` message, and SDKs and frameworks send it
    so: logged as the header's `system` with `config.systemRole` "developer", forwarded as the client wrote it; the
    client's echo extends the log (one header), a switch to `system` is a header change, and every request is the
    derivation of its prefix (the theorem)."""
    sid = new_session_id("rec")
    provider.load([{"text": "one"}, {"text": "two"}, {"text": "three"}])
    developer = {"role": "developer", "content": "Answer in one word."}
    messages: list[dict[str, Any]] = [developer, {"role": "user", "content": "hi"}]
    for n in range(2):
        reply = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
        assert reply.status_code == 200, reply.text
        messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"more {n}"}]
    session = await load(log, sid)
    headers = [msgspec.json.decode(e.raw)["data"]["header"] for e in session if e.type == "request/header"]
    assert len(headers) == 1 and not [e for e in session if e.type == "user/message" and e.surface_op != "append"]
    assert headers[0]["system"] == "Answer in one word." and headers[0]["config"]["systemRole"] == "developer"
    assert [without_transport(b)["messages"][0] for b in provider.received] == [developer, developer]
    assert "system_role" not in without_transport(provider.received[0])
    messages[0] = {"role": "system", "content": "Answer in one word."}
    reply = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert reply.status_code == 200, reply.text
    session = await load(log, sid)
    headers = [msgspec.json.decode(e.raw)["data"] for e in session if e.type == "request/header"]
    assert [h["reason"] for h in headers] == ["initial", "change"]
    assert "systemRole" not in headers[1]["header"]["config"]
    assert without_transport(provider.received[-1])["messages"][0] == messages[0]
    received = [canonical(without_transport(b)) for b in provider.received]
    assert [canonical(r) for r in theorem_requests(session)] == received


async def test_a_request_field_named_like_the_system_roles_key_is_refused(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """`system_role` would be logged as `config.systemRole`, which says how the system prompt is sent: refused
    before anything is logged, not taken for a role."""
    sid = new_session_id("rec")
    provider.load([{"text": "never"}])
    body = {"model": "scripted-model", "system_role": "developer",
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]}  # fmt: skip
    refused = await complete(http, gateway, sid, body)
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "UNSUPPORTED_CONTENT", refused.text
    assert "$.system_role" in refused.json()["error"]["message"]
    assert await log.header(sid) is None and await log.reader.events(sid) == [] and provider.received == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_answer_too_large_for_an_event_ends_its_turn_as_an_error_and_the_session_goes_on(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog, stream: bool
) -> None:
    """The client has the whole answer; the log keeps what fits (its chunks, when streamed) and ends the turn with
    an `EVENT_TOO_LARGE` error instead of leaving it open for the repairer, and the session takes the next request
    at once."""
    sid = new_session_id("rec")
    big = "word " * 140_000  # 700 KB: more than one record carries
    provider.load([{"text": big}, {"text": "short"}])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Write a lot."}]
    reply = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages, "stream": stream})
    assert reply.status_code == 200
    received = parse_raw_response(reply.content).text if stream else reply.json()["choices"][0]["message"]["content"]
    assert received == big  # the client lost nothing
    session = await load(log, sid)
    assert session.open_turn is None
    end = next(e for e in reversed(list(session)) if e.type == "turn/end")
    reason = msgspec.json.decode(end.raw)["data"]["reason"]
    assert reason["kind"] == "error" and reason["error"]["code"] == "EVENT_TOO_LARGE", reason
    assert not any(e.type == "assistant/message" for e in session)
    if stream:
        logged = "".join(msgspec.json.decode(e.raw)["data"]["chunk"].get("text", "")
                         for e in session if e.type == "assistant/chunk")  # fmt: skip
        assert logged.startswith(big[:1000])
    messages.append({"role": "user", "content": "Shorter, please."})  # a client that cannot log the answer drops it
    again = await complete(http, gateway, sid, {"model": "scripted-model", "messages": messages})
    assert again.status_code == 200, again.text


async def test_a_provider_that_drops_mid_stream_ends_the_turn_with_the_failures_own_code_and_no_http_status(
    http: httpx.AsyncClient, gateway: ServerThread, provider: ScriptedProvider, log: SessionLog
) -> None:
    """The provider had answered 200 and then broke the connection: the turn's error is what the gateway found
    (`UPSTREAM_UNREACHABLE`, as its message says), not a provider error with an HTTP status of 200."""
    sid = new_session_id("rec")
    provider.load([{"text": "one two three four five six", "disconnect_after": 3}])
    body = {"model": "scripted-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    reply = await complete(http, gateway, sid, body)
    assert reply.status_code == 200
    session = await load(log, sid)
    end = [e for e in session if e.type == "turn/end"][-1]
    error = msgspec.json.decode(end.raw)["data"]["reason"]["error"]
    assert error["code"] in ("UPSTREAM_UNREACHABLE", "UPSTREAM_TIMEOUT") and error["code"] in error["message"], error
    assert "status" not in error


STREAM_END = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: {"choices":[]}\r\n\r\ndata: [DONE]\n\n'


@pytest.mark.parametrize("cuts", [(i,) for i in range(1, len(STREAM_END))] + [(60, 70), (72, 75, 80)])
async def test_the_last_line_is_held_back_however_the_providers_bytes_are_cut(cuts: tuple[int, ...]) -> None:
    """Found reviewing the relay, 2026-12-05: a `data: [DONE]` split over two pieces was relayed at once, so a client
    could have an answer as complete before the log had it."""
    from services.gateway.forward import DoneGate

    bounds = [0, *cuts, len(STREAM_END)]
    gate, relayed = DoneGate(), b""
    for a, b in itertools.pairwise(bounds):
        relayed += gate.feed(STREAM_END[a:b])
        if gate.last is not None:
            break
    assert b"[DONE]" not in relayed
    assert gate.last == b"data: [DONE]\n\n" and relayed + gate.last == STREAM_END


@pytest.mark.parametrize(
    ("pieces", "now", "last"),
    [
        ([b"data: [DONE]"], b"", b"data: [DONE]\n\n"),  # the blank line never came: the client still gets one
        ([b'data: {"t":"[DONE]"}\n\n'], b'data: {"t":"[DONE]"}\n\n', None),  # the words inside a chunk
        ([b"data: {}\n\nda"], b"data: {}\n\n", None),  # held: it may be the last line's start
        ([b"data: {}\n\nda", b"ta: {}\n\n"], b"data: {}\n\ndata: {}\n\n", None),  # it was not
        ([b"data:[DO", b"NE]\r\n\r\n"], b"", b"data:[DONE]\r\n\r\n"),
    ],
)
async def test_the_done_gate_relays_everything_but_the_last_line(
    pieces: list[bytes], now: bytes, last: bytes | None
) -> None:
    from services.gateway.forward import DoneGate

    gate = DoneGate()
    assert b"".join(gate.feed(p) for p in pieces) == now
    assert gate.last == last
