"""The context-deriver service (`sessionlog-context`: derive, plan_replace, stats) against real nats-server
processes and real service instances, in-process and as `sessionlog serve context-deriver` subprocesses.

What it promises: `derive` with `min_seq` right after a flush reflects that flush (a writer reads its own writes);
`at_seq` gives the prefix; a reply that would pass max_payload is paged and the pages add up to the derivation
whose `sha256` every page carries; a replica that does not own the session's partition answers the same from the
stream; a bad request gets a typed error and the service keeps serving; a deriver killed with SIGKILL mid-stream
and restarted resumes after its checkpoint and answers exactly what a clean rebuild answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from msgspec.json import encode
from natsfixtures import new_session_id
from scaffold import LEASE_TTL_S, WAIT_S, Opened, ServiceProcess, eventually
from sessiongen import compact_all, streamed_turn, user_message_data
from test_runner import ALL, CheckedDeriver, CheckedState, ids_in_partition, last_stream_seq, snapshot

from services.context_deriver.service import ContextDeriverService
from sessionlog.contracts import DeriveRequest
from sessionlog.embedded import EmbeddedServer
from sessionlog.errors import SessionLogError
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.micro import ERROR_CODE_HEADER, call
from sessionlog.record import partition_filter
from sessionlog.runner import ProjectionRunner
from sessionlog.session import Session

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

DERIVE = "sessionlog.context.derive"
PLAN = "sessionlog.context.plan_replace"
STATS = "sessionlog.context.stats"
PARTITIONS = 8


# ---------------------------------------------------------------------------------------------- helpers


class Stack(Opened):
    """The connections, writers and services one test started; all stopped at its end."""

    def __init__(self, url: str) -> None:
        super().__init__(url, lease_ttl_s=LEASE_TTL_S)

    async def deriver(self, **options: Any) -> ContextDeriverService:
        """A context-deriver replica on its own connection, started, its endpoints registered on the server."""
        log = await self.connect()
        options.setdefault("partitions", ALL)
        service = self.keep_service(ContextDeriverService(log, **options))
        await service.start()
        await log.nc.flush()  # the endpoints' subscriptions reach the server before anyone asks
        return service

    async def rebuild(self) -> ProjectionRunner[CheckedState]:
        """A clean rebuild of every session from stream seq 1, under a projection name of its own."""
        log = await self.connect()
        runner: ProjectionRunner[CheckedState] = self.keep_runner(
            ProjectionRunner(log, CheckedDeriver(f"cd-check-{uuid.uuid4().hex[:8]}"), partitions=ALL, rebuild=True)
        )
        await runner.start()
        await runner.wait_ready(timeout=WAIT_S)
        return runner


@pytest_asyncio.fixture(loop_scope="module")
async def stack(url: str) -> AsyncIterator[Stack]:
    async with Stack(url) as opened:
        yield opened


async def derive(log: SessionLog, body: dict[str, Any], timeout: float = WAIT_S) -> dict[str, Any]:
    reply: dict[str, Any] = await call(log.nc, DERIVE, body, timeout=timeout)
    return reply


def expected_reply(session: Session) -> dict[str, Any]:
    """What `derive` must answer for a session whose log is `session` (messages as JSON values)."""
    snap = snapshot(session)
    return {
        "seq": len(session) - 1,
        "generation": snap["generation"],
        "header": snap["header"],
        "sha256": snap["sha256"],
        "messages": json.loads(snap["messages"]),
        "open_step": [session.open_turn, session.open_step.number] if session.open_step is not None else None,
    }


def answered(reply: dict[str, Any]) -> dict[str, Any]:
    return {k: reply[k] for k in ("seq", "generation", "header", "sha256", "messages", "open_step")}


def canonical_sha(messages: list[Any]) -> str:
    body = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(body).hexdigest()


async def log_of(log: SessionLog, session_id: str) -> Session:
    return Session(await log.reader.events(session_id))


async def error_code(log: SessionLog, subject: str, payload: bytes) -> str | None:
    """The SPEC code of a micro error reply to a raw request, None for a success."""
    reply = await log.nc.request(subject, payload, timeout=WAIT_S)
    return (reply.headers or {}).get(ERROR_CODE_HEADER)


# ---------------------------------------------------------------------------------------------- derive


@pytest.mark.parametrize("replica", ["owner", "not-owner"])
async def test_derive_with_min_seq_right_after_a_flush_returns_that_seq(stack: Stack, replica: str) -> None:
    await stack.deriver(partitions=ALL if replica == "owner" else [])
    log = await stack.connect()
    writer = await stack.create(log)
    flushes = 0
    for turn in range(6):
        await streamed_turn(writer, f"turn {turn}", tools=turn % 3)
        if turn == 3:
            await compact_all(writer)
        seq = await writer.flush()
        reply = await derive(log, {"session": writer.session_id, "min_seq": seq, "timeout_ms": 3000})
        assert reply["session"] == writer.session_id
        assert answered(reply) == expected_reply(writer.session), f"after the flush of seq {seq}"
        assert reply["sha256"] == canonical_sha(reply["messages"])
        flushes += 1
    assert writer.session.generation >= 1 and flushes == 6
    # Flushes in the middle of a turn, too: the reply reflects exactly what is durable.
    turn = writer.session.last_turn + 1
    await writer.emit("turn/start", {"turn": turn})
    for i in range(5):
        await writer.emit("user/message", user_message_data(f"more {i}", f"m{turn}-{i}"), surface_op="append")
        seq = await writer.flush()
        reply = await derive(log, {"session": writer.session_id, "min_seq": seq, "timeout_ms": 3000})
        assert reply["seq"] == seq and answered(reply) == expected_reply(writer.session)


@pytest.mark.parametrize("replica", ["owner", "not-owner"])
async def test_min_seq_beyond_the_log_is_a_clear_timeout_within_timeout_ms(stack: Stack, replica: str) -> None:
    await stack.deriver(partitions=ALL if replica == "owner" else [])
    log = await stack.connect()
    writer = await stack.create(log)
    await streamed_turn(writer, "x")
    seq = await writer.flush()
    start = time.monotonic()
    with pytest.raises(SessionLogError) as refused:
        await derive(log, {"session": writer.session_id, "min_seq": seq + 10, "timeout_ms": 400})
    took = time.monotonic() - start
    assert refused.value.code == "LOG_UNAVAILABLE"
    assert str(seq + 10) in refused.value.message and writer.session_id in refused.value.message
    assert 0.35 <= took < 5, f"answered after {took:.2f}s for timeout_ms 400"  # it waited, and gave up in time
    reply = await derive(log, {"session": writer.session_id, "min_seq": seq})
    assert reply["seq"] == seq, "the service keeps serving"


@pytest.mark.parametrize("replica", ["owner", "not-owner"])
async def test_min_seq_waits_for_a_flush_that_comes_after_the_request(stack: Stack, replica: str) -> None:
    await stack.deriver(partitions=ALL if replica == "owner" else [])
    log = await stack.connect()
    writer = await stack.create(log)
    await streamed_turn(writer, "first")
    await writer.flush()
    target = writer.next_seq + 2
    asked = asyncio.create_task(derive(log, {"session": writer.session_id, "min_seq": target, "timeout_ms": 5000}))
    await asyncio.sleep(0.3)
    assert not asked.done(), "it waits for the seq instead of answering what it has"
    await streamed_turn(writer, "second")
    seq = await writer.flush()
    reply = await asyncio.wait_for(asked, WAIT_S)
    assert target <= reply["seq"] <= seq
    assert answered(reply) == expected_reply(writer.session.prefix(reply["seq"]))


async def test_a_waiting_derive_does_not_hold_up_other_requests(stack: Stack) -> None:
    await stack.deriver()
    log = await stack.connect()
    slow, fast = await stack.create(log), await stack.create(log)
    for writer in (slow, fast):
        await streamed_turn(writer, "x")
        await writer.flush()
    # The other request waits a minute (it is cancelled below), far longer than the fast answer may take.
    waiting = asyncio.create_task(derive(log, {"session": slow.session_id, "min_seq": 999, "timeout_ms": 60_000}))
    await asyncio.sleep(0.1)
    reply = await derive(log, {"session": fast.session_id, "min_seq": fast.durable_seq})
    assert reply["seq"] == fast.durable_seq
    assert not waiting.done(), "the fast answer came while the other request was still waiting"
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting


@pytest.mark.parametrize("replica", ["owner", "not-owner"])
async def test_at_seq_gives_the_prefix(stack: Stack, replica: str) -> None:
    await stack.deriver(partitions=ALL if replica == "owner" else [])
    log = await stack.connect()
    writer = await stack.create(log)
    for turn in range(4):  # turn 3 changes the header: a prefix before it folds the older one
        await streamed_turn(writer, f"t{turn}")
    await compact_all(writer)
    last = await writer.flush()
    full = await log_of(log, writer.session_id)
    headers = set()
    for at in sorted({0, 1, 3, 7, len(full) // 3, len(full) // 2, last - 3, last - 1, last}):
        reply = await derive(log, {"session": writer.session_id, "at_seq": at})
        assert answered(reply) == expected_reply(full.prefix(at)), f"at_seq {at}"
        headers.add(json.dumps(reply["header"], sort_keys=True))
    assert len(headers) >= 3, "prefixes before the first header, before the change, and after it"
    both = await derive(log, {"session": writer.session_id, "at_seq": 5, "min_seq": last})
    assert answered(both) == expected_reply(full.prefix(5)), "min_seq waits, at_seq cuts"
    with pytest.raises(SessionLogError) as refused:
        await derive(log, {"session": writer.session_id, "at_seq": last + 5, "timeout_ms": 200})
    assert refused.value.code in ("LOG_UNAVAILABLE", "INVALID_BOUNDARY")


async def test_owner_and_not_owner_answer_byte_for_byte_the_same(stack: Stack) -> None:
    owner = await stack.deriver()
    other = await stack.deriver(partitions=[])
    log = await stack.connect()
    writer = await stack.create(log)
    for turn in range(3):
        await streamed_turn(writer, f"t{turn}", tools=2)
    await compact_all(writer)
    last = await writer.flush()
    assert owner.runner.owns(writer.session_id) and not other.runner.owns(writer.session_id)
    for body in (
        {"session": writer.session_id, "min_seq": last},
        {"session": writer.session_id},
        {"session": writer.session_id, "at_seq": 4},
        {"session": writer.session_id, "at_seq": last - 2, "min_seq": 1},
    ):
        request = DeriveRequest(**body)
        assert encode(await owner.derive(request)) == encode(await other.derive(request)), body


async def test_a_large_derivation_is_paged_and_the_pages_add_up(stack: Stack) -> None:
    service = await stack.deriver()
    other = await stack.deriver(partitions=[])
    log = await stack.connect()
    writer = await stack.create(log)
    await writer.emit("turn/start", {"turn": 1})
    for i in range(14):  # ~2.8 MB of messages: several pages of a 1 MiB max_payload
        await writer.emit("user/message", user_message_data(f"{i:02d}" + "é" * 100_000, f"big{i}"), surface_op="append")
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    last = await writer.flush()
    expected = expected_reply(await log_of(log, writer.session_id))
    max_payload = log.nc.max_payload
    for replica in (service, other):
        for at in (None, last - 3):
            want = expected if at is None else expected_reply((await log_of(log, writer.session_id)).prefix(at))
            body: dict[str, Any] = {"session": writer.session_id, "min_seq": last}
            if at is not None:
                body["at_seq"] = at
            messages: list[Any] = []
            seqs: list[int] = []
            page: int | None = 0
            pages = 0
            while page is not None:
                raw = encode(await replica.derive(DeriveRequest(**body, page=page)))
                assert len(raw) <= max_payload, f"page {page} is {len(raw)} bytes"
                reply = json.loads(raw)
                assert {k: reply[k] for k in ("seq", "generation", "header", "sha256")} == {
                    k: want[k] for k in ("seq", "generation", "header", "sha256")
                }, "every page carries the whole derivation's seq and sha256"
                messages += reply["messages"]
                seqs += reply["seqs"]
                pages += 1
                next_page = reply.get("next_page")
                assert next_page is None or next_page == page + 1
                page = next_page
            assert pages >= 3
            assert messages == want["messages"] and canonical_sha(messages) == want["sha256"]
            full = await log_of(log, writer.session_id)
            view = full if at is None else full.prefix(at)
            assert seqs == [m.seq for m in view.derive_messages()], "each page names its messages' seqs"
    # Over the wire too, and a page past the end is refused.
    first = await derive(log, {"session": writer.session_id, "page": 0})
    assert first["next_page"] == 1 and first["sha256"] == expected["sha256"]
    with pytest.raises(SessionLogError) as refused:
        await derive(log, {"session": writer.session_id, "page": 99})
    assert refused.value.code == "INVALID_BOUNDARY"


async def test_a_large_header_is_counted_when_paging(stack: Stack) -> None:
    await stack.deriver()
    log = await stack.connect()
    writer = await stack.create(log)
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("step/start", {"turn": 1, "step": 1})
    header = {"config": {"provider": "p", "model": "m"}, "system": "s" * 400_000}
    await writer.emit("request/header", {"header": header, "reason": "initial"})
    for i in range(8):
        await writer.emit("user/message", user_message_data("x" * 100_000, f"u{i}"), surface_op="append")
    await writer.emit("step/end", {"turn": 1, "step": 1})
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    last = await writer.flush()
    expected = expected_reply(await log_of(log, writer.session_id))
    messages: list[Any] = []
    page: int | None = 0
    while page is not None:
        reply = await derive(log, {"session": writer.session_id, "min_seq": last, "page": page})
        messages += reply["messages"]
        page = reply.get("next_page")
    assert messages == expected["messages"]


async def test_bad_requests_get_typed_errors_and_the_service_keeps_serving(stack: Stack) -> None:
    await stack.deriver()
    log = await stack.connect()
    writer = await stack.create(log)
    await streamed_turn(writer, "x")
    last = await writer.flush()
    sid = writer.session_id
    cases: list[tuple[bytes, str]] = [
        (b"not json", "INVALID_REQUEST"),
        (b"[1, 2]", "INVALID_REQUEST"),
        (b"{}", "INVALID_REQUEST"),
        (b'{"session": 5}', "INVALID_REQUEST"),
        (b'{"session": "a.b"}', "INVALID_SESSION_ID"),
        (b'{"session": "sessionlog.>"}', "INVALID_SESSION_ID"),
        (json.dumps({"session": sid, "min_seq": -1}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": sid, "min_seq": "3"}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": sid, "min_seq": True}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": sid, "min_seq": 1.5}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": sid, "at_seq": -2}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": sid, "page": -1}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": sid, "timeout_ms": -5}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": new_session_id("absent")}).encode(), "SESSION_NOT_FOUND"),
    ]
    for payload, code in cases:
        assert await error_code(log, DERIVE, payload) == code, payload
    for payload, code in [
        (b"nope", "INVALID_REQUEST"),
        (json.dumps({"session": sid}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": sid, "event": "x"}).encode(), "INVALID_REQUEST"),
        (json.dumps({"session": "bad id", "event": {}}).encode(), "INVALID_SESSION_ID"),
    ]:
        assert await error_code(log, PLAN, payload) == code, payload
    reply = await derive(log, {"session": sid, "min_seq": last})
    assert answered(reply) == expected_reply(writer.session), "still serving after every refusal"


async def test_a_session_that_does_not_exist_is_not_found_whichever_replica_answers(stack: Stack) -> None:
    owner = await stack.deriver()
    other = await stack.deriver(partitions=[])
    codes = {}
    for name, replica in (("owner", owner), ("not-owner", other)):
        try:
            await replica.derive(DeriveRequest(new_session_id("absent"), min_seq=0, timeout_ms=300))
        except SessionLogError as err:
            codes[name] = err.code
    assert codes == {"owner": "SESSION_NOT_FOUND", "not-owner": "SESSION_NOT_FOUND"}


async def test_an_empty_session_derives_no_messages(stack: Stack) -> None:
    await stack.deriver()
    log = await stack.connect()
    writer = await stack.create(log)
    reply = await derive(log, {"session": writer.session_id})
    assert reply["messages"] == [] and reply["seq"] == -1 and reply["header"] is None
    assert reply["sha256"] == hashlib.sha256(b"[]").hexdigest()


async def test_plan_replace_is_a_dry_run_of_a_compaction(stack: Stack) -> None:
    await stack.deriver()
    log = await stack.connect()
    writer = await stack.create(log)
    await streamed_turn(writer, "a", tools=1)
    await streamed_turn(writer, "b", tools=0)
    turn = writer.session.last_turn + 1
    await writer.emit("turn/start", {"turn": turn})
    await derive(log, {"session": writer.session_id, "min_seq": await writer.flush()})  # the deriver has it all
    event = compaction_of(writer.session)
    nodes = event["sourceEventSeqs"]
    seq = event["seq"]
    reply = await call(log.nc, PLAN, {"session": writer.session_id, "event": event}, timeout=WAIT_S)
    assert reply == {"accepted": True, "shadowed": nodes}
    missing = {**event, "sourceEventSeqs": nodes[1:]}
    reply = await call(log.nc, PLAN, {"session": writer.session_id, "event": missing}, timeout=WAIT_S)
    assert reply["accepted"] is False and reply["error"]["code"] == "PROVENANCE_INCOMPLETE"
    nowhere = {**event, "surfaceOp": {"op": "replace", "start": 10_000, "end": 10_001}}
    reply = await call(log.nc, PLAN, {"session": writer.session_id, "event": nowhere}, timeout=WAIT_S)
    assert reply["accepted"] is False and reply["error"]["code"] == "REPLACE_RANGE_NOT_FOUND"
    assert len(await log.reader.events(writer.session_id)) == seq, "a dry run appends nothing"


def compaction_of(session: Session) -> dict[str, Any]:
    """A compaction event replacing every surface node of the session, as its next event."""
    nodes = list(session.surface.nodes)
    summary = user_message_data("summary", "s1")
    summary["source"] = {"kind": "plugin", "plugin": "compact"}
    return {
        "seq": len(session),
        "time": 1,
        "type": "user/message",
        "data": summary,
        "surfaceOp": {"op": "replace", "start": nodes[0], "end": nodes[-1]},
        "sourceEventSeqs": nodes,
    }


async def test_plan_replace_right_after_a_flush_plans_against_the_flushed_log(stack: Stack) -> None:
    service = await stack.deriver()
    log = await stack.connect()
    writer = await stack.create(log)
    await streamed_turn(writer, "a", tools=1)
    await derive(log, {"session": writer.session_id, "min_seq": await writer.flush()})
    apply_record = service.runner._apply_record

    async def lagging(record: Any) -> None:  # a consumer a moment behind (a busy replica, a catch-up)
        await asyncio.sleep(0.5)
        await apply_record(record)

    service.runner._apply_record = lagging  # type: ignore[method-assign]
    await streamed_turn(writer, "b", tools=0)
    await writer.emit("turn/start", {"turn": writer.session.last_turn + 1})
    await writer.flush()
    event = compaction_of(writer.session)
    reply = await call(log.nc, PLAN, {"session": writer.session_id, "event": event}, timeout=WAIT_S)
    assert reply == {"accepted": True, "shadowed": event["sourceEventSeqs"]}


async def test_stats_say_what_the_replica_holds(stack: Stack) -> None:
    service = await stack.deriver()
    log = await stack.connect()
    writer = await stack.create(log)
    await streamed_turn(writer, "x")
    await derive(log, {"session": writer.session_id, "min_seq": await writer.flush()})
    stats = await call(log.nc, STATS, {}, timeout=WAIT_S)
    assert stats["partitions"] == ALL and stats["quarantined"] == 0
    assert stats["sessions"] >= 1 and stats["memory_bytes"] > 0 and stats["replica"] == service.runner.replica_id
    assert set(stats["lag_events"]) == {str(p) for p in ALL}


# ---------------------------------------------------------------------------------------------- kill -9


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    try:
        yield started
    finally:
        for process in started:
            with contextlib.suppress(Exception):
                process.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def own_stack(fresh_server: EmbeddedServer) -> AsyncIterator[Stack]:
    """A server of the test's own (its checkpoints are its own), and a stack closed before it is killed."""
    async with Stack(fresh_server.url) as opened:
        yield opened


