"""The JetStream writer and reader (log.py, reader.py) against real nats-server processes.

What a writer promises: a refused event never reaches the stream; `flush()` returns only when JetStream has
acknowledged everything queued; records are contiguous, bounded in size and self-describing; two writers can
never interleave (lease first, optimistic concurrency underneath); a retried publish never doubles a record; and
nothing is reported durable that was not acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from natsfixtures import log_settings, new_session_id
from scaffold import LEASE_TTL_S, WAIT_S, Opened, assert_contiguous, eventually, freeze, outlived_its_ttl, raws
from sessiongen import assistant_message_data, closed_turn, tool_result_data, user_message_data

from sessionlog.embedded import EmbeddedServer
from sessionlog.errors import LogUnavailable, SessionLogError
from sessionlog.events import encode_new_event
from sessionlog.jsonl import decode_header
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.provision import stored_subject
from sessionlog.reader import StreamReader
from sessionlog.record import H_COUNT, H_DIGEST, H_FIRST_SEQ, H_FORMAT, H_WRITER, events_filter

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


# ---------------------------------------------------------------------------------------------- helpers


class Logs(Opened):
    """The connections and writers one test opened; at its end every writer is stopped and every connection
    closed, whether or not its server still runs."""

    def __init__(self) -> None:
        super().__init__(lease_ttl_s=LEASE_TTL_S)


@pytest_asyncio.fixture(loop_scope="module")
async def logs() -> AsyncIterator[Logs]:
    async with Logs() as opened:
        yield opened


async def tool_step(writer: SessionWriter, call_id: str) -> dict[str, int]:
    """In the open turn: a step whose assistant message calls one tool, the call, its result. Returns seqs."""
    turn = writer.session.open_turn
    assert turn is not None
    step = writer.session.last_step + 1
    seqs = {"step": (await writer.emit("step/start", {"turn": turn, "step": step})).seq}
    call = {"type": "tool-call", "id": call_id, "name": "read", "arguments": "{}"}
    seqs["message"] = (
        await writer.emit(
            "assistant/message",
            assistant_message_data(turn, step, [call], f"a-{call_id}"),
            surface_op="append",
            source_event_seqs=[],
        )
    ).seq
    call_data = {"turn": turn, "step": step, "callId": call_id, "name": "read", "arguments": "{}"}
    seqs["call"] = (await writer.emit("tool/call", call_data)).seq
    seqs["result"] = (
        await writer.emit(
            "tool/result",
            tool_result_data(turn, step, call_id, f"contents of {call_id}", msg_id=f"r-{call_id}"),
            surface_op="append",
            source_event_seqs=[seqs["call"]],
        )
    ).seq
    await writer.emit("step/end", {"turn": turn, "step": step})
    return seqs


# ---------------------------------------------------------------------------------------------- writing


async def test_flush_returns_the_last_seq_and_load_gives_back_the_same_bytes_in_order(logs: Logs, url: str) -> None:
    log = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid, cwd="/work")
    assert writer.durable_seq == -1
    assert await writer.flush() == -1  # nothing queued: nothing to wait for

    written = await closed_turn(writer) + await closed_turn(writer, "Again.")
    assert await writer.flush() == len(written) - 1 == writer.durable_seq

    header, session, last = await log.load(sid)
    assert [e.raw for e in session] == raws(written)
    assert [e.seq for e in session] == list(range(len(written)))
    assert decode_header(header).id == sid and decode_header(header).cwd == "/work"
    assert last is not None and last.next_seq == len(written) and last.stream_seq == writer.last_stream_seq
    assert await log.reader.events(sid) == raws(written)

    more = await closed_turn(writer, "Third.")
    await writer.close()
    assert await log.reader.events(sid) == raws(written + more), "close() flushes what is queued"


@pytest.mark.parametrize(
    ("code", "event"),
    [
        ("STRUCTURE_INVALID", {"type": "step/start", "data": {"turn": 2, "step": 1}}),
        ("SEQ_NOT_CONTIGUOUS", {"seq": 99, "type": "todo/write", "data": {"todos": []}}),
        ("UNKNOWN_EVENT_TYPE", {"type": "vendor/secret-state", "data": {}}),
        ("SURFACE_MARKER_REQUIRED", {"type": "user/message", "data": user_message_data("x", "m")}),
        ("SURFACE_MARKER_FORBIDDEN", {"type": "todo/write", "data": {"todos": []}, "surfaceOp": "append"}),
        ("INVALID_SURFACE_OP", {"type": "user/message", "data": user_message_data("x", "m"), "surfaceOp": "prepend"}),
        ("INVALID_EVENT", {"type": "todo/write", "data": {"todos": []}, "extra": 1}),
        ("INVALID_EVENT", {"type": "turn/end", "data": {"turn": "one"}}),
    ],
)
async def test_a_refused_event_raises_its_code_and_never_reaches_the_stream(
    logs: Logs, url: str, code: str, event: dict[str, Any]
) -> None:
    log = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    good = [await writer.emit("turn/start", {"turn": 1})]
    raw = msgspec.json.encode({"seq": writer.next_seq, "time": 1, **event})

    with pytest.raises(SessionLogError) as refused:
        await writer.append(raw)
    assert refused.value.code == code
    assert writer.next_seq == len(good), "a refused append queues nothing"

    good.append(await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}}))
    assert await writer.flush() == 1
    assert await log.reader.events(sid) == raws(good), "the stream holds exactly the accepted events"


async def test_a_bad_session_id_is_refused_before_anything_is_written(logs: Logs, url: str) -> None:
    log = await logs.connect(url)
    for bad in ("", "a.b", "a b", "a*", ">", "sessions.>", "x" * 129, "ünï", "a/b"):
        with pytest.raises(SessionLogError) as refused:
            await log.create(bad)
        assert refused.value.code == "INVALID_SESSION_ID", bad
    longest = "x" * 120 + new_session_id()[-8:]
    writer = await logs.create(log, longest)
    assert (await log.header(longest)) is not None, "128 characters is still a valid id"
    await writer.close()


async def test_a_second_create_of_the_same_id_is_refused_and_the_first_session_is_untouched(
    logs: Logs, url: str
) -> None:
    log = await logs.connect(url)
    other = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = await closed_turn(writer)
    await writer.flush()
    header = await log.header(sid)

    for who in (log, other):
        with pytest.raises(SessionLogError) as refused:
            await who.create(sid)
        assert refused.value.code == "SESSION_ALREADY_EXISTS"
    await writer.close()
    with pytest.raises(SessionLogError) as refused:
        await other.create(sid)  # no live writer any more: the id is still taken
    assert refused.value.code == "SESSION_ALREADY_EXISTS"
    assert await log.header(sid) == header
    assert await log.reader.events(sid) == raws(written)


async def test_a_negative_write_window_is_refused_and_the_window_kept(logs: Logs, url: str) -> None:
    """`SessionWriter.window_ms` (record mode batches an answer's chunks with it) takes no negative window."""
    log = await logs.connect(url)
    writer = await logs.create(log, new_session_id())
    default = writer.window_ms
    with pytest.raises(ValueError, match="not negative"):
        writer.window_ms = -1.0
    assert writer.window_ms == default
    writer.window_ms = 20.0
    assert writer.window_ms == 20.0
    await closed_turn(writer)
    assert await writer.flush() == writer.durable_seq == 5


async def test_an_event_bigger_than_a_record_is_refused_and_nothing_is_queued(logs: Logs, url: str) -> None:
    log = await logs.connect(url, write_max_bytes=4096)
    bound = log.max_record_bytes
    assert bound < 4096
    sid = new_session_id()
    writer = await logs.create(log, sid)
    good = [await writer.emit("turn/start", {"turn": 1})]

    def sized(total: int) -> bytes:
        """A user/message event of exactly `total` bytes."""
        filler = encode_new_event(
            "user/message", user_message_data("", "m"), seq=writer.next_seq, time=1, surface_op="append"
        )
        return encode_new_event(
            "user/message",
            user_message_data("x" * (total - len(filler)), "m"),
            seq=writer.next_seq,
            time=1,
            surface_op="append",
        )

    too_big = sized(bound)  # its record would be `bound` + 2 bytes of framing
    assert len(too_big) == bound
    with pytest.raises(SessionLogError) as refused:
        await writer.append(too_big)
    assert refused.value.code == "EVENT_TOO_LARGE"
    assert refused.value.seq == 1
    assert writer.next_seq == 1

    fits = sized(bound - 100)
    good.append(await writer.append(fits))
    assert await writer.flush() == 1
    records = await log.reader.records(sid)
    assert [e for r in records for e in r.events] == raws(good)
    assert all(r.payload_size <= bound for r in records)


async def test_the_largest_event_a_record_can_carry_is_accepted(logs: Logs, url: str) -> None:
    log = await logs.connect(url, write_max_bytes=4096)
    bound = log.max_record_bytes
    writer = await logs.create(log)
    await writer.emit("turn/start", {"turn": 1})
    filler = encode_new_event("user/message", user_message_data("", "m"), seq=1, time=1, surface_op="append")
    text = "x" * (bound - 2 - len(filler))
    largest = encode_new_event("user/message", user_message_data(text, "m"), seq=1, time=1, surface_op="append")
    assert len(b"[" + largest + b"]") == bound
    await writer.append(largest)
    assert await writer.flush() == 1
    assert max(r.payload_size for r in await log.reader.records(writer.session_id)) == bound


async def test_a_batch_past_the_size_bound_is_split_into_records_that_each_stay_under_it(logs: Logs, url: str) -> None:
    log = await logs.connect(url, write_max_bytes=4096, write_window_ms=50)
    bound = log.max_record_bytes
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = [await writer.emit("turn/start", {"turn": 1})]
    for i in range(120):
        written.append(
            await writer.emit("todo/write", {"todos": [{"content": f"item {i} " + "y" * 60, "status": "x"}]})
        )
    written.append(await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}}))
    total = sum(len(e.raw) for e in written)
    assert await writer.flush() == len(written) - 1

    records = await log.reader.records(sid)
    assert len(records) >= total // bound + 1 > 1
    assert all(r.payload_size <= bound for r in records)
    assert [e for r in records for e in r.events] == raws(written)
    assert_contiguous(records)

    stored, _ = await log.reader.direct_batch(events_filter(sid), 1)
    assert len(stored) == len(records)
    for message, record in zip(stored, records, strict=True):
        assert message.headers[H_FORMAT] == "1"
        assert int(message.headers[H_FIRST_SEQ]) == record.first_seq
        assert int(message.headers[H_COUNT]) == record.count == len(msgspec.json.decode(message.data))
        assert message.headers[H_DIGEST] == hashlib.sha256(message.data).hexdigest()
        assert int(message.headers[H_WRITER]) == writer.epoch
    await writer.close()


