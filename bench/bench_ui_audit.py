"""ui-replayer and token-auditor speed (issue 6), one JSON document.

- `render`: the transcript page of a 10,000-event session: the pure build (transcript model from the log) plus the
  HTML, and a whole `GET /sessions/{id}` against the running service with the session in memory.
- `live_tail`: from a writer's `flush()` of one new message to the SSE `entry` event a connected page receives,
  p50/p99 (`from_flush_call_ms` starts before `flush()`; `after_flush_ack_ms` starts when it returned).
- `auditor`: a chunk-heavy session read from the stream and audited, against the floor of the same raw read plus
  one decode per event (`decode_event`) in the same run; goal: at least 50% of the floor's events/s. `service_s`
  is the token-auditor service rebuilding the same session from stream seq 1 until it has applied its last seq.

One temporary nats-server on a free port; figures are ratios within one run, absolute times depend on the machine.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from services.token_auditor.service import AuditState, TokenAuditorService
from services.ui_replayer.pages import SessionContext, render_transcript_page
from services.ui_replayer.service import UIReplayerService
from services.ui_replayer.views import requests_of
from sessionlog.audit import audit_session
from sessionlog.embedded import EmbeddedServer
from sessionlog.events import decode_event
from sessionlog.jsonl import decode_header, parse_jsonl
from sessionlog.log import SessionLog
from sessionlog.session import Session
from sessionlog.settings import Settings
from sessionlog.transcript import build_transcript

from .common import scale
from .synth import HEADER, synthetic_log

RENDER_EVENTS = scale(10_000, 1_000)
TAIL_ROUNDS = scale(300, 30)
AUDIT_EVENTS = scale(100_000, 5_000)


def render_log() -> list[bytes]:
    """About RENDER_EVENTS events of whole turns (the log ends with a turn/end)."""
    events = synthetic_log(RENDER_EVENTS)[:RENDER_EVENTS]
    return events[: max(i for i, raw in enumerate(events) if b'"turn/end"' in raw) + 1]


def _best(fn: Any, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max": ordered[-1],
    }


def pure_render(events: list[bytes]) -> dict[str, float]:
    session = Session(events)
    build_s = _best(lambda: build_transcript(session, HEADER), 5)
    transcript = build_transcript(session, HEADER)
    context = SessionContext(
        session_id="bench",
        title=transcript.title,
        header=decode_header(HEADER),
        events=len(session),
        open_turn=None,
        lease_holder=None,
        last_activity=None,
        children=[],
        ancestors=[],
        requests=requests_of(audit_session(session)),
        compactions=[],
        tab="transcript",
    )
    html_s = _best(lambda: render_transcript_page(transcript, context), 5)
    html = render_transcript_page(transcript, context)
    return {
        "events": len(session),
        "entries": len(transcript.entries),
        "build_ms": build_s * 1000,
        "html_ms": html_s * 1000,
        "total_ms": (build_s + html_s) * 1000,
        "html_bytes": len(html),
    }


def _session_header(session_id: str) -> Any:
    header = msgspec.json.decode(HEADER)
    header["id"] = session_id
    return msgspec.json.encode(header)


async def _import(log: SessionLog, session_id: str, events: list[bytes]) -> None:
    log_file = parse_jsonl(_session_header(session_id) + b"\n" + b"\n".join(events) + b"\n")
    await log.import_log(log_file, session_id)


async def served(log: SessionLog, events: list[bytes]) -> dict[str, Any]:
    ui = UIReplayerService(log, host="127.0.0.1", port=0, partitions=list(range(log.settings.partition_count)))
    await ui.start()
    try:
        await ui.runner.wait_ready(30)
        await _import(log, "render", events)
        await ui.runner.wait_for("render", len(events) - 1, 30)
        async with httpx.AsyncClient(base_url=ui.url, timeout=30) as client:
            await client.get("/sessions/render")
            times = []
            for _ in range(10):
                start = time.perf_counter()
                response = await client.get("/sessions/render")
                times.append(time.perf_counter() - start)
                assert response.status_code == 200
            page = {"http_get_ms": min(times) * 1000, "http_get_median_ms": statistics.median(times) * 1000}
            tail = await live_tail(log, client)
        return {"page": page, "live_tail": tail}
    finally:
        await ui.stop()


async def live_tail(log: SessionLog, client: httpx.AsyncClient) -> dict[str, Any]:
    writer = await log.create("tail")
    from_call: list[float] = []
    after_ack: list[float] = []
    try:
        await writer.emit("turn/start", {"turn": 1})
        await writer.flush()
        params = {"from_seq": len(writer.session)}
        async with client.stream("GET", "/sessions/tail/events", params=params) as response:
            lines = response.aiter_lines()

            async def entry_with_seq(seq: int) -> None:
                while True:
                    line = await anext(lines)
                    if line.startswith("data: {") and f'"seq":{seq},' in line and '"kind":"message"' in line:
                        return

            await asyncio.sleep(0.2)
            for i in range(TAIL_ROUNDS):
                message = {"id": f"u{i}", "role": "user", "source": {"kind": "user"},
                           "content": [{"type": "text", "text": f"message {i}"}]}  # fmt: skip
                event = await writer.emit("user/message", message, surface_op="append")
                waiter = asyncio.ensure_future(entry_with_seq(event.seq))
                start = time.perf_counter()
                await writer.flush()
                acked = time.perf_counter()
                await asyncio.wait_for(waiter, 10)
                done = time.perf_counter()
                from_call.append((done - start) * 1000)
                after_ack.append((done - acked) * 1000)
    finally:
        await writer.close()
    return {
        "rounds": TAIL_ROUNDS,
        "from_flush_call_ms": _percentiles(from_call),
        "after_flush_ack_ms": _percentiles(after_ack),
    }


async def auditor(log: SessionLog) -> dict[str, Any]:
    events = synthetic_log(AUDIT_EVENTS, deltas=400, tools=0)  # ~99% of the events are chunks
    await _import(log, "audit", events)
    chunks = sum(1 for raw in events if b'"assistant/chunk"' in raw[:80])

    async def floor() -> float:
        start = time.perf_counter()
        records = await log.reader.records("audit")
        position = 0
        for record in records:
            for raw in record.events:
                decode_event(raw, position)
                position += 1
        return time.perf_counter() - start

    async def audited() -> float:
        start = time.perf_counter()
        records = await log.reader.records("audit")
        state = AuditState("audit", {})
        for record in records:
            state.apply(record)
        elapsed = time.perf_counter() - start
        assert state.auditor.findings == [], state.auditor.findings[:3]
        assert state.auditor.chunks == chunks  # it took every chunk, not a shortcut past them
        return elapsed

    floor_s = audit_s = float("inf")
    for _ in range(3):  # alternate, so both see the same machine state
        gc.collect()
        floor_s = min(floor_s, await floor())
        gc.collect()
        audit_s = min(audit_s, await audited())
    service = TokenAuditorService(
        log, rebuild=True, raw_feed=False, partitions=list(range(log.settings.partition_count))
    )
    start = time.perf_counter()
    await service.start()
    try:
        await service.runner.wait_for("audit", len(events) - 1, 120)
        service_s = time.perf_counter() - start
    finally:
        await service.stop()
    return {
        "events": len(events),
        "chunks": chunks,
        "floor_events_per_s": len(events) / floor_s,
        "auditor_events_per_s": len(events) / audit_s,
        "auditor_over_floor": floor_s / audit_s,
        "goal_over_floor": 0.5,
        "service_rebuild_s": service_s,
        "service_events_per_s": len(events) / service_s,
    }


async def with_server() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(Path(tmp)).start()
        try:
            settings = Settings(_env_file=None, nats_url=server.url)
            log = await SessionLog.connect(settings)
            try:
                serving = await served(log, render_log())
                audit = await auditor(log)
            finally:
                await log.close()
        finally:
            server.kill()
    return {"serving": serving, "auditor": audit}


def main() -> dict[str, Any]:
    # The render session's synthetic steps announce tool calls they never streamed: the auditor says so, per step.
    logging.getLogger("sessionlog.token_auditor").setLevel(logging.ERROR)
    render = pure_render(render_log())
    measured = asyncio.run(with_server())
    render.update(measured["serving"]["page"])
    return {
        "benchmark": "ui_audit",
        "render": render,
        "live_tail": measured["serving"]["live_tail"],
        "auditor": measured["auditor"],
    }


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    sys.stdout.write("\n")
