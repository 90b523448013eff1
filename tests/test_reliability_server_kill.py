"""Reliability, faults 1 and 6 of issue 15: kill -9 of a single nats-server under streaming writers, with the
server's default `sync_interval` and with `sync_interval: always`.

Writers stream whole tool turns (flushing where an agent flushes) while the server is killed with SIGKILL at seeded
random moments and started again on the same port and store. Afterwards every event whose `flush()` returned is in
the log exactly once and in order (records contiguous from seq 0, bytes equal to what the writer queued), the
writers rode through each short outage, a long outage fails a flush with `LOG_UNAVAILABLE` within a bound and
reports nothing durable that was not acknowledged, and a context-deriver that lived through the kills answers
exactly what a clean rebuild from the stream answers.

A process kill is what this machine can do. What the settings promise against an OS crash (the page cache lost) is
in docs/reliability.md, with why it cannot be tested here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from pathlib import Path

import pytest
from natsfixtures import start_server
from reliability import Stopwatch, record_figures, rng, scale
from scaffold import WAIT_S, Opened, assert_contiguous, eventually
from sessiongen import streamed_turn
from test_context_deriver import answered, derive, expected_reply, log_of
from test_runner import ALL, CheckedDeriver, CheckedState

from services.context_deriver.service import ContextDeriverService
from sessionlog.embedded import EmbeddedServer
from sessionlog.errors import LogUnavailable, SessionLogError
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.micro import call
from sessionlog.runner import ProjectionRunner

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

SYNC_ALWAYS_CONF = "jetstream {\n  sync_interval: always\n}\n"


def server_with(tmp_path: Path, sync: str) -> EmbeddedServer:
    """A server of the test's own; `sync="always"` runs it with JetStream's `sync_interval: always`."""
    args: list[str] = []
    if sync == "always":
        conf = tmp_path / "sync-always.conf"
        conf.write_text(SYNC_ALWAYS_CONF)
        args = ["-c", str(conf)]
    return start_server(tmp_path / "nats", extra_args=args)


def sync_always(server: EmbeddedServer) -> bool:
    assert server.monitor_url is not None
    with urllib.request.urlopen(f"{server.monitor_url}/varz", timeout=5) as reply:
        return bool(json.load(reply)["jetstream"]["config"].get("sync_always", False))


async def stream_turns(
    writer: SessionWriter, stop: asyncio.Event, failures: list[SessionLogError], pause: float = 0.01
) -> int:
    """Whole tool turns until told to stop, `pause` seconds apart; a typed failure ends this writer (kept for the
    test to judge)."""
    turns = 0
    while not stop.is_set():
        try:
            await streamed_turn(writer, f"turn {turns}", deltas=6, tools=1 + turns % 2)
            await writer.flush()
        except SessionLogError as err:
            failures.append(err)
            return turns
        turns += 1
        await asyncio.sleep(pause)
    return turns


async def assert_flushed_events_present_once_in_order(log: SessionLog, writer: SessionWriter) -> int:
    """Every acknowledged event is in the log once, in order, with the bytes the writer queued; returns how many
    events the log holds. (It may hold more than were acknowledged: an ack lost with the server.)"""
    records = await log.reader.records(writer.session_id)
    assert_contiguous(records)
    stored = [raw for record in records for raw in record.events]
    acked = writer.durable_seq + 1
    assert len(stored) >= acked, f"{writer.session_id}: {acked} events acknowledged, {len(stored)} in the log"
    queued = [event.raw for event in writer.session.events]
    assert stored == queued[: len(stored)], f"{writer.session_id}: the log differs from what the writer queued"
    return len(stored)


async def clean_rebuild(opened: Opened) -> ProjectionRunner[CheckedState]:
    log = await opened.connect()
    runner: ProjectionRunner[CheckedState] = opened.keep_runner(
        ProjectionRunner(log, CheckedDeriver(f"rel-check-{time.monotonic_ns()}"), partitions=ALL, rebuild=True)
    )
    await runner.start()
    await runner.wait_ready(timeout=WAIT_S * 2)
    return runner


@pytest.mark.parametrize("sync", ["default", "always"])
async def test_kill9_of_the_server_under_streaming_writers_loses_no_flushed_event(tmp_path: Path, sync: str) -> None:
    kills = scale(3, 20)
    writer_count = scale(4, 16)
    chance = rng(f"server-kill-{sync}")
    server = server_with(tmp_path, sync)
    assert sync_always(server) is (sync == "always")
    recovered = Stopwatch()
    try:
        # Default settings for the writers (10 s leases, 5 s publish budget): a short outage must not fail them.
        async with Opened(server.url) as opened:
            log = await opened.connect()
            deriver = opened.keep_service(ContextDeriverService(await opened.connect(), partitions=ALL))
            await deriver.start()
            await log.nc.flush()
            writers = [await opened.create(log) for _ in range(writer_count)]
            failures: list[SessionLogError] = []
            stop = asyncio.Event()
            streams = [asyncio.create_task(stream_turns(w, stop, failures)) for w in writers]
            try:
                for _ in range(kills):
                    await asyncio.sleep(chance.uniform(0.2, 1.2))
                    before = {w.session_id: w.durable_seq for w in writers}
                    server.kill()
                    killed_at = time.monotonic()
                    await asyncio.sleep(chance.uniform(0.0, 0.5))
                    await asyncio.to_thread(server.start)

                    async def all_wrote_again(before: dict[str, int] = before) -> bool:
                        return failures != [] or all(w.durable_seq > before[w.session_id] for w in writers)

                    await eventually(all_wrote_again, "every writer acknowledged again after the restart", 30)
                    recovered.since(killed_at)
                    assert failures == [], f"a writer failed in a short outage: {failures[0]!r}"
            finally:
                stop.set()
                turns = await asyncio.wait_for(asyncio.gather(*streams), WAIT_S * 3)
            assert failures == [], f"a writer failed in a short outage: {failures[0]!r}"
            assert min(turns) >= 1
            for writer in writers:
                await writer.flush()
            written = 0
            for writer in writers:
                written += await assert_flushed_events_present_once_in_order(log, writer)

            # The deriver that lived through the kills caught up and equals a clean rebuild.
            started = time.monotonic()
            rebuilt = await clean_rebuild(opened)
            for writer in writers:
                sid = writer.session_id
                reply = await derive(log, {"session": sid, "min_seq": writer.durable_seq, "timeout_ms": 10_000}, 15)
                assert answered(reply) == expected_reply(await log_of(log, sid)), f"{sid}: deriver differs from log"
                assert answered(reply) == expected_reply(rebuilt.states[sid].session), f"{sid}: differs from rebuild"
            caught_up_s = time.monotonic() - started
            stats = await call(log.nc, "sessionlog.context.stats", {}, timeout=WAIT_S)
            assert stats["quarantined"] == 0, "an event applied twice would have been refused and quarantined"
        record_figures(
            f"server kill -9 under streaming writers (sync_interval {sync})",
            fault="kill -9 of the only nats-server, restarted on the same store",
            writers=writer_count,
            events_written=written,
            faults_injected=kills,
            events_lost=0,
            duplicates=0,
            writer_failures=len(failures),
            worst_recovery_s=recovered.worst,
            projection_check_s=round(caught_up_s, 3),
        )
    finally:
        server.kill()


async def test_a_long_outage_fails_the_flush_with_log_unavailable_and_reports_nothing_unacknowledged(
    tmp_path: Path,
) -> None:
    server = server_with(tmp_path, "default")
    budget_s = 1.0  # both the request timeout and the publish retry budget (`publish_retry_s`)
    try:
        async with Opened(server.url, lease_ttl_s=1, request_timeout_s=budget_s, publish_retry_s=budget_s) as opened:
            log = await opened.connect()
            writer = await opened.create(log)
            await streamed_turn(writer, "before the outage")
            acked_before = await writer.flush()
            server.kill()
            started = time.monotonic()
            await streamed_turn_or_failure(writer)
            with pytest.raises(LogUnavailable) as caught:
                await writer.flush()
            failed_after = time.monotonic() - started
            assert caught.value.code == "LOG_UNAVAILABLE"
            assert "reported written" in str(caught.value) or "unavailable" in str(caught.value).lower()
            assert writer.durable_seq == acked_before, "nothing after the last acknowledgement is reported durable"
            # Bounded: a publish budget or two, and the reconnect wait, never a hang.
            assert failed_after < budget_s * 10 + 5
            await asyncio.to_thread(server.start)
            back = time.monotonic()
            fresh = await opened.connect()
            stored = await assert_flushed_events_present_once_in_order(fresh, writer)
            assert stored == acked_before + 1, "nothing was written while the server was down"
            resumed = await eventually_resumed(fresh, writer.session_id)
            await streamed_turn(resumed, "after the outage")
            await resumed.close()
            recovery_s = time.monotonic() - back
        record_figures(
            "long server outage: the flush fails typed",
            fault="the only nats-server down longer than the publish budget",
            events_written=stored,
            faults_injected=1,
            events_lost=0,
            error="LOG_UNAVAILABLE",
            time_to_error_s=round(failed_after, 3),
            worst_recovery_s=round(recovery_s, 3),
        )
    finally:
        server.kill()


async def streamed_turn_or_failure(writer: SessionWriter) -> None:
    """Write a turn while the server is down: queueing works until a flush inside the turn fails."""
    with contextlib.suppress(LogUnavailable):
        await streamed_turn(writer, "during the outage")


async def eventually_resumed(log: SessionLog, session_id: str) -> SessionWriter:
    """Resume once the failed writer's lease (1 s) has expired; its turn gets the SPEC 7 closers."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return await log.resume(session_id)
        except SessionLogError as err:
            if err.code != "LEASE_HELD" or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
