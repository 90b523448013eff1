"""The check mode's derivation without a read of the tail per request (`services.gateway.tails.TailWatch`).

A request that names the seq its caller flushed is answered from the session the gateway holds when that seq is
held, the watch is confirmed and no newer record was announced; every other request reads the tail, as before.
Announced records are read ahead in the background. A hint is never applied: a record the stream refuses only
makes the gateway read. Real nats-server, real writers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import nats.js.errors
import pytest
import pytest_asyncio
from natsfixtures import bounded, log_settings, new_session_id
from sessiongen import user_turn

from services.gateway import tails
from services.gateway.derivation import Derivation, StreamSource
from sessionlog.embedded import EmbeddedServer
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.record import FORMAT, H_COUNT, H_EXPECTED_LAST_SUBJECT_SEQ, H_FIRST_SEQ, H_FORMAT, in_subject
from sessionlog.session import messages_canonical
from sessionlog.settings import Settings

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

WAIT_S = 10.0


@pytest_asyncio.fixture(loop_scope="module")
async def log(provisioned: Settings) -> AsyncIterator[SessionLog]:
    assert provisioned.nats_url is not None
    opened = await SessionLog.connect(log_settings(provisioned.nats_url))
    try:
        yield opened
    finally:
        await bounded(opened.close())


@pytest_asyncio.fixture(loop_scope="module")
async def source(log: SessionLog) -> AsyncIterator[StreamSource]:
    made = StreamSource(log, wait_s=1.0)
    try:
        yield made
    finally:
        await made.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {WAIT_S}s: {what}")


async def settled(source: StreamSource, session_id: str, seq: int) -> None:
    """Until the watch of the session is confirmed, nothing is being read ahead and the last read holds `seq`."""
    tails = source.tails
    assert tails is not None
    await until(lambda: tails.settled(session_id, seq), "the watch settles")


async def watched(source: StreamSource, writer: SessionWriter) -> int:
    """A first turn written, asked for once (a read, which starts the watch) and the watch settled; the seq flushed."""
    seq = await user_turn(writer, "one")
    await source.derive(writer.session_id, seq)
    await settled(source, writer.session_id, seq)
    return seq


class Clock:
    """A monotonic clock for the tails module that moves only when a test moves it: a confirmation ages by exactly
    what the test says, however late the loop runs the test or a read in the background."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(tails, "time", clock)
    return clock


def same(derived: Derivation, writer: SessionWriter) -> bool:
    return messages_canonical(derived.messages) == messages_canonical(writer.session.derive_messages()) and (
        derived.seq == writer.durable_seq
    )


async def made(source: StreamSource, session_id: str, min_seq: int | None) -> tuple[Derivation, str]:
    """The source's derivation and how it was made: "watched" (no read) or "read"."""
    derived = await source.derive(session_id, min_seq)
    return derived, "watched" if derived.source == "watched" else "read"


async def test_a_request_naming_its_seq_is_answered_without_a_read_once_the_watch_is_confirmed(
    log: SessionLog, source: StreamSource
) -> None:
    writer = await log.create(new_session_id("tail"))
    try:
        seq = await user_turn(writer, "one")
        first, how = await made(source, writer.session_id, seq)
        assert how == "read" and same(first, writer)
        # The watch is not confirmed until a read that began after its subscription is over.
        _, how = await made(source, writer.session_id, seq)
        assert how == "read"
        await settled(source, writer.session_id, writer.durable_seq)
        again, how = await made(source, writer.session_id, seq)
        assert how == "watched" and same(again, writer)
        # Without a seq the caller claims nothing: the tail is read.
        _, how = await made(source, writer.session_id, None)
        assert how == "read"
    finally:
        await writer.close()


async def test_records_flushed_between_requests_are_read_ahead_and_always_reflected(
    log: SessionLog, source: StreamSource
) -> None:
    writer = await log.create(new_session_id("tail"))
    try:
        await watched(source, writer)
        ways = []
        for text in ("two", "three", "four"):
            # Asked at once after the flush: whichever way it is made, it holds what the caller flushed.
            seq = await user_turn(writer, text)
            derived, how = await made(source, writer.session_id, seq)
            assert same(derived, writer), f"after {text!r} ({how})"
            await settled(source, writer.session_id, writer.durable_seq)
            # Asked once the read ahead is over: no read on the request's path.
            derived, how = await made(source, writer.session_id, seq)
            assert same(derived, writer)
            ways.append(how)
        assert ways == ["watched"] * 3
    finally:
        await writer.close()