async def stream_until(writer: SessionWriter, stop: asyncio.Event, pause: float) -> int:
    """Write whole turns (flushing where an agent flushes) until told to stop; return the turns written."""
    turns = 0
    while not stop.is_set():
        await streamed_turn(writer, f"turn {turns}", deltas=8, tools=turns % 3)
        if turns % 4 == 3:
            await compact_all(writer)
        await writer.flush()
        turns += 1
        await asyncio.sleep(pause)
    return turns


async def checkpoints(log: SessionLog, name: str) -> dict[int, int]:
    kv = await log.js.key_value(log.settings.kv_checkpoints)
    out: dict[int, int] = {}
    for number in ALL:
        with contextlib.suppress(Exception):
            entry = await kv.get(f"{name}.p{number}")
            out[number] = int(json.loads(entry.value)["stream_seq"])
    return out


@pytest.mark.parametrize("ownership", ["fixed", "claimed"])
async def test_a_deriver_killed_mid_stream_and_restarted_equals_a_clean_rebuild(
    own_stack: Stack, processes: list[ServiceProcess], tmp_path: Path, ownership: str
) -> None:
    env = {"SESSIONLOG_PARTITIONS": "0-7"} if ownership == "fixed" else {}
    process = ServiceProcess("context-deriver", own_stack.url, tmp_path, **env)
    processes.append(process)
    # It provisions the log before the service starts. Its writers' leases last 5 s: a refresh that comes late while
    # the deriver is killed and started again on this busy machine does not lose one.
    log = await own_stack.connect(lease_ttl_s=5.0)
    process.start()
    await process.wait_ready()

    # 16 sessions, two in each partition, streaming turns while the deriver runs.
    ids = [sid for p in ALL for sid in ids_in_partition(p, 2)]
    writers = [await own_stack.create(log, sid) for sid in ids]
    stop = asyncio.Event()
    streams = [asyncio.create_task(stream_until(w, stop, pause=0.05)) for w in writers]
    try:

        async def checkpointed() -> bool:
            return len(await checkpoints(log, "context-deriver")) == PARTITIONS

        await eventually(checkpointed, "a checkpoint for every partition", timeout=15)
        await asyncio.sleep(0.5)
        process.kill9()  # mid-stream: the writers go on
        resume_at = await checkpoints(log, "context-deriver")  # the process is dead: these stay put
        await asyncio.sleep(1.0)
        written_while_dead = await last_stream_seq(log, "sessionlog.events.>")
        assert written_while_dead > max(resume_at.values()), "records landed that the dead deriver never saw"

        process.start()
        await process.wait_ready()

        async def owns_all() -> bool:  # a claiming replica waits for the dead one's leases to expire first
            with contextlib.suppress(SessionLogError):
                return (await call(log.nc, STATS, {}, timeout=WAIT_S))["partitions"] == ALL
            return False

        await eventually(owns_all, "the restarted deriver owns every partition")
        seen: dict[int, Any] = {}
        for number, seq in resume_at.items():  # it resumed after its checkpoint, not from the start

            async def resumed(number: int = number, seq: int = seq) -> bool:
                with contextlib.suppress(Exception):  # deleted and created again by the new owner
                    info = await log.js.consumer_info(log.settings.stream, f"context-deriver-p{number}")
                    seen[number] = (info.config.opt_start_seq, info.created)
                    # At the checkpoint, or at a later one of its own when a slow lease refresh (1 s leases on a
                    # busy machine) made it drop and claim the partition again; never from the start.
                    start = info.config.opt_start_seq
                    return bool(start == seq + 1 if ownership == "fixed" else start >= seq + 1)
                return False

            await eventually(
                resumed, f"partition {number} restarted after {seq} (seen {seen}, {resume_at})", timeout=20
            )
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        turns = await asyncio.wait_for(asyncio.gather(*streams), WAIT_S * 3)
    assert min(turns) >= 3

    rebuilt = await own_stack.rebuild()
    for writer in writers:
        sid = writer.session_id
        reply = await derive(log, {"session": sid, "min_seq": writer.durable_seq, "timeout_ms": 5000})
        clean = await log_of(log, sid)
        assert answered(reply) == expected_reply(clean), f"{sid}: the restarted deriver differs from the log"
        state = rebuilt.states[sid]
        assert answered(reply) == expected_reply(state.session), f"{sid}: differs from an in-process rebuild"
        assert state.next_seq == len(clean) == writer.durable_seq + 1
    stats = await call(log.nc, STATS, {}, timeout=WAIT_S)
    assert stats["quarantined"] == 0, "an event applied twice would have been refused (SEQ_NOT_CONTIGUOUS)"
    assert stats["partitions"] == ALL
    health = process.health("/healthz")[1]
    assert health["components"]["context-deriver"]["quarantined"] == 0

    async def caught_up() -> bool:  # and its checkpoints move on from where it resumed
        now = await checkpoints(log, "context-deriver")
        ends = {p: await last_stream_seq(log, partition_filter(p)) for p in ALL}
        return all(now.get(p, 0) >= end for p, end in ends.items())

    await eventually(caught_up, "checkpoints at the end of every partition", timeout=10)


