"""The ui-replayer against a real nats-server: every dsh fixture's transcript renders (page and JSON), the session
list searches and flags open turns, content is escaped, and the live tail (SSE) streams new events as they are
flushed, resumes after a reconnect and works on a replica that does not own the session."""

from __future__ import annotations

import asyncio
import html
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import nats.errors
import pytest
import pytest_asyncio
from natsfixtures import log_settings, new_session_id
from scaffold import WAIT_S, serving
from sessiongen import text_block
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from test_fixtures_corpus import FIXTURE_FILES, import_corpus, read_fixture

from services.stack import Stack, factory
from services.ui_replayer.service import UIReplayerService
from sessionlog.embedded import free_port
from sessionlog.errors import CODES, PortInUse, error_from_code
from sessionlog.events import SURFACE_TYPES
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.services import RunOptions
from sessionlog.session import Session
from sessionlog.transcript import build_transcript, transcript_json

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

XSS = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">&amp; "quoted"'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fixtures(log: SessionLog) -> dict[str, str]:
    """Every dsh fixture imported under an id of its own: file name -> session id."""
    return await import_corpus(log, "f")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ui(log: SessionLog, fixtures: dict[str, str]) -> AsyncIterator[UIReplayerService]:
    partitions = list(range(log.settings.partition_count))
    async with serving(UIReplayerService(log, host="127.0.0.1", port=0, partitions=partitions)) as service:
        yield service


@pytest_asyncio.fixture(loop_scope="module")
async def http(ui: UIReplayerService) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=ui.url, timeout=WAIT_S) as client:
        yield client


async def new_session(log: SessionLog, text: str = "Hello.", *, close: bool = True) -> SessionWriter:
    writer = await log.create(new_session_id("ui"))
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit(
        "user/message",
        {"id": "u1", "role": "user", "source": {"kind": "user"}, "content": [text_block(text)]},
        surface_op="append",
    )
    if close:
        await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await writer.flush()
    return writer


