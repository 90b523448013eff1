"""The operator's UI (issue 14), one JSON document.

- `overview`: 10,000 sessions in the log, the ui-replayer's fleet index caught up; `GET /` (HTML, first page, with
  the health panel and the lease holder of each of the 50 rows) and `GET /api/fleet`; goal: first page under 100 ms.
- `session`: a session of 100,000 events (streamed turns with tool calls); `GET /sessions/{id}` (the transcript's
  last page and the timeline), `GET /sessions/{id}/context?at=` at the first, middle and last request, and
  `GET /sessions/{id}/audit`; goal: the session page under 200 ms.
- `derive_at`: the model's view at a request in the middle of that session costs one derive: `Session.derive_at`
  against `Session.prefix(at).derive_messages()` (a replay of the prefix, what the view must not cost).

One temporary nats-server on a free port; times are the best and the median of repeated requests on one machine.
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

from services.ui_replayer.service import UIReplayerService
from sessionlog.embedded import EmbeddedServer
from sessionlog.jsonl import parse_jsonl
from sessionlog.log import SessionLog
from sessionlog.session import Session
from sessionlog.settings import Settings

from .bench_ui_audit import _session_header
from .common import scale
from .synth import synthetic_log

SESSIONS = scale(10_000, 200)
SESSION_EVENTS = scale(100_000, 5_000)
ROUNDS = scale(15, 3)
SMALL_LOG = [
    b'{"seq":0,"time":1780000000000,"type":"turn/start","data":{"turn":1}}',
    b'{"seq":1,"time":1780000000001,"type":"user/message","data":{"id":"u1","role":"user","source":{"kind":"user"},'
    b'"content":[{"type":"text","text":"hello"}]},"surfaceOp":"append"}',
    b'{"seq":2,"time":1780000000002,"type":"turn/end","data":{"turn":1,"reason":{"kind":"completed"}}}',
]


async def _timed(client: httpx.AsyncClient, path: str, rounds: int = ROUNDS) -> dict[str, float]:
    await client.get(path)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        response = await client.get(path)
        times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
    return {"best_ms": min(times), "median_ms": statistics.median(times), "bytes": len(response.content)}


async def _import(log: SessionLog, session_id: str, events: list[bytes]) -> None:
    await log.import_log(parse_jsonl(_session_header(session_id) + b"\n" + b"\n".join(events) + b"\n"), session_id)


async def overview(log: SessionLog, ui: UIReplayerService, client: httpx.AsyncClient) -> dict[str, Any]:
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with gate:
            await _import(log, f"fleet-{i:05d}", SMALL_LOG)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(SESSIONS)))
    imported_s = time.perf_counter() - start
    deadline = time.monotonic() + 120
    while sum(1 for r in ui.fleet.rows.values() if r.events) < SESSIONS:
        assert time.monotonic() < deadline, f"the fleet index holds {len(ui.fleet.rows)} sessions"
        await asyncio.sleep(0.1)
    return {
        "sessions": len(ui.fleet.rows),
        "import_s": imported_s,
        "html_first_page": await _timed(client, "/"),
        "html_filtered": await _timed(client, "/?q=fleet-0999"),
        "json_first_page": await _timed(client, "/api/fleet"),
        "goal_ms": 100,
    }


async def session_page(log: SessionLog, ui: UIReplayerService, client: httpx.AsyncClient) -> dict[str, Any]:
    events = synthetic_log(SESSION_EVENTS)
    await _import(log, "big", events)
    await ui.runner.wait_for("big", len(events) - 1, 120)
    state = await ui.runner.state("big")
    assert state is not None
    requests = state.requests()
    first, middle, last = requests[0], requests[len(requests) // 2], requests[-1]
    session: Session = state.session

    def best(fn: Any, rounds: int = 5) -> float:
        out = float("inf")
        for _ in range(rounds):
            gc.collect()
            begin = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - begin)
        return out * 1000

    derive_ms = best(lambda: session.derive_at(middle.at))
    replay_ms = best(lambda: session.prefix(middle.at).derive_messages(), 2)
    return {
        "session": {
            "events": len(session),
            "requests": len(requests),
            "transcript_page": await _timed(client, "/sessions/big"),
            "context_first": await _timed(client, f"/sessions/big/context?at={first.at}"),
            "context_middle": await _timed(client, f"/sessions/big/context?at={middle.at}"),
            "context_last": await _timed(client, f"/sessions/big/context?at={last.at}"),
            "audit": await _timed(client, "/sessions/big/audit", 5),
            "goal_ms": 200,
        },
        "derive_at": {
            "at": middle.at,
            "messages": len(session.derive_at(middle.at)),
            "derive_at_ms": derive_ms,
            "prefix_replay_ms": replay_ms,
            "replay_over_derive": replay_ms / derive_ms,
        },
    }


async def with_server() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(Path(tmp)).start()
        try:
            settings = Settings(_env_file=None, nats_url=server.url)
            log = await SessionLog.connect(settings)
            partitions = list(range(settings.partition_count))
            ui = UIReplayerService(log, host="127.0.0.1", port=0, partitions=partitions)
            await ui.start()
            try:
                await ui.runner.wait_ready(30)
                async with httpx.AsyncClient(base_url=ui.url, timeout=60) as client:
                    fleet = await overview(log, ui, client)
                    big = await session_page(log, ui, client)
            finally:
                await ui.stop()
                await log.close()
        finally:
            server.kill()
    return {"overview": fleet, **big}


def main() -> dict[str, Any]:
    logging.getLogger("sessionlog").setLevel(logging.ERROR)
    return {"benchmark": "ui", **asyncio.run(with_server())}


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    sys.stdout.write("\n")
