"""Record mode end to end: a real nats-server, the gateway and the scripted provider over HTTP, and a client that
knows nothing of sessionlog (plain OpenAI-shaped requests made with httpx) under `/record/{session}/v1`."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
from natsfixtures import new_session_id
from scaffold import eventually

from services.gateway import GatewayConfig, ScriptedProvider, ServerThread, UpstreamConfig, build_app
from services.repairer.service import RepairerService
from sessionlog.audit import RawAssembler, audit_session
from sessionlog.log import SessionLog
from sessionlog.session import Session
from sessionlog.settings import Settings
from sessionlog.wire import canonical, to_wire

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
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for line in data.split(b"\n"):
        if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
            continue
        for choice in msgspec.json.decode(line[6:]).get("choices") or ():
            delta = choice["delta"]
            text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                slot = calls.setdefault(call["index"], {"id": "", "type": "function",
                                                        "function": {"name": "", "arguments": ""}})  # fmt: skip
                slot["id"] = call.get("id") or slot["id"]
                slot["function"]["name"] = call.get("function", {}).get("name") or slot["function"]["name"]
                slot["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


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
                done = assembler.add(dict(msg.headers or {}), msg.data)
                if done is not None:
                    out.append(done)
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
            event.type == "assistant/message" and event.surface_op == "append" and event.data.message.source.kind == "model"
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