async def test_a_record_the_stream_refuses_is_never_taken_and_only_makes_the_gateway_read(
    log: SessionLog, source: StreamSource
) -> None:
    writer = await log.create(new_session_id("tail"))
    try:
        seq = await watched(source, writer)
        # A fenced writer's record: it announces seqs beyond the log and the stream refuses it.
        forged = b'[{"type":"user/message","data":{}}]'
        headers = {H_FORMAT: FORMAT, H_FIRST_SEQ: str(seq + 1), H_COUNT: "1", H_EXPECTED_LAST_SUBJECT_SEQ: "1"}
        with pytest.raises(nats.js.errors.APIError):
            await log.js.publish(in_subject(writer.session_id), forged, headers=headers)
        tails = source.tails
        assert tails is not None
        await until(lambda: tails.announced(writer.session_id) == seq + 1, "the hint arrives")
        derived, how = await made(source, writer.session_id, seq)
        assert how == "read", "a seq was announced beyond what is held"
        assert same(derived, writer), "the refused record is not in the derivation"
        # The log grows past the announcement: the session is answered without reads again.
        seq = await user_turn(writer, "two")
        await settled(source, writer.session_id, writer.durable_seq)
        derived, how = await made(source, writer.session_id, seq)
        assert how == "watched" and same(derived, writer)
    finally:
        await writer.close()


async def test_a_seq_beyond_the_log_is_waited_for_and_refused_as_before(log: SessionLog, source: StreamSource) -> None:
    writer = await log.create(new_session_id("tail"))
    try:
        seq = await watched(source, writer)
        short = StreamSource(log, wait_s=0.2)
        try:
            await short.derive(writer.session_id, seq)
            with pytest.raises(Exception) as refused:
                await short.derive(writer.session_id, seq + 5)
            assert getattr(refused.value, "code", None) == "DERIVATION_DIVERGES"
        finally:
            await short.close()
    finally:
        await writer.close()


async def test_a_session_dropped_from_the_cache_is_no_longer_watched(log: SessionLog) -> None:
    source = StreamSource(log, wait_s=1.0, max_sessions=1)
    writers = [await log.create(new_session_id("tail")) for _ in range(2)]
    try:
        for writer in writers:
            await source.derive(writer.session_id, await user_turn(writer, "one"))
        tails = source.tails
        assert tails is not None
        assert not tails.watching(writers[0].session_id) and tails.watching(writers[1].session_id)
        # Held again later, it is read and watched again.
        derived, how = await made(source, writers[0].session_id, writers[0].durable_seq)
        assert how == "read" and same(derived, writers[0]) and tails.watching(writers[0].session_id)
    finally:
        for writer in writers:
            await writer.close()
        await source.close()


async def test_a_reconnect_withdraws_every_confirmation_until_a_read_after_it(fresh_server: EmbeddedServer) -> None:
    opened = await SessionLog.connect(log_settings(fresh_server.url))
    source = StreamSource(opened, wait_s=WAIT_S)
    writer = await opened.create(new_session_id("tail"))
    try:
        seq = await watched(source, writer)
        _, how = await made(source, writer.session_id, seq)
        assert how == "watched"
        reconnects = opened.nc.stats["reconnects"]
        await asyncio.to_thread(fresh_server.restart)
        await until(lambda: opened.nc.stats["reconnects"] > reconnects and opened.nc.is_connected, "a reconnect")
        derived, how = await made(source, writer.session_id, seq)
        assert how == "read", "hints may have been lost while the connection was down"
        assert same(derived, writer)
        await settled(source, writer.session_id, writer.durable_seq)
        _, how = await made(source, writer.session_id, seq)
        assert how == "watched"
    finally:
        await bounded(writer.close())
        await source.close()
        await bounded(opened.close())