async def test_a_record_never_carries_more_than_write_max_events(logs: Logs, url: str) -> None:
    log = await logs.connect(url, write_max_events=7, write_window_ms=50)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = [await writer.emit("turn/start", {"turn": 1})]
    written += [await writer.emit("todo/write", {"todos": []}) for _ in range(40)]
    await writer.flush()
    records = await log.reader.records(sid)
    assert [r.count for r in records] == [7] * 5 + [6]
    assert [e for r in records for e in r.events] == raws(written)
    await writer.close()


async def test_write_behind_publishes_without_a_flush_and_batches_many_events_per_record(logs: Logs, url: str) -> None:
    log = await logs.connect(url, write_window_ms=20)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = [await writer.emit("turn/start", {"turn": 1})]
    written += [await writer.emit("todo/write", {"todos": [{"content": str(i), "status": "x"}]}) for i in range(99)]

    async def all_durable() -> bool:
        return writer.durable_seq == 99

    await eventually(all_durable, "the write-behind window publishing 100 queued events without a flush")
    records = await log.reader.records(sid)
    assert [e for r in records for e in r.events] == raws(written)
    assert len(records) < len(written) / 10, f"{len(records)} records for 100 events: the window did not batch"
    await writer.close()


# ---------------------------------------------------------------------------------------------- one writer