class Sse:
    """Reads Server-Sent Events from a streaming httpx response."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def next(self, timeout: float = WAIT_S) -> dict[str, Any]:
        event: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while True:
            line = await asyncio.wait_for(anext(self._lines), max(0.01, deadline - time.monotonic()))
            if not line:
                if "event" in event:
                    return event
                event = {}
                continue
            if line.startswith(":"):
                continue
            field, _, value = line.partition(": ")
            event[field] = msgspec.json.decode(value) if field == "data" else value

    async def until(self, predicate: Any, timeout: float = WAIT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            event = await self.next(max(0.01, deadline - time.monotonic()))
            if predicate(event):
                return event


# ---------------------------------------------------------------------------------------------- pages


async def test_every_fixture_transcript_renders_as_a_page_and_as_json(
    http: httpx.AsyncClient, fixtures: dict[str, str]
) -> None:
    for path in FIXTURE_FILES:
        session_id = fixtures[path.name]
        page = await http.get(f"/sessions/{session_id}")
        assert page.status_code == 200, (path.name, page.text[:300])
        assert page.headers["content-security-policy"].startswith("default-src 'none'")
        log_file = read_fixture(path)
        session = Session(log_file.events)
        for event in session:
            if event.type in SURFACE_TYPES and event.surface_op == "append":
                message = event.data if event.type == "user/message" else event.data.message
                for block in message.content:
                    text = getattr(block, "text", None)
                    if text:
                        assert html.escape(text, quote=True) in page.text, (path.name, event.seq)
        expected = build_transcript(session, log_file.header_raw, session_id=session_id)
        api = await http.get(f"/api/sessions/{session_id}/transcript")
        assert api.status_code == 200
        expected_json = msgspec.json.decode(transcript_json(expected))
        expected_json["session"] = session_id
        got = api.json()
        assert got["entries"] == expected_json["entries"] and got["next_seq"] == len(session)


async def test_the_fork_and_compaction_and_crash_pages_show_their_markers(
    http: httpx.AsyncClient, fixtures: dict[str, str]
) -> None:
    forked = (await http.get(f"/sessions/{fixtures['acp-agent-subagent-mixed-session.2.jsonl']}")).text
    assert 'class="banner fork"' in forked and "inherited history ends here" in forked
    compacted = (await http.get(f"/sessions/{fixtures['acp-agent-agent-instructions-session.jsonl']}")).text
    assert "summarised for the model: events 5-5" in compacted
    crashed_name = "examples__headless-agent__tests__semantic-checkpoint-snapshots__tool-outcome-unknown-session.jsonl"
    crashed = (await http.get(f"/sessions/{fixtures[crashed_name]}")).text
    assert "synthetic result" in crashed and "interrupted by a crash" in crashed


async def test_replay_at_a_seq_shows_the_prefix(http: httpx.AsyncClient, fixtures: dict[str, str]) -> None:
    session_id = fixtures["acp-agent-multi-turn-session.jsonl"]
    full = (await http.get(f"/api/sessions/{session_id}/transcript")).json()
    at = full["entries"][len(full["entries"]) // 2]["seq"]
    prefix = (await http.get(f"/api/sessions/{session_id}/transcript", params={"at": at})).json()
    assert prefix["next_seq"] == at + 1
    assert all(e["seq"] <= at for e in prefix["entries"])
    page = await http.get(f"/sessions/{session_id}", params={"at": at})
    assert page.status_code == 200 and f"replay up to event {at}" in page.text and 'data-live="0"' in page.text
    since = (await http.get(f"/api/sessions/{session_id}/transcript", params={"from_seq": at})).json()
    assert since["entries"] and all(e["last"] >= at for e in since["entries"])
    past_end = await http.get(f"/api/sessions/{session_id}/transcript", params={"at": 10**6})
    assert past_end.status_code == 400 and past_end.json()["error"]["code"] == "INVALID_BOUNDARY"


async def test_unknown_sessions_and_bad_parameters_are_refused_clearly(http: httpx.AsyncClient) -> None:
    missing = await http.get("/sessions/no-such-session")
    assert missing.status_code == 404 and "SESSION_NOT_FOUND" in missing.text
    api = await http.get("/api/sessions/no-such-session/transcript")
    assert api.status_code == 404 and api.json()["error"]["code"] == "SESSION_NOT_FOUND"
    bad = await http.get("/sessions/bad.id")
    assert bad.status_code == 400 and "INVALID_SESSION_ID" in bad.text
    bad_seq = await http.get("/sessions/no-such-session/events", params={"from_seq": "x"})
    assert bad_seq.status_code in (400, 404)


async def test_refusals_answer_the_status_of_the_one_error_table(
    http: httpx.AsyncClient, ui: UIReplayerService, fixtures: dict[str, str]
) -> None:
    session_id = next(iter(fixtures.values()))
    answers = {
        "SESSION_NOT_FOUND": await http.get("/api/sessions/no-such-session/transcript"),
        "INVALID_SESSION_ID": await http.get("/api/sessions/bad.id/transcript"),
        "INVALID_BOUNDARY": await http.get(f"/api/sessions/{session_id}/transcript", params={"at": 10**6}),
    }

    # Codes a healthy UI does not meet on demand, raised inside the UI's own app so its error handler answers them.
    async def refuse(request: Request) -> Response:
        raise error_from_code(request.path_params["code"], "raised by the test")

    app = ui.build_app()
    app.router.routes.append(Route("/api/refuse/{code}", refuse))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ui") as client:
        for code in ("STRUCTURE_INVALID", "LOG_UNAVAILABLE", "CORRUPT_LOG", "CONFLICT"):
            answers[code] = await client.get(f"/api/refuse/{code}")
    for code, response in answers.items():
        assert response.json()["error"]["code"] == code, response.text
        assert response.status_code == CODES[code].status, (code, response.status_code)


async def test_the_session_list_is_newest_first_searchable_and_flags_open_turns(
    http: httpx.AsyncClient, log: SessionLog
) -> None:
    closed = await new_session(log, "A closed session.")
    await closed.close()
    opened = await new_session(log, "An open one.", close=False)
    try:
        page = await http.get("/")
        assert page.status_code == 200
        assert page.text.index(opened.session_id) < page.text.index(closed.session_id)  # newest first
        row = page.text[page.text.index(opened.session_id) :].split("</tr>")[0]
        assert "turn 1 open" in row
        found = await http.get("/", params={"q": opened.session_id[-8:]})
        assert opened.session_id in found.text and closed.session_id not in found.text
        api = (await http.get("/api/sessions", params={"q": opened.session_id})).json()
        assert [s["id"] for s in api] == [opened.session_id] and api[0]["open_turn"] == 1
        empty = await http.get("/", params={"q": "<nothing>"})
        assert "No sessions match." in empty.text and "&lt;nothing&gt;" in empty.text
    finally:
        await opened.close()


async def test_content_is_escaped_and_no_script_of_a_message_reaches_the_page(
    http: httpx.AsyncClient, log: SessionLog
) -> None:
    writer = await new_session(log, XSS)
    await writer.close()
    page = (await http.get(f"/sessions/{writer.session_id}")).text
    assert html.escape(XSS, quote=True) in page
    assert "<script>window" not in page and "<img src=x" not in page
    assert page.count("<script") == 1 and '<script src="/static/app.js" defer></script>' in page
    js = await http.get("/static/app.js")
    assert js.status_code == 200 and "innerHTML" not in js.text.replace("Never innerHTML with content", "")


# ---------------------------------------------------------------------------------------------- live tail


async def test_a_live_tail_streams_new_entries_and_deltas_as_they_are_flushed(
    http: httpx.AsyncClient, log: SessionLog
) -> None:
    writer = await new_session(log, "First.", close=False)
    try:
        next_seq = len(writer.session)
        async with http.stream("GET", f"/sessions/{writer.session_id}/events", params={"from_seq": next_seq}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = Sse(r)
            sync = await events.next()
            assert sync["event"] == "sync" and sync["data"] == {"next_seq": next_seq}
            await writer.emit(
                "request/header", {"header": {"config": {"provider": "p", "model": "m"}}, "reason": "initial"}
            )
            await writer.emit("step/start", {"turn": 1, "step": 1})
            for chunk in (
                {"type": "block-start", "index": 0, "blockType": "text"},
                {"type": "text-delta", "index": 0, "text": "Hel"},
            ):
                await writer.emit("assistant/chunk", {"turn": 1, "step": 1, "chunk": chunk})
            await writer.flush()
            stream = await events.until(lambda e: e["event"] == "entry" and e["data"]["kind"] == "stream")
            text = ""
            while text != "Hel":
                event = await events.next()
                if event["event"] == "delta":
                    text += event["data"]["text"]
                elif event["event"] == "entry" and event["data"]["key"] == stream["data"]["key"]:
                    text = "".join(b.get("text", "") for b in event["data"]["blocks"])
            await writer.emit(
                "assistant/chunk", {"turn": 1, "step": 1, "chunk": {"type": "text-delta", "index": 0, "text": "lo!"}}
            )
            await writer.flush()
            delta = await events.until(lambda e: e["event"] == "delta")
            assert delta["data"]["text"] == "lo!" and int(delta["id"]) == len(writer.session)
            message = {"id": "a1", "role": "assistant", "source": {"kind": "model"}, "content": [text_block("Hello!")]}
            await writer.emit(
                "assistant/message",
                {"turn": 1, "step": 1, "message": message},
                surface_op="append",
                source_event_seqs=list(range(next_seq + 2, next_seq + 5)),
            )
            await writer.flush()
            done = await events.until(lambda e: e["event"] == "entry" and e["data"]["kind"] == "message")
            assert done["data"]["replaces"] == stream["data"]["key"]
            assert done["data"]["blocks"][0]["text"] == "Hello!"
    finally:
        await writer.close()


async def test_a_reconnect_with_last_event_id_resumes_without_repeating(
    http: httpx.AsyncClient, log: SessionLog
) -> None:
    writer = await new_session(log, "One.", close=False)
    try:
        seen = len(writer.session)
        await writer.emit(
            "user/message",
            {"id": "u2", "role": "user", "source": {"kind": "user"}, "content": [text_block("Two.")]},
            surface_op="append",
        )
        await writer.flush()
        headers = {"last-event-id": str(seen)}
        async with http.stream(
            "GET", f"/sessions/{writer.session_id}/events", params={"from_seq": 0}, headers=headers
        ) as r:
            events = Sse(r)
            first = await events.next()
            assert first["event"] == "entry" and first["data"]["seq"] == seen  # only what it had not seen
            assert (await events.next())["event"] == "sync"
    finally:
        await writer.close()


async def test_a_replica_that_does_not_own_the_session_serves_it_from_the_stream(log: SessionLog) -> None:
    service = UIReplayerService(log, host="127.0.0.1", port=0, partitions=[])
    await service.start()
    writer = await new_session(log, "Far away.", close=False)
    try:
        async with httpx.AsyncClient(base_url=service.url, timeout=WAIT_S) as client:
            page = await client.get(f"/sessions/{writer.session_id}")
            assert page.status_code == 200 and "Far away." in page.text
            params = {"from_seq": len(writer.session)}
            async with client.stream("GET", f"/sessions/{writer.session_id}/events", params=params) as r:
                events = Sse(r)
                assert (await events.next())["event"] == "sync"
                await writer.emit(
                    "user/message",
                    {"id": "u2", "role": "user", "source": {"kind": "user"}, "content": [text_block("Closer.")]},
                    surface_op="append",
                )
                await writer.flush()
                entry = await events.until(lambda e: e["event"] == "entry")
                assert entry["data"]["blocks"][0]["text"] == "Closer."
    finally:
        await writer.close()
        await service.stop()


async def test_the_registered_factory_serves_on_the_configured_port_and_rebuilds(
    nats_server: Any, ui: UIReplayerService, fixtures: dict[str, str]
) -> None:
    await ui.stop()  # one runner of this projection at a time: durables are per projection name
    settings = log_settings(nats_server.url, ui_port=free_port())
    own = await SessionLog.connect(settings)
    try:
        handle = await factory("ui-replayer")(own, RunOptions(rebuild=True))
        try:
            assert isinstance(handle, UIReplayerService) and handle.port == settings.ui_port
            await handle.runner.wait_ready(WAIT_S)
            health = handle.health()
            assert health["projection"] == "ui-replayer" and health["live"]
            async with httpx.AsyncClient(base_url=handle.url, timeout=WAIT_S) as client:
                session_id = fixtures["acp-agent-cancel-session.jsonl"]
                page = await client.get(f"/sessions/{session_id}")
                assert "cancelled by the user" in page.text
                assert (await client.get("/healthz")).json()["projection"] == "ui-replayer"
        finally:
            await handle.stop()
    finally:
        await own.close()


async def test_a_stack_whose_ui_replayer_cannot_take_its_port_refuses_and_stops_what_it_had_started(
    nats_server: Any, log: SessionLog
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = log_settings(nats_server.url, ui_host="127.0.0.1", ui_port=port, metrics_port=0)
        with pytest.raises(PortInUse, match="SESSIONLOG_UI_PORT"):
            await Stack.start(["context-deriver", "ui-replayer"], settings)
    # The context-deriver started first, on the stack's own connection: it no longer answers.
    with pytest.raises(nats.errors.NoRespondersError):
        await log.nc.request("sessionlog.context.stats", b"{}", timeout=WAIT_S)
