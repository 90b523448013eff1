"""The token-auditor against a real nats-server: the 81 dsh fixtures give no findings and ledgers that add up, a
tampered message is flagged (report and metrics), a real gateway's raw tee is matched against what the agent logged
and a difference is flagged, and the `audit` and `replay` commands print what the service holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
from natsfixtures import new_session_id
from scaffold import WAIT_S, serving
from test_audit import usage_sum
from test_fixtures_corpus import FIXTURE_FILES, FIXTURES_DIR, import_corpus, read_fixture

from services.gateway import GatewayConfig, ScriptedProvider, ServerThread, UpstreamConfig, build_app
from services.token_auditor.service import FINDINGS, TokenAuditorService
from sessionlog.audit import MESSAGE_DIFFERS, PROVIDER_USAGE_DIFFERS, RAW_STREAM_DIFFERS, audit_session
from sessionlog.cli import main as cli_main
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.micro import call
from sessionlog.openai_wire import chunk_decoder
from sessionlog.session import Session
from sessionlog.settings import Settings

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

HEADER = {"config": {"provider": "scripted", "model": "scripted-model"}, "system": "You are brief."}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fixtures(log: SessionLog) -> dict[str, str]:
    return await import_corpus(log, "a")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def auditor(log: SessionLog, fixtures: dict[str, str]) -> AsyncIterator[TokenAuditorService]:
    async with serving(TokenAuditorService(log, partitions=list(range(log.settings.partition_count)))) as service:
        yield service


async def report(log: SessionLog, session_id: str) -> dict[str, Any]:
    reply = await call(log.nc, "sessionlog.audit.report", {"session": session_id}, timeout=WAIT_S)
    assert isinstance(reply, dict)
    return reply


def finding_count(code: str) -> float:
    return float(FINDINGS.labels(code)._value.get())


# ---------------------------------------------------------------------------------------------- the corpus


async def test_no_fixture_gives_a_finding_and_every_ledger_is_the_sum_of_its_usage(
    log: SessionLog, auditor: TokenAuditorService, fixtures: dict[str, str]
) -> None:
    for path in FIXTURE_FILES:
        reply = await report(log, fixtures[path.name])
        assert reply["findings"] == [], path.name
        session = Session(read_fixture(path).events)
        assert reply["events"] == len(session) and reply["seq"] == len(session) - 1
        total = reply["ledger"]["total"]
        expected = usage_sum(session)
        got = {
            "input": total["input_tokens"],
            "output": total["output_tokens"],
            "cache_read": total["cache_read_tokens"],
            "cache_write": total["cache_write_tokens"],
            "reasoning": total["reasoning_tokens"],
        }
        assert got == {k: v for k, v in expected.items() if k != "requests"}, path.name
        pure = msgspec.to_builtins(audit_session(session).ledger())
        assert reply["ledger"] == pure


async def test_a_tampered_assistant_message_is_flagged_in_the_report_and_the_metrics(
    log: SessionLog, auditor: TokenAuditorService
) -> None:
    path = FIXTURES_DIR / "acp-agent-multi-turn-session.jsonl"
    original = read_fixture(path)
    events = list(original.events)
    seq = next(i for i, raw in enumerate(events) if b'"assistant/message"' in raw and b'"type":"text"' in raw)
    text = next(b["text"] for b in msgspec.json.decode(events[seq])["data"]["message"]["content"] if "text" in b)
    events[seq] = events[seq].replace(msgspec.json.encode(text), msgspec.json.encode(text + " Trust me."), 1)
    before = finding_count(MESSAGE_DIFFERS)
    session_id = new_session_id("tampered")
    await log.import_log(msgspec.structs.replace(original, events=events), session_id)
    deadline = time.monotonic() + WAIT_S
    while finding_count(MESSAGE_DIFFERS) < before + 1:  # the live consumer finds it without being asked
        assert time.monotonic() < deadline, "the auditor did not flag the tampered message"
        await asyncio.sleep(0.02)
    reply = await report(log, session_id)
    assert [f["code"] for f in reply["findings"]] == [MESSAGE_DIFFERS]
    assert reply["findings"][0]["seq"] == seq and "Trust me." in reply["findings"][0]["message"]
    await report(log, session_id)  # asking again does not count it again
    assert finding_count(MESSAGE_DIFFERS) == before + 1


async def test_a_replica_that_does_not_own_the_session_reports_from_the_stream(
    log: SessionLog, fixtures: dict[str, str]
) -> None:
    service = TokenAuditorService(log, partitions=[], raw_feed=False)
    await service.start()
    try:
        session_id = fixtures["acp-agent-empty-response-retry-session.jsonl"]
        far = await service.report(session_id)
        assert far.findings == [] and far.ledger.total.requests == 2 and far.steps == 1
    finally:
        await service.stop()


async def test_a_replica_that_does_not_own_the_session_waits_for_min_seq_as_the_owner_does(log: SessionLog) -> None:
    # It used to refuse at once (LOG_UNAVAILABLE) when the stream did not hold `min_seq` yet, where the owner waits:
    # the answer depended on which replica took the request.
    service = TokenAuditorService(log, partitions=[], raw_feed=False)
    await service.start()
    try:
        writer = await log.create(new_session_id())
        await writer.emit("turn/start", {"turn": 1})
        await writer.flush()
        asked = asyncio.ensure_future(service.report(writer.session_id, min_seq=1, timeout=WAIT_S))
        await asyncio.sleep(0.05)  # the report is waiting when the seq lands
        await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
        await writer.flush()
        assert (await asyncio.wait_for(asked, WAIT_S)).findings == []
        await writer.close()
    finally:
        await service.stop()


async def test_unknown_and_malformed_report_requests_are_refused_with_their_codes(
    log: SessionLog, auditor: TokenAuditorService
) -> None:
    from sessionlog.errors import InvalidRequest, InvalidSessionId, SessionNotFound

    with pytest.raises(SessionNotFound):
        await report(log, "no-such-session")
    with pytest.raises(InvalidSessionId):
        await report(log, "bad.id")
    with pytest.raises(InvalidRequest):
        await call(log.nc, "sessionlog.audit.report", {"session": 3}, timeout=WAIT_S)


# ---------------------------------------------------------------------------------------------- the gateway tee


@pytest.fixture(scope="module")
def provider() -> Iterator[ScriptedProvider]:
    yield ScriptedProvider()


@pytest.fixture(scope="module")
def gateway(provisioned: Settings, provider: ScriptedProvider) -> Iterator[ServerThread]:
    with ServerThread(provider.app()) as provider_server:
        upstream = UpstreamConfig("scripted", provider_server.url + "/v1", timeout_s=5.0, connect_timeout_s=1.0)
        config = GatewayConfig(
            upstream=upstream, derivation="stream", raw_stream=provisioned.raw_stream, metrics_port=0
        )
        with ServerThread(build_app(provisioned, config)) as server:
            yield server


class Agent:
    """An agent that asks the gateway for each answer and logs the stream as dsh's adapter does: block-start,
    deltas, block-end, usage and finish chunks, then the assistant/message."""

    def __init__(self, writer: SessionWriter, gateway: ServerThread) -> None:
        self.writer = writer
        self.gateway = gateway

    async def turn(self, text: str, *, log_text: Any = None, log_usage: Any = None) -> None:
        w = self.writer
        turn = (w.session.last_turn or 0) + 1
        await w.emit("turn/start", {"turn": turn})
        message = {
            "id": f"u{turn}",
            "role": "user",
            "source": {"kind": "user"},
            "content": [{"type": "text", "text": text}],
        }
        await w.emit("user/message", message, surface_op="append")
        await w.emit("step/start", {"turn": turn, "step": 1})
        if w.session.fold_request_header() is None:
            await w.emit("request/header", {"header": HEADER, "reason": "initial"})
        seq = await w.flush()
        body = {"stream": True, "stream_options": {"include_usage": True}}
        headers = {"X-Session-Seq": str(seq)}
        pieces: list[str] = []
        usage: dict[str, Any] = {}
        finish = "stop"
        async with (
            httpx.AsyncClient(base_url=self.gateway.url, timeout=WAIT_S) as client,
            client.stream("POST", f"/v1/sessions/{w.session_id}/completions", json=body, headers=headers) as r,
        ):
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = chunk_decoder.decode(line[6:])
                if chunk.usage is not None:
                    usage = msgspec.to_builtins(chunk.usage)
                for choice in chunk.choices or ():
                    if choice.delta is not None and choice.delta.content:
                        pieces.append(choice.delta.content)
                    finish = choice.finish_reason or finish
        if log_text is not None:
            pieces = log_text(pieces)
        if log_usage is not None:
            usage = log_usage(usage)
        seqs = []

        async def chunk(body: dict[str, Any]) -> None:
            seqs.append((await w.emit("assistant/chunk", {"turn": turn, "step": 1, "chunk": body})).seq)

        await chunk({"type": "block-start", "index": 0, "blockType": "text"})
        for piece in pieces:
            await chunk({"type": "text-delta", "index": 0, "text": piece})
        full = "".join(pieces)
        await chunk({"type": "block-end", "index": 0, "block": {"type": "text", "text": full}})
        logged_usage = {"inputTokens": usage["prompt_tokens"], "outputTokens": usage["completion_tokens"]}
        await chunk({"type": "usage", "usage": logged_usage})
        await chunk({"type": "finish", "reason": {"kind": {"stop": "stop"}.get(finish, finish)}})
        answer = {
            "id": f"a{turn}",
            "role": "assistant",
            "content": [{"type": "text", "text": full}],
            "source": {"kind": "model", "provider": "scripted", "model": "scripted-model"},
        }
        await w.emit(
            "assistant/message",
            {"turn": turn, "step": 1, "message": answer, "usage": logged_usage},
            surface_op="append",
            source_event_seqs=seqs,
        )
        await w.emit("step/end", {"turn": turn, "step": 1})
        await w.emit("turn/end", {"turn": turn, "reason": {"kind": "completed"}})
        await w.flush()


async def raw_report(log: SessionLog, session_id: str, exchanges: int) -> dict[str, Any]:
    """The report once the tee holds `exchanges` exchanges (the gateway publishes them in the background)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        reply = await report(log, session_id)
        if reply["raw_exchanges"] >= exchanges:
            return reply
        assert time.monotonic() < deadline, f"the raw tee of {session_id} holds {reply['raw_exchanges']} exchanges"
        await asyncio.sleep(0.05)