async def test_a_second_writer_on_a_live_session_gets_lease_held(logs: Logs, url: str) -> None:
    # A 3 s lease refreshed 4 times a second: a refresh that comes late on a busy machine does not lose it.
    log = await logs.connect(url, lease_ttl_s=3.0, lease_refresh_s=0.25)
    elsewhere = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    await closed_turn(writer)
    await writer.flush()

    for attempt in (elsewhere.open, elsewhere.resume, log.open):
        with pytest.raises(SessionLogError) as refused:
            await attempt(sid)
        assert refused.value.code == "LEASE_HELD"
    await outlived_its_ttl(writer)  # the holder refreshes: its lease outlives its TTL
    with pytest.raises(SessionLogError) as refused:
        await elsewhere.open(sid)
    assert refused.value.code == "LEASE_HELD"

    await writer.close()  # releasing the lease frees the session at once
    second = logs.keep(await elsewhere.open(sid))
    more = await closed_turn(second)
    await second.flush()
    assert (await log.reader.events(sid))[-len(more) :] == raws(more)
    assert second.epoch > writer.epoch


async def test_two_publishers_expecting_the_same_last_record_cannot_both_append(logs: Logs, url: str) -> None:
    log = await logs.connect(url)
    sid = new_session_id()
    mine = [encode_new_event("turn/start", {"turn": 1}, seq=0, time=1)]
    theirs = [encode_new_event("turn/start", {"turn": 1}, seq=0, time=2)]

    stream_seq = await log.store.publish(sid, mine, 0, 0, 1, epoch=101)
    with pytest.raises(SessionLogError) as refused:
        await log.store.publish(sid, theirs, 0, 0, 1, epoch=102)
    assert refused.value.code == "CONFLICT"
    with pytest.raises(SessionLogError) as refused:
        # the same bytes under another epoch are not a duplicate either
        await log.store.publish(sid, mine, 0, 0, 1, epoch=102)
    assert refused.value.code == "CONFLICT"
    assert await log.reader.events(sid) == mine

    follow = [encode_new_event("turn/end", {"turn": 1, "reason": {"kind": "completed"}}, seq=1, time=3)]
    # expecting the right record: accepted
    assert await log.store.publish(sid, follow, 1, stream_seq, 0, epoch=102) > stream_seq
    assert await log.reader.events(sid) == mine + follow


