"""Erasure of one session (`sessionlog purge`): admin only, and only on streams created to allow it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from natsfixtures import WAIT_S, log_settings, new_session_id, start_server
from scaffold import eventually

from services.context_deriver import ContextDeriver
from sessionlog.errors import PurgeRefused, SessionNotFound
from sessionlog.log import SessionLog
from sessionlog.runner import ProjectionRunner

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _session_with_events(log: SessionLog) -> str:
    session_id = new_session_id()
    writer = await log.create(session_id)
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await writer.close()
    return session_id


async def test_purge_is_refused_on_a_stream_created_with_deny_purge_and_nothing_is_lost(tmp_path: Path) -> None:
    server = start_server(tmp_path / "nats")
    try:
        log = await SessionLog.connect(log_settings(server.url))
        session_id = await _session_with_events(log)
        with pytest.raises(PurgeRefused, match="SESSIONLOG_ALLOW_PURGE"):
            await log.purge(session_id)
        assert len(await log.reader.events(session_id)) == 2
        assert await log.header(session_id) is not None
        await log.close()
    finally:
        server.kill()


async def test_purge_erases_records_and_header_and_projections_forget(tmp_path: Path) -> None:
    server = start_server(tmp_path / "nats")
    try:
        log = await SessionLog.connect(log_settings(server.url, allow_purge=True))
        session_id = await _session_with_events(log)
        keep = await _session_with_events(log)
        runner = ProjectionRunner(log, ContextDeriver(), claim=False)
        await runner.start()
        await runner.wait_for(session_id, 1, timeout=5)
        assert session_id in runner.states
        await log.purge(session_id)
        assert await log.reader.events(session_id) == []
        assert await log.header(session_id) is None
        assert [s.id for s in await log.sessions()] == [keep]

        async def forgotten() -> bool:
            return session_id not in runner.states

        await eventually(forgotten, "the runner forgets the purged session", WAIT_S)
        with pytest.raises(SessionNotFound):
            await log.purge(session_id)
        assert len(await log.reader.events(keep)) == 2
        await runner.stop()
        await log.close()
    finally:
        server.kill()


class _CountingDeriver(ContextDeriver):
    """Counts what the runner tells it to forget."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def on_forget(self, session_id: str) -> None:
        self.forgotten.append(session_id)


async def test_a_purge_tells_the_projection_to_forget_the_session_exactly_once(tmp_path: Path) -> None:
    server = start_server(tmp_path / "nats")
    try:
        log = await SessionLog.connect(log_settings(server.url, allow_purge=True))
        held, not_held = await _session_with_events(log), await _session_with_events(log)
        projection = _CountingDeriver()
        runner = ProjectionRunner(log, projection, claim=False)
        await runner.start()
        await runner.wait_for(held, 1, timeout=5)
        await runner.wait_for(not_held, 1, timeout=5)
        runner.sessions.forget(not_held)  # evicted before its purge: the service's caches still hear of it
        assert projection.forgotten == [not_held]
        for session_id in (held, not_held):
            await log.purge(session_id)

        async def told() -> bool:
            return projection.forgotten.count(held) > 0 and projection.forgotten.count(not_held) > 1

        await eventually(told, "the projection told to forget both purged sessions", WAIT_S)
        await asyncio.sleep(0.2)  # a second call, were there one, comes with the first
        assert projection.forgotten == [not_held, held, not_held]
        await runner.stop()
        await log.close()
    finally:
        server.kill()