async def test_a_gateway_tee_that_matches_what_the_agent_logged_gives_no_finding(
    log: SessionLog, auditor: TokenAuditorService, gateway: ServerThread, provider: ScriptedProvider
) -> None:
    provider.load([{"text": "Paris is the capital of France."}, {"text": "It has about two million people."}])
    writer = await log.create(new_session_id("tee"))
    try:
        agent = Agent(writer, gateway)
        await agent.turn("What is the capital of France?")
        await agent.turn("How many people live there?")
    finally:
        await writer.close()
    reply = await raw_report(log, writer.session_id, 2)
    assert reply["findings"] == []
    assert reply["raw_matched"] == 2 and reply["ledger"]["total"]["requests"] == 2


async def test_a_gateway_tee_that_differs_from_the_log_is_flagged(
    log: SessionLog, auditor: TokenAuditorService, gateway: ServerThread, provider: ScriptedProvider
) -> None:
    provider.load([{"text": "The answer is 42."}])
    before = finding_count(RAW_STREAM_DIFFERS)
    writer = await log.create(new_session_id("tee"))
    try:
        agent = Agent(writer, gateway)
        await agent.turn("What is the answer?", log_text=lambda pieces: [p.replace("42", "43") for p in pieces])
    finally:
        await writer.close()
    reply = await raw_report(log, writer.session_id, 1)
    assert [f["code"] for f in reply["findings"]] == [RAW_STREAM_DIFFERS]
    assert "43" in reply["findings"][0]["message"] and "42" in reply["findings"][0]["message"]
    assert reply["findings"][0]["request_id"].startswith("req-")
    deadline = time.monotonic() + WAIT_S
    while finding_count(RAW_STREAM_DIFFERS) < before + 1:  # the raw feed found it too, and counted it once
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_usage_the_provider_reported_differently_from_the_log_is_flagged(
    log: SessionLog, auditor: TokenAuditorService, gateway: ServerThread, provider: ScriptedProvider
) -> None:
    provider.load([{"text": "Done.", "usage": {"prompt_tokens": 50, "completion_tokens": 3}}])
    writer = await log.create(new_session_id("tee"))
    try:
        agent = Agent(writer, gateway)
        await agent.turn("Finish.", log_usage=lambda usage: {**usage, "completion_tokens": 1})
    finally:
        await writer.close()
    reply = await raw_report(log, writer.session_id, 1)
    assert [f["code"] for f in reply["findings"]] == [PROVIDER_USAGE_DIFFERS]