async def test_a_watch_answers_only_shortly_after_the_read_that_confirmed_it(
    log: SessionLog, source: StreamSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record no hint announced (one accepted just before the subscription reached the server, a confirming read
    answered by a follower that lags) is missed for at most `CONFIRMED_FOR_S`: after that the tail is read."""
    clock = frozen_clock(monkeypatch)
    writer = await log.create(new_session_id("tail"))
    try:
        seq = await watched(source, writer)
        _, how = await made(source, writer.session_id, seq)
        assert how == "watched"
        clock.advance(tails.CONFIRMED_FOR_S + 0.01)
        _, how = await made(source, writer.session_id, seq)
        assert how == "read", "the confirmation is older than CONFIRMED_FOR_S"
        await settled(source, writer.session_id, writer.durable_seq)  # that request's read confirmed it again
        _, how = await made(source, writer.session_id, seq)
        assert how == "watched"
    finally:
        await writer.close()


async def test_a_session_purged_and_made_again_under_its_id_is_never_answered_from_the_erased_log(
    fresh_server: EmbeddedServer,
) -> None:
    """The admin's purge notice makes the gateway forget the session at once; the log made again under its id is
    read from the stream (a notice missed is the next test's case: the new log's hints do not continue the state)."""
    opened = await SessionLog.connect(log_settings(fresh_server.url, allow_purge=True))
    source = StreamSource(opened, wait_s=WAIT_S)
    session_id = new_session_id("tail")
    try:
        writer = await opened.create(session_id)
        await user_turn(writer, "one")
        seq = await user_turn(writer, "two")
        await writer.close()
        await source.derive(session_id, seq)
        await settled(source, session_id, seq)
        tails_ = source.tails
        assert tails_ is not None and tails_.watching(session_id)
        await opened.purge(session_id)
        await until(lambda: not tails_.watching(session_id), "the purge notice reaches the gateway")
        again = await opened.create(session_id)
        try:
            first = await user_turn(again, "made again")
            derived, how = await made(source, session_id, first)
            assert how == "read" and same(derived, again)
        finally:
            await again.close()
    finally:
        await source.close()
        await bounded(opened.close())


async def test_a_hint_that_does_not_continue_the_state_makes_the_gateway_read(
    log: SessionLog, source: StreamSource
) -> None:
    """A record announcing seqs the gateway already holds (a session made again after a purge whose notice was
    missed, a writer's retry) is no proof that nothing changed: the next request reads."""
    writer = await log.create(new_session_id("tail"))
    try:
        seq = await watched(source, writer)
        headers = {H_FORMAT: FORMAT, H_FIRST_SEQ: "0", H_COUNT: "1", H_EXPECTED_LAST_SUBJECT_SEQ: "1"}
        with pytest.raises(nats.js.errors.APIError):
            await log.js.publish(in_subject(writer.session_id), b'[{"type":"turn/start","data":{"turn":1}}]',
                                 headers=headers)  # fmt: skip
        tails_ = source.tails
        assert tails_ is not None
        await until(lambda: tails_.announced(writer.session_id) >= seq, "the hint arrives")
        derived, how = await made(source, writer.session_id, seq)
        assert how == "read" and same(derived, writer)
    finally:
        await writer.close()


async def test_a_session_in_use_keeps_its_watch_confirmed_without_reads_on_the_requests_path(
    log: SessionLog, source: StreamSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answered from its watch past half the confirmation's life, a session is read again in the background: a
    session asked for more often than that never pays a read on a request's path because its confirmation aged."""
    clock = frozen_clock(monkeypatch)
    writer = await log.create(new_session_id("tail"))
    try:
        seq = await watched(source, writer)
        ways = []
        for _ in range(12):  # four times the confirmation's life, a request every third of it
            _, how = await made(source, writer.session_id, seq)
            ways.append(how)
            # The read in the background that a request past half the life started is over before the next
            # request: what is tested is that it was started, not how fast this machine reads.
            await settled(source, writer.session_id, seq)
            clock.advance(tails.CONFIRMED_FOR_S / 3)
        assert ways == ["watched"] * 12
    finally:
        await writer.close()