async def test_a_writer_whose_lease_was_taken_over_gets_lease_lost_and_never_interleaves(logs: Logs, url: str) -> None:
    log = await logs.connect(url)
    elsewhere = await logs.connect(url)
    sid = new_session_id()
    stale = await logs.create(log, sid)
    await closed_turn(stale)
    await stale.flush()

    # The process stalls (a long GC pause, a suspended VM): its lease keeper stops refreshing and the lease expires.
    await stale.lease.stop()

    async def lease_free() -> bool:
        return await log.leases.current(sid) is None

    await eventually(lease_free, "the stalled writer's lease expiring")
    successor = logs.keep(await elsewhere.open(sid))
    await closed_turn(successor, "I took over.")
    await successor.flush()

    # The stalled process wakes up and carries on as if nothing happened.
    await closed_turn(stale, "Still here?")
    with pytest.raises(SessionLogError) as refused:
        await stale.flush()
    assert refused.value.code == "LEASE_LOST", "losing the lease is not a competing writer (CONFLICT)"
    assert "taken over" in refused.value.message
    with pytest.raises(SessionLogError):
        await stale.emit("turn/start", {"turn": 99})  # fenced for good

    assert await log.reader.events(sid) == [e.raw for e in successor.session]
    assert_contiguous(await log.reader.records(sid))


async def test_open_fences_the_previous_tenure_so_the_server_refuses_its_next_publish(logs: Logs, url: str) -> None:
    # What a paused writer does when it wakes, below every client-side check: publish the next record after the
    # last one it knows, under its own epoch. Once another process has opened the session, JetStream refuses it.
    log = await logs.connect(url)
    elsewhere = await logs.connect(url)
    sid = new_session_id()
    stale = await logs.create(log, sid)
    written = await closed_turn(stale)
    await stale.flush()
    known_last, epoch = stale.last_stream_seq, stale.epoch
    await stale.abandon()  # its lease expires; the process is "paused", not gone

    async def lease_free() -> bool:
        return await log.leases.current(sid) is None

    await eventually(lease_free, "the paused writer's lease expiring")
    successor = logs.keep(await elsewhere.open(sid))

    late = [encode_new_event("turn/start", {"turn": 2}, seq=len(written), time=5)]
    with pytest.raises(SessionLogError) as refused:
        await log.store.publish(sid, late, len(written), known_last, 2, epoch=epoch)
    assert refused.value.code == "CONFLICT"
    assert await log.reader.events(sid) == raws(written), "the stale tenure's record never landed"

    more = await closed_turn(successor, "The new holder writes.")
    assert await successor.flush() == len(written) + len(more) - 1, "and the new holder is not refused"
    assert await log.reader.events(sid) == raws(written + more)
    records = await log.reader.records(sid)
    assert_contiguous(records)
    fences = [r for r in records if not r.events]
    assert [r.epoch for r in fences] == [successor.epoch], "one empty record marks the new tenure"


WRITER_PROCESS = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from sessiongen import closed_turn
from sessionlog.errors import SessionLogError
from sessionlog.log import SessionLog

async def main():
    log = await SessionLog.connect()
    writer = await log.create({sid!r})
    await closed_turn(writer)
    await writer.flush()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        await loop.run_in_executor(None, sys.stdin.readline)
        try:
            await closed_turn(writer, "After the pause.")
            await writer.flush()
            print("written", flush=True)
        except SessionLogError as err:
            print("refused", err.code, err.message, flush=True)