# ---------------------------------------------------------------------------------------------- the CLI


async def cli(monkeypatch: pytest.MonkeyPatch, settings: Settings, *argv: str) -> int:
    monkeypatch.setenv("SESSIONLOG_NATS_URL", settings.nats_url or "")
    return await asyncio.to_thread(cli_main, list(argv))


async def test_audit_prints_the_report_as_json_and_as_tables(
    log: SessionLog,
    auditor: TokenAuditorService,
    fixtures: dict[str, str],
    provisioned: Settings,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    session_id = fixtures["acp-agent-empty-response-retry-session.jsonl"]
    assert await cli(monkeypatch, provisioned, "audit", session_id, "--json") == 0
    printed = msgspec.json.decode(capfd.readouterr().out)
    assert printed == await report(log, session_id)
    monkeypatch.setenv("COLUMNS", "160")  # Rich folds long cells on a narrow terminal
    assert await cli(monkeypatch, provisioned, "audit", session_id) == 0
    out = capfd.readouterr().out
    assert "token ledger" in out and "deepseek-v4-flash" in out and "no findings" in out
    assert await cli(monkeypatch, provisioned, "audit", session_id, "--local", "--json") == 0
    local = msgspec.json.decode(capfd.readouterr().out)
    assert local["ledger"] == printed["ledger"] and local["findings"] == []


async def test_replay_prints_a_steps_chunks_exactly_as_logged(
    log: SessionLog, fixtures: dict[str, str], provisioned: Settings, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    name = "acp-agent-empty-response-retry-session.jsonl"
    events = read_fixture(FIXTURES_DIR / name).events
    session = Session(events)
    expected = [e.raw for e in session if e.type == "assistant/chunk"]
    assert await cli(monkeypatch, provisioned, "replay", fixtures[name], "--step", "1.1", "--realtime") == 0
    captured = capfd.readouterr()
    assert captured.out.encode().split(b"\n")[:-1] == expected
    assert "no times" in captured.err
    assert await cli(monkeypatch, provisioned, "replay", fixtures[name], "--step", "1.1", "--text") == 0
    assert "Recovered." in capfd.readouterr().out
    assert await cli(monkeypatch, provisioned, "replay", fixtures[name], "--step", "4.1") == 1
    assert "error INVALID_STEP" in capfd.readouterr().err
    assert await cli(monkeypatch, provisioned, "replay", fixtures[name], "--step", "one") == 1


async def test_replay_realtime_keeps_the_original_pace(
    log: SessionLog, provisioned: Settings, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    writer = await log.create(new_session_id("pace"))
    try:
        await writer.emit("turn/start", {"turn": 1}, time_ms=1_000)
        await writer.emit("step/start", {"turn": 1, "step": 1}, time_ms=1_000)
        for offset, piece in enumerate(("a", "b", "c")):
            chunk = {"type": "text-delta", "index": 0, "text": piece}
            await writer.emit("assistant/chunk", {"turn": 1, "step": 1, "chunk": chunk}, time_ms=1_000 + 150 * offset)
        await writer.emit("step/end", {"turn": 1, "step": 1}, time_ms=1_400)
        await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}}, time_ms=1_400)
    finally:
        await writer.close()
    start = time.monotonic()
    assert await cli(monkeypatch, provisioned, "replay", writer.session_id, "--step", "1.1", "--realtime") == 0
    elapsed = time.monotonic() - start
    assert len(capfd.readouterr().out.splitlines()) == 3
    assert elapsed >= 0.3  # two gaps of 150 ms