async def test_serve_rebuild_and_from_seq_start_where_they_are_told(
    own_stack: Stack, processes: list[ServiceProcess], tmp_path: Path
) -> None:
    log = await own_stack.connect()
    writers = [await own_stack.create(log) for _ in range(4)]
    for writer in writers:
        await streamed_turn(writer, "one")
        await writer.flush()
    process = ServiceProcess("context-deriver", own_stack.url, tmp_path, SESSIONLOG_PARTITIONS="0-7")
    processes.append(process)
    process.start()
    await process.wait_ready()

    async def checkpointed() -> bool:
        now = await checkpoints(log, "context-deriver")
        ends = {p: await last_stream_seq(log, partition_filter(p)) for p in ALL}
        return all(now.get(p, 0) >= end for p, end in ends.items() if end)

    await eventually(checkpointed, "checkpoints at the end of every partition")
    # Stopped off the event loop: a SIGTERM'd process can take over a second to exit on a loaded machine, and the
    # writers' 1 s leases must go on being refreshed meanwhile (they were lost here, LEASE_LOST at the next flush).
    await asyncio.to_thread(process.stop)
    middle = await last_stream_seq(log, "sessionlog.events.>") + 1
    for writer in writers:
        await streamed_turn(writer, "two")
        await writer.flush()

    for args, expected in ((["--rebuild"], lambda _: 1), (["--from-seq", str(middle)], lambda _: middle)):
        process.start(*args)
        await process.wait_ready()
        for number in ALL:
            info = await log.js.consumer_info(log.settings.stream, f"context-deriver-p{number}")
            assert info.config.opt_start_seq == expected(number), (args, number, info.config.opt_start_seq)
        for writer in writers:
            reply = await derive(log, {"session": writer.session_id, "min_seq": writer.durable_seq})
            assert answered(reply) == expected_reply(await log_of(log, writer.session_id)), args
        await asyncio.to_thread(process.stop)
