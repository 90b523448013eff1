"""Reliability, fault 3 of issue 15: each projection service process killed with SIGKILL mid-batch, repeatedly.

A service runs as `sessionlog serve NAME` (its own process, fixed partitions 0-7) while writers stream tool turns
and compactions; it is killed at seeded random moments and started again, resuming after its checkpoints. When the
writers stop and it has caught up, its answers for every session (the context-deriver's derivations, the
token-auditor's reports, the ui-replayer's transcripts) are taken, it is stopped, and a fresh process started with
`--rebuild` answers again: the two must be equal, and nothing was quarantined (an event applied twice is refused by
the session rules, so it would have been).

The repairer's kills are fault 4's subject (tests/test_reliability_writer_kill.py); the gateway keeps nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from reliability import Stopwatch, record_figures, rng, scale
from scaffold import WAIT_S, Opened, eventually
from sessiongen import compact_all
from test_context_deriver import ServiceProcess, answered, derive
from test_reliability_server_kill import stream_turns

from sessionlog.embedded import EmbeddedServer, free_port
from sessionlog.errors import SessionLogError
from sessionlog.log import SessionLog
from sessionlog.micro import call

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

SERVICES = ("context-deriver", "token-auditor", "ui-replayer")
# A restart is ready once it has caught up with the stream: bounded, and the full run's streams are long (the
# token-auditor also logs a finding for every generated step, whose tool call has no chunks of its own).
READY_S = 120.0


async def answer(name: str, log: SessionLog, session_id: str, min_seq: int, ui_port: int) -> Any:
    """What the service answers about one session, in its own shape."""
    if name == "context-deriver":
        return answered(await derive(log, {"session": session_id, "min_seq": min_seq, "timeout_ms": 10_000}, 15))
    if name == "token-auditor":
        return await call(log.nc, "sessionlog.audit.report", {"session": session_id, "min_seq": min_seq}, timeout=15)
    url = f"http://127.0.0.1:{ui_port}/api/sessions/{session_id}/transcript"

    def get() -> Any:
        with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
            return json.loads(reply.read())

    return await asyncio.to_thread(get)


async def caught_up(process: ServiceProcess, name: str) -> None:
    async def no_lag() -> bool:
        status, body = await asyncio.to_thread(process.health, "/healthz")
        if status != 200 or body is None:
            return False
        component = body["components"][name]
        return bool(component["ready"]) and all(v == 0 for v in component["lag_events"].values())

    await eventually(no_lag, f"{name} has no lag", timeout=READY_S)


def quarantined(process: ServiceProcess, name: str) -> int:
    status, body = process.health("/healthz")
    assert status == 200, process.output()
    return int(body["components"][name]["quarantined"])


@pytest.mark.parametrize("name", SERVICES)
async def test_a_service_killed_mid_batch_again_and_again_answers_what_a_clean_rebuild_answers(
    fresh_server: EmbeddedServer, tmp_path: Path, name: str
) -> None:
    kills = scale(2, 12)
    chance = rng(f"service-kill-{name}")
    ui_port = free_port()
    env = {"SESSIONLOG_PARTITIONS": "0-7", "SESSIONLOG_UI_PORT": str(ui_port)}
    process = ServiceProcess(name, fresh_server.url, tmp_path, **env)
    clean = ServiceProcess(name, fresh_server.url, tmp_path / "clean", **env)
    (tmp_path / "clean").mkdir()
    recovered = Stopwatch()
    try:
        async with Opened(fresh_server.url) as opened:
            log = await opened.connect()  # provisions the log before the service starts
            process.start()
            await process.wait_ready()
            writers = [await opened.create(log) for _ in range(scale(4, 12))]
            failures: list[SessionLogError] = []
            stop = asyncio.Event()
            # Paced: 24 writers at 0.1 s overloaded this shared 2-core machine's one server past the 5 s publish budget.
            streams = [asyncio.create_task(stream_turns(w, stop, failures, pause=0.3)) for w in writers]
            try:
                for i in range(kills):
                    await asyncio.sleep(chance.uniform(0.3, 1.2))
                    if i % 2 == 1:
                        await compact_all_between_turns(writers[0])
                    process.kill9()
                    killed_at = time.monotonic()
                    await asyncio.sleep(chance.uniform(0.0, 0.3))
                    process.start()
                    await process.wait_ready(timeout=READY_S)
                    recovered.since(killed_at)
            finally:
                stop.set()
                await asyncio.wait_for(asyncio.gather(*streams), WAIT_S * 3)
            assert failures == [], f"a writer failed: {failures[0]!r}"
            for writer in writers:
                await writer.flush()
            await caught_up(process, name)
            lived = {w.session_id: await answer(name, log, w.session_id, w.durable_seq, ui_port) for w in writers}
            assert quarantined(process, name) == 0, "an event applied twice would have been quarantined"
            process.stop()

            clean.start("--rebuild")
            await clean.wait_ready(timeout=READY_S)
            await caught_up(clean, name)
            rebuilt = {w.session_id: await answer(name, log, w.session_id, w.durable_seq, ui_port) for w in writers}
            for sid in lived:
                assert lived[sid] == rebuilt[sid], f"{name}: {sid} differs from a clean --rebuild"
            events = sum(w.durable_seq + 1 for w in writers)
        record_figures(
            f"{name} killed mid-batch, restarted, compared with --rebuild",
            fault=f"SIGKILL of the {name} process while writers stream",
            writers=len(writers),
            events_written=events,
            faults_injected=kills,
            events_lost=0,
            applied_twice=0,
            worst_recovery_s=recovered.worst,
            recovery="process start to /readyz (caught up with the stream)",
        )
    finally:
        process.stop()
        clean.stop()


async def compact_all_between_turns(writer: Any) -> None:
    """A compaction now and then, so rebuilds cross a generation change. The streaming task owns the writer's turns:
    this waits for a moment between them (bounded) and skips when none comes."""
    deadline = time.monotonic() + 2
    while writer.session.open_turn is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.001)
    if writer.session.open_turn is None:
        await compact_all(writer)