asyncio.run(main())
"""


async def test_a_writer_process_paused_past_its_ttl_is_refused_and_the_process_that_opened_the_session_is_not(
    logs: Logs, url: str, tmp_path: Path
) -> None:
    log = await logs.connect(url)
    sid = new_session_id("paused")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(SESSIONLOG_NATS_URL=url, SESSIONLOG_LEASE_TTL_S=str(LEASE_TTL_S))
    script = WRITER_PROCESS.format(tests=str(Path(__file__).parent), sid=sid)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.strip() == b"ready", proc.stderr.read() if proc.stderr else b""
        before = await log.reader.events(sid)
        await freeze(proc.pid)
        try:

            async def lease_free() -> bool:
                return await log.leases.current(sid) is None

            await eventually(lease_free, "the paused writer's lease expiring")
            successor = logs.keep(await log.open(sid))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        proc.stdin.write(b"write\n")
        proc.stdin.flush()
        answer = (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT_S)).decode()
        assert answer.split()[:2] == ["refused", "LEASE_LOST"], answer

        more = await closed_turn(successor, "The new holder writes.")
        assert await successor.flush() == len(before) + len(more) - 1
        assert await log.reader.events(sid) == before + raws(more), "nothing of the paused writer after the pause"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def block_until_lease_expired(url: str, session_id: str) -> None:
    """Block the calling thread (and so its event loop) until the session's lease is gone on the server, as seen
    by a connection of another thread."""

    async def expired() -> None:
        log = await SessionLog.connect(log_settings(url), provision_stores=False)
        try:
            deadline = time.monotonic() + WAIT_S
            while await log.leases.current(session_id) is not None:
                assert time.monotonic() < deadline, "the lease did not expire"
                await asyncio.sleep(0.05)
        finally:
            await log.close()

    failures: list[BaseException] = []
    thread = threading.Thread(target=lambda: failures.extend(_raised(lambda: asyncio.run(expired()))))
    thread.start()
    thread.join(WAIT_S * 2)
    assert not thread.is_alive() and not failures, failures


def _raised(step: Callable[[], object]) -> list[BaseException]:
    try:
        step()
    except BaseException as err:
        return [err]
    return []


async def test_a_writer_whose_loop_was_blocked_past_its_ttl_gets_lease_lost_naming_why_and_writes_nothing(
    logs: Logs, url: str
) -> None:
    log = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = await closed_turn(writer)
    await writer.flush()

    # A synchronous model call blocks the event loop (nothing refreshes the lease) until the server has expired it.
    block_until_lease_expired(url, sid)
    await closed_turn(writer, "After the blocking call.")
    with pytest.raises(SessionLogError) as refused:
        await writer.flush()
    assert refused.value.code == "LEASE_LOST"
    assert "not refreshed for" in refused.value.message and "blocked" in refused.value.message
    assert await log.reader.events(sid) == raws(written), "nothing was written without the lease"
    await writer.abandon()


# ---------------------------------------------------------------------------------------------- failures


async def test_a_publish_retried_after_a_forced_timeout_lands_exactly_once(
    fresh_server: EmbeddedServer, logs: Logs
) -> None:
    # request timeout 3 s: each publish attempt waits 1 s, the whole publish 3 s. The lease (10 s) outlives the stop.
    log = await logs.connect(fresh_server.url, request_timeout_s=3.0, lease_ttl_s=10.0)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = await closed_turn(writer)
    await writer.flush()
    pid = fresh_server.pid
    assert pid is not None

    await freeze(pid)
    try:
        written += await closed_turn(writer, "While the server is frozen.")
        flushing = asyncio.create_task(writer.flush())
        await asyncio.sleep(1.6)  # past the first attempt's timeout: the writer has sent a retry
        assert not flushing.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await asyncio.wait_for(flushing, WAIT_S) == len(written) - 1

    records = await log.reader.records(sid)
    assert_contiguous(records)
    assert len({r.first_seq for r in records}) == len(records) == 2
    assert [e for r in records for e in r.events] == raws(written)
    more = await closed_turn(writer, "After.")
    await writer.flush()
    assert await log.reader.events(sid) == raws(written + more)


async def test_a_flush_cancelled_while_its_record_is_in_flight_lands_it_exactly_once_and_is_not_a_conflict(
    fresh_server: EmbeddedServer, logs: Logs
) -> None:
    # A flush publishes from its caller's task when nothing else is publishing; cancelling that caller after the
    # record was sent leaves it in doubt. The server (frozen) stores it late; the retry must settle by digest.
    log = await logs.connect(fresh_server.url, request_timeout_s=3.0, lease_ttl_s=10.0)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = await closed_turn(writer)
    await writer.flush()
    pid = fresh_server.pid
    assert pid is not None

    await freeze(pid)
    try:
        written += await closed_turn(writer, "In flight when the flush is cancelled.")
        flushing = asyncio.create_task(writer.flush())
        await asyncio.sleep(0.2)  # the record is on the wire; no ack can come
        assert not flushing.done()
        flushing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flushing
    finally:
        os.kill(pid, signal.SIGCONT)

    assert await asyncio.wait_for(writer.flush(), WAIT_S) == len(written) - 1
    records = await log.reader.records(sid)
    assert_contiguous(records)
    assert [e for r in records for e in r.events] == raws(written)
    more = await closed_turn(writer, "After.")
    await writer.flush()
    assert await log.reader.events(sid) == raws(written + more)


async def test_a_cancelled_flush_then_another_emit_settles_the_in_doubt_batch_as_it_was_sent(
    fresh_server: EmbeddedServer, logs: Logs
) -> None:
    # The cancelled flush's record reaches the (frozen) server; events emitted after the cancel must not join it:
    # the same message id with a larger batch would be a "duplicate" of different bytes, a false CONFLICT.
    log = await logs.connect(fresh_server.url, request_timeout_s=3.0, lease_ttl_s=10.0)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = await closed_turn(writer)
    await writer.flush()
    pid = fresh_server.pid
    assert pid is not None

    await freeze(pid)
    try:
        written += await closed_turn(writer, "In flight when the flush is cancelled.")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.2):  # the record is on the wire; no ack can come
                await writer.flush()
        # The caller goes on at once, in its own task: nothing else has run since the cancel.
        written += await closed_turn(writer, "Emitted after the cancel.")
    finally:
        os.kill(pid, signal.SIGCONT)

    assert await asyncio.wait_for(writer.flush(), WAIT_S) == len(written) - 1
    records = await log.reader.records(sid)
    assert_contiguous(records)
    assert [e for r in records for e in r.events] == raws(written)


async def test_a_lease_refresh_that_timed_out_but_landed_does_not_fence_the_writer(
    fresh_server: EmbeddedServer, logs: Logs
) -> None:
    # Refreshes every 1 s, each waiting at most 0.5 s for its ack; the lease lives 4 s past the last refresh.
    log = await logs.connect(fresh_server.url, request_timeout_s=0.5, lease_ttl_s=4.0, lease_refresh_s=1.0)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = [await writer.emit("turn/start", {"turn": 1})]
    await writer.flush()
    pid = fresh_server.pid
    assert pid is not None

    # Frozen for 1.8 s (a refresh interval plus a refresh timeout, and then some): at least one refresh is sent,
    # times out on the client, and lands when the server wakes. The lease itself never comes near expiring.
    await freeze(pid)
    try:
        await asyncio.sleep(1.8)
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.sleep(2.5)  # two more refresh rounds

    current = await log.leases.current(sid)
    assert current is not None and current.epoch == writer.epoch, "the lease is still this writer's"
    written.append(await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}}))
    assert await writer.flush() == 1
    assert await log.reader.events(sid) == raws(written)


async def test_flushed_events_survive_a_server_restart_and_the_writer_carries_on(
    fresh_server: EmbeddedServer, logs: Logs
) -> None:
    log = await logs.connect(fresh_server.url, lease_ttl_s=10.0)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    written = await closed_turn(writer)
    await writer.flush()

    await asyncio.to_thread(fresh_server.restart)  # clean stop, same port and data folder

    async def reconnected() -> bool:
        return log.nc.is_connected

    await eventually(reconnected, "the writer's connection reconnecting")
    reader = await logs.connect(fresh_server.url)
    _, session, _ = await reader.load(sid)
    assert [e.raw for e in session] == raws(written)

    written += await closed_turn(writer, "After the restart.")
    assert await asyncio.wait_for(writer.flush(), WAIT_S) == len(written) - 1
    assert await reader.reader.events(sid) == raws(written)
    assert_contiguous(await reader.reader.records(sid))
    await writer.close()


async def test_a_flush_with_the_server_gone_is_log_unavailable_and_reports_nothing_durable(
    fresh_server: EmbeddedServer, logs: Logs
) -> None:
    timeout = 2.0
    log = await logs.connect(fresh_server.url, request_timeout_s=timeout, publish_retry_s=timeout, lease_ttl_s=10.0)
    writer = await logs.create(log)
    written = await closed_turn(writer)
    durable = await writer.flush()

    await asyncio.to_thread(fresh_server.kill)
    await closed_turn(writer, "Nobody hears this.")
    with pytest.raises(LogUnavailable) as refused:
        await asyncio.wait_for(writer.flush(), timeout + WAIT_S)  # the bound proves it is refused, not a hang
    assert refused.value.code == "LOG_UNAVAILABLE"
    assert writer.durable_seq == durable == len(written) - 1
    with pytest.raises(LogUnavailable):
        await writer.flush()  # the writer stays fenced: a later flush does not pretend
    assert writer.durable_seq == durable


async def test_big_records_of_several_writers_with_the_server_gone_are_log_unavailable_not_a_hang(
    fresh_server: EmbeddedServer, logs: Logs
) -> None:
    timeout = 2.0
    log = await logs.connect(fresh_server.url, request_timeout_s=timeout, publish_retry_s=timeout, lease_ttl_s=10.0)
    writers = [await logs.create(log) for _ in range(3)]
    for writer in writers:
        await writer.emit("turn/start", {"turn": 1})
        await writer.flush()

    await asyncio.to_thread(fresh_server.kill)
    text = "x" * (log.max_record_bytes - 400)  # one near-maximal record per writer, all on one connection
    for writer in writers:
        await writer.emit("user/message", user_message_data(text, "big"), surface_op="append")
    outcomes = await asyncio.gather(
        *(asyncio.wait_for(w.flush(), timeout + 3.0) for w in writers), return_exceptions=True
    )
    assert [type(o) for o in outcomes] == [LogUnavailable] * 3, outcomes
    assert [w.durable_seq for w in writers] == [0, 0, 0]


# ---------------------------------------------------------------------------------------------- compaction


async def test_compact_writes_a_replace_whose_provenance_names_every_shadowed_node(logs: Logs, url: str) -> None:
    log = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    await closed_turn(writer, "First.")
    await writer.emit("turn/start", {"turn": 2})
    await writer.emit("user/message", user_message_data("Read a file.", "u2"), surface_op="append")
    pair = await tool_step(writer, "call-1")
    nodes = list(writer.session.surface.nodes)
    start, end = nodes[0], pair["result"]
    shadowed = nodes[: nodes.index(end) + 1]

    summary = await writer.compact(start, end, "Summary: the user said hello and a file was read.", message_id="s1")
    await writer.flush()

    stored = msgspec.json.decode((await log.reader.events(sid))[summary.seq])
    assert stored["type"] == "user/message"
    assert stored["surfaceOp"] == {"op": "replace", "start": start, "end": end}
    assert stored["sourceEventSeqs"] == shadowed
    assert stored["data"]["id"] == "s1" and stored["data"]["source"] == {"kind": "plugin", "plugin": "compact"}
    _, session, _ = await log.load(sid)
    assert session.surface.nodes[0] == summary.seq
    assert [m.seq for m in session.derive_messages()] == [m.seq for m in writer.session.derive_messages()]
    assert session.generation == 1
    await writer.close()


async def test_a_compaction_that_would_split_a_tool_pair_is_refused_before_anything_is_sent(
    logs: Logs, url: str
) -> None:
    log = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("user/message", user_message_data("Read a file.", "u1"), surface_op="append")
    pair = await tool_step(writer, "call-1")
    durable = await writer.flush()
    before = await log.reader.events(sid)

    nodes = list(writer.session.surface.nodes)
    with pytest.raises(SessionLogError) as refused:
        await writer.compact(nodes[0], pair["message"], "Summary that would orphan the result.")
    assert refused.value.code == "REPLACE_SPLITS_TOOL_PAIR"
    assert writer.next_seq == durable + 1 and writer.session.generation == 0
    assert await writer.flush() == durable
    assert await log.reader.events(sid) == before

    await writer.compact(nodes[0], pair["result"], "Summary keeping the pair together.")
    assert await writer.flush() == durable + 1
    await writer.close()


# ---------------------------------------------------------------------------------------------- reading


async def test_record_of_finds_the_record_holding_each_seq_among_other_sessions_records(logs: Logs, url: str) -> None:
    log = await logs.connect(url, write_max_events=4)
    sid, noise = new_session_id(), new_session_id()
    writer, other = await logs.create(log, sid), await logs.create(log, noise)
    for _ in range(4):  # interleave the two sessions' records in the stream
        await closed_turn(writer)
        await writer.flush()
        await closed_turn(other)
        await other.flush()
    events = await log.reader.events(sid)
    records = await log.reader.records(sid)
    assert len(records) >= 6

    for seq in range(len(events)):
        record = await log.reader.record_of(sid, seq)
        assert record is not None, seq
        assert record.first_seq <= seq < record.next_seq
        assert record.events[seq - record.first_seq] == events[seq]
        assert record.stream_seq in {r.stream_seq for r in records}
    for outside in (len(events), len(events) + 10, -1):
        assert await log.reader.record_of(sid, outside) is None
    assert await log.reader.record_of(new_session_id(), 0) is None


async def test_a_verified_log_reads_a_session_by_its_stored_subject_and_finds_what_the_wildcard_finds(
    logs: Logs, url: str
) -> None:
    """Once connecting verified the stream (its partition count is the settings'), one session is read by its
    literal stored subject: the server finds a literal subject's next record without matching a wildcard against
    every other session's record in between. A reader that knows no partition count reads by the wildcard."""
    log = await logs.connect(url, write_max_events=4)
    sid, noise = new_session_id(), new_session_id()
    writer, other = await logs.create(log, sid), await logs.create(log, noise)
    for _ in range(3):
        await closed_turn(writer)
        await writer.flush()
        await closed_turn(other)
        await other.flush()
    assert log.reader.session_subject(sid) == stored_subject(sid, log.settings.partition_count)
    unverified = StreamReader(log.nc, log.settings.stream)
    assert unverified.session_subject(sid) == events_filter(sid)
    unprovisioned = await SessionLog.connect(logs.settings(url), provision_stores=False)
    try:  # a connection that verified nothing keeps the wildcard, right whatever the partition count
        assert unprovisioned.reader.session_subject(sid) == events_filter(sid)
        assert [r.stream_seq for r in await unprovisioned.reader.records(sid)] == [
            r.stream_seq for r in await log.reader.records(sid)
        ]
    finally:
        await unprovisioned.close()

    by_stored, by_wildcard = await log.reader.records(sid), await unverified.records(sid)
    assert len(by_stored) >= 4
    assert [(r.stream_seq, r.events) for r in by_stored] == [(r.stream_seq, r.events) for r in by_wildcard]
    assert {r.subject for r in by_stored} == {stored_subject(sid, log.settings.partition_count)}
    last = await log.reader.last_record(sid)
    assert last is not None and last.stream_seq == by_stored[-1].stream_seq
    assert await log.reader.records(new_session_id()) == []


async def test_subscribe_from_a_stream_sequence_replays_then_follows_live(logs: Logs, url: str) -> None:
    log = await logs.connect(url)
    sid = new_session_id()
    writer = await logs.create(log, sid)
    for _ in range(3):
        await closed_turn(writer)
        await writer.flush()
    records = await log.reader.records(sid)
    assert len(records) == 3

    feed = log.reader.subscribe(session_id=sid, from_stream_seq=records[1].stream_seq)
    try:
        replayed = [await asyncio.wait_for(anext(feed), WAIT_S) for _ in range(2)]
        assert [(r.stream_seq, r.events) for r in replayed] == [(r.stream_seq, r.events) for r in records[1:]]

        live = await closed_turn(writer, "Live.")
        await writer.flush()
        record = await asyncio.wait_for(anext(feed), WAIT_S)
        assert record.events == tuple(raws(live)) and record.first_seq == records[-1].next_seq
        assert record.session_id == sid
    finally:
        await feed.aclose()
    await writer.close()


async def test_sessions_lists_each_session_with_its_events_open_turn_and_parent(logs: Logs, url: str) -> None:
    log = await logs.connect(url)
    closed_id, open_id, child_id, empty_id = (new_session_id() for _ in range(4))
    closed = await logs.create(log, closed_id, created_at=1_700_000_000_000)
    written = await closed_turn(closed)
    await closed.close()
    opened = await logs.create(log, open_id, created_at=1_700_000_000_001)
    await closed_turn(opened)
    await opened.emit("turn/start", {"turn": 2})
    await opened.flush()
    empty = await logs.create(log, empty_id, created_at=1_700_000_000_002)
    await log.fork(closed_id, child_id)

    infos = {info.id: info for info in await log.sessions()}
    assert infos[closed_id].events == len(written) and infos[closed_id].open_turn is None
    assert infos[closed_id].parent is None and infos[closed_id].created_at == 1_700_000_000_000
    assert infos[open_id].events == 7 and infos[open_id].open_turn == 2
    assert infos[child_id].events == len(written) + 1 and infos[child_id].parent == closed_id
    assert infos[empty_id].events == 0 and infos[empty_id].open_turn is None
    listed = [i.id for i in await log.sessions()]
    assert listed.index(child_id) < listed.index(empty_id) < listed.index(open_id) < listed.index(closed_id)
    await opened.close()
    await empty.close()
