"""Fork, resume and unfinished writes on the JetStream log (SPEC sections 7 and 8), against a real nats-server.

A fork copies a prefix into a new session and never touches the parent; resume closes a turn a dead writer left
open with the deterministic closers of SPEC section 7; and a session becomes visible only when its header is
written, after its records, so a fork or import that died halfway leaves nothing visible and can be completed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from conftest import dsh_header_problem
from natsfixtures import new_session_id
from scaffold import LEASE_TTL_S, Opened, eventually, outlived_its_ttl
from sessiongen import SessionBuilder, text_block, tool_call_block

from sessionlog.errors import SessionLogError
from sessionlog.fork import END_SEED, plan_fork
from sessionlog.jsonl import JsonlLog, decode_header, parse_jsonl
from sessionlog.log import SessionLog
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]


# ---------------------------------------------------------------------------------------------- helpers


class Logs(Opened):
    """The connections and writers one test opened; all stopped and closed when it ends."""

    def __init__(self, url: str) -> None:
        super().__init__(url, lease_ttl_s=LEASE_TTL_S)


@pytest_asyncio.fixture(loop_scope="module")
async def logs(url: str) -> AsyncIterator[Logs]:
    async with Logs(url) as opened:
        yield opened


def two_turns() -> SessionBuilder:
    """Turn 1 reads a file through a tool; turn 2 answers with text. Both closed."""
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Read a.txt.")
    b.request_header(system="Be brief.")
    b.tool_step(["call-1"], text="Reading.")
    b.text_step("It says hello.")
    b.turn_end()
    b.turn_start()
    b.user_message("Thanks.")
    b.text_step("You're welcome.")
    b.turn_end()
    return b


async def write_session(log: SessionLog, events: list[bytes], **create: Any) -> str:
    """A new session holding `events`, written through a writer and closed (lease released)."""
    sid = new_session_id()
    writer = await log.create(sid, **create)
    for raw in events:
        await writer.append(raw)
    await writer.close()
    return sid


async def visible(log: SessionLog, sid: str) -> bool:
    return await log.header(sid) is not None or sid in {s.id for s in await log.sessions()}


async def lease_expired(log: SessionLog, sid: str) -> None:
    async def expired() -> bool:
        return await log.leases.current(sid) is None

    await eventually(expired, f"the lease of {sid} expires")


def as_file(header: dict[str, Any], events: list[bytes]) -> JsonlLog:
    return parse_jsonl(msgspec.json.encode(header) + b"\n" + b"".join(raw + b"\n" for raw in events))


# ---------------------------------------------------------------------------------------------- fork


async def test_create_writes_only_a_header_dsh_loads(logs: Logs) -> None:
    """dsh knows `origin` only as "subagent": any other value would make the exported file unloadable there."""
    log = await logs.connect()
    refused = new_session_id()
    with pytest.raises(SessionLogError) as info:
        await log.create(refused, origin="fork")
    assert info.value.code == "INVALID_EVENT" and "subagent" in info.value.message
    assert await log.header(refused) is None, "nothing was written"
    child = new_session_id()
    writer = await log.create(child, cwd="/repo", origin="subagent", delegation_depth=1)
    await writer.close()
    header = msgspec.json.decode(await log.header(child))
    assert header["origin"] == "subagent" and dsh_header_problem(header) is None


async def test_fork_copies_the_prefix_adds_an_end_seed_records_lineage_and_leaves_the_parent_untouched(
    logs: Logs,
) -> None:
    log = await logs.connect()
    events = two_turns().events
    parent = await write_session(log, events, cwd="/repo", delegation_depth=1)
    parent_header = await log.header(parent)
    parent_records = await log.reader.records(parent)
    boundary = next(
        i for i, raw in enumerate(events) if msgspec.json.decode(raw)["type"] == "turn/end"
    )  # the end of turn 1

    child = new_session_id()
    before = int(time.time() * 1000)
    child_header = await log.fork(parent, child, at=boundary)

    child_events = await log.reader.events(child)
    assert child_events[:-1] == events[: boundary + 1], "the prefix is copied byte for byte"
    seed = msgspec.json.decode(child_events[-1])
    assert seed["type"] == END_SEED and seed["seq"] == boundary + 1 and seed["data"] == {}
    assert seed["time"] == msgspec.json.decode(events[boundary])["time"], "the seed takes the last copied time"
    assert seed["time"] <= before
    assert await log.header(child) == child_header
    header = msgspec.json.decode(child_header)
    assert header["id"] == child and header["parentSession"] == parent
    assert header["seedLength"] == boundary + 1 and header["cwd"] == "/repo"
    # What dsh accepts and its own fork writes: no `origin`, `delegationDepth` 0 whatever the parent's (1 here).
    assert "origin" not in header and header["delegationDepth"] == 0 and dsh_header_problem(header) is None
    assert header["createdAt"] >= before

    assert await log.header(parent) == parent_header
    assert await log.reader.records(parent) == parent_records, "the parent is never touched"

    whole = new_session_id()
    await log.fork(parent, whole)  # default boundary: the last seq
    assert (await log.reader.events(whole))[:-1] == events
    assert msgspec.json.decode(await log.header(whole) or b"{}")["seedLength"] == len(events)

    grandchild = new_session_id()
    await log.fork(child, grandchild)  # the prefix already ends with an end-seed: none is added
    assert await log.reader.events(grandchild) == child_events
    lineage = decode_header(await log.header(grandchild) or b"")
    assert lineage.parent_session == child and lineage.seed_length == len(child_events)

    writer = logs.keep(await log.open(child))  # a child is a session like any other
    await writer.append(next_turn_start(child_events))
    await writer.close()
    assert len(await log.reader.events(child)) == len(child_events) + 1


def next_turn_start(events: list[bytes]) -> bytes:
    """The next event after `events`: a turn/start numbered after the log's last turn."""
    session = Session(events)
    return msgspec.json.encode(
        {"seq": len(session), "time": session.last_time, "type": "turn/start", "data": {"turn": session.last_turn + 1}}
    )


async def test_a_fork_of_an_empty_session_is_an_empty_child(logs: Logs) -> None:
    log = await logs.connect()
    parent = await write_session(log, [])
    child = new_session_id()
    await log.fork(parent, child)
    assert await log.reader.events(child) == []
    assert decode_header(await log.header(child) or b"").seed_length == 0
    assert {s.id: s.events for s in await log.sessions()}[child] == 0


@pytest.mark.parametrize(
    ("code", "case"),
    [
        ("SESSION_ALREADY_EXISTS", "child exists"),
        ("SESSION_NOT_FOUND", "no parent"),
        ("INVALID_BOUNDARY", -1),
        ("INVALID_BOUNDARY", "past the end"),
        ("INVALID_BOUNDARY", "3"),
        ("OPEN_TURN", "inside turn 2"),
        ("OPEN_TURN", "last turn open"),
        ("INVALID_SESSION_ID", "bad child id"),
    ],
)
async def test_a_refused_fork_leaves_nothing_visible_for_the_child(logs: Logs, code: str, case: object) -> None:
    log = await logs.connect()
    b = two_turns()
    parent = await write_session(log, b.events)
    child = new_session_id()
    at: Any = None
    if case == "child exists":
        child = await write_session(log, b.events[:3])
        existing = (await log.header(child), await log.reader.records(child))
    elif case == "no parent":
        parent = new_session_id()
    elif case in (-1, "3"):
        at = case
    elif case == "past the end":
        at = len(b.events)
    elif case == "inside turn 2":
        at = len(b.events) - 3
    elif case == "last turn open":
        b.turn_start()
        b.user_message("One more thing.")
        parent = await write_session(log, b.events)
    elif case == "bad child id":
        child = "not.a.token"

    with pytest.raises(SessionLogError) as refused:
        await log.fork(parent, child, at=at)
    assert refused.value.code == code

    if case == "child exists":
        assert (await log.header(child), await log.reader.records(child)) == existing, "the taken id is untouched"
    elif case != "bad child id":
        assert not await visible(log, child)
        assert await log.reader.events(child) == [], "nothing was written for the child"
    assert await log.reader.events(parent) == ([] if case == "no parent" else b.events), "the parent is untouched"


# ---------------------------------------------------------------------------------------------- resume


async def test_resume_of_a_session_whose_writer_died_mid_turn_closes_the_turn_durably(logs: Logs) -> None:
    # A long write-behind window: what the dead writer queued but never flushed is exactly what is lost.
    log = await logs.connect(write_window_ms=60_000)
    sid = new_session_id()
    writer = logs.keep(await log.create(sid))
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Hi")
    b.request_header()
    b.text_step("Hello.")
    b.turn_end()
    b.turn_start()
    b.user_message("Do two things.")
    b.step_start()
    blocks = [text_block("On it."), tool_call_block("call-a"), tool_call_block("call-b")]
    b.assistant_message(blocks, source_seqs=b.stream(blocks))
    b.tool_call("call-a")  # flushed before its body runs: the tool may have run
    for raw in b.events:
        await writer.append(raw)
    durable = list(b.events)
    assert await writer.flush() == len(durable) - 1
    b.tool_call("call-b")
    await writer.append(b.events[-1])  # queued, never flushed: the writer dies first
    await writer.abandon()
    await lease_expired(log, sid)

    elsewhere = await logs.connect()
    header = await log.header(sid)
    resumed = logs.keep(await elsewhere.resume(sid))
    closers = interrupted_turn_closers(Session(durable))
    assert resumed.durable_seq == len(durable) + len(closers), "resume returns once everything is acknowledged"

    stored = await log.reader.events(sid)
    assert stored[: len(durable)] == durable
    assert stored[len(durable) : -1] == list(closers), "the SPEC 7 closers, byte for byte"
    seed = msgspec.json.decode(stored[-1])
    assert seed["type"] == END_SEED and seed["seq"] == len(stored) - 1
    kinds = [(e["type"], e["data"].get("error", {}).get("code")) for e in map(msgspec.json.decode, closers)]
    assert kinds == [
        ("tool/result", "TOOL_OUTCOME_UNKNOWN"),
        ("tool/result", "TOOL_NOT_STARTED"),
        ("step/end", None),
        ("turn/end", None),
    ]
    assert msgspec.json.decode(closers[-1])["data"]["reason"] == {"kind": "interrupted"}
    assert await log.header(sid) == header

    _, session, _ = await (await logs.connect()).load(sid)
    assert session.open_turn is None and len(session) == len(stored)
    await resumed.append(next_turn_start(stored))  # the resumed writer carries on
    await resumed.close()
    assert len(await log.reader.events(sid)) == len(stored) + 1


async def test_resume_of_a_closed_session_appends_only_an_end_seed_and_a_second_resume_nothing(logs: Logs) -> None:
    log = await logs.connect()
    events = two_turns().events
    sid = await write_session(log, events)

    first = await log.resume(sid)
    await first.close()
    stored = await log.reader.events(sid)
    assert stored[:-1] == events and msgspec.json.decode(stored[-1])["type"] == END_SEED

    second = await log.resume(sid)
    await second.close()
    assert await log.reader.events(sid) == stored


async def test_resume_while_a_live_writer_holds_the_session_is_lease_held_and_appends_nothing(logs: Logs) -> None:
    # A 3 s lease refreshed 4 times a second: a refresh that comes late on a busy machine does not lose it.
    log = await logs.connect(lease_ttl_s=3.0, lease_refresh_s=0.25)
    sid = new_session_id()
    writer = logs.keep(await log.create(sid))
    b = SessionBuilder()
    b.turn_start()
    b.user_message("Working...")
    for raw in b.events:
        await writer.append(raw)
    await writer.flush()

    elsewhere = await logs.connect()
    for attempt in range(2):
        with pytest.raises(SessionLogError) as refused:
            await elsewhere.resume(sid)
        assert refused.value.code == "LEASE_HELD"
        if attempt == 0:
            await outlived_its_ttl(writer)  # the live writer keeps refreshing past its TTL
    assert await log.reader.events(sid) == b.events
    await writer.close()


async def test_open_of_a_session_a_crash_left_mid_turn_is_open_turn_and_frees_the_lease(logs: Logs) -> None:
    log = await logs.connect()
    sid = new_session_id()
    writer = logs.keep(await log.create(sid))
    b = SessionBuilder()
    b.turn_start()
    for raw in b.events:
        await writer.append(raw)
    await writer.flush()
    await writer.abandon()
    await lease_expired(log, sid)

    with pytest.raises(SessionLogError) as refused:
        await log.open(sid)
    assert refused.value.code == "OPEN_TURN"
    assert await log.leases.current(sid) is None, "a refused open gives its lease back"
    resumed = logs.keep(await log.resume(sid))
    assert resumed.session.open_turn is None
    await resumed.close()


# ---------------------------------------------------------------------------------------------- unfinished writes


async def test_a_dead_import_leaves_nothing_visible_and_a_later_import_of_the_same_log_completes_it(
    logs: Logs,
) -> None:
    log = await logs.connect(write_max_events=5)  # many records, so an import can die between two of them
    events = two_turns().events
    sid = new_session_id()
    header = {"type": "session", "version": 0, "id": sid, "createdAt": 1_780_000_000_000, "delegationDepth": 0}

    await log.store.write_all(sid, events[:12])  # the process died after some records, before the header
    assert await log.header(sid) is None
    assert sid not in {s.id for s in await log.sessions()}
    with pytest.raises(SessionLogError) as refused:
        await log.load(sid)
    assert refused.value.code == "SESSION_NOT_FOUND"
    with pytest.raises(SessionLogError) as refused:
        await log.create(sid)
    assert refused.value.code == "SESSION_ALREADY_EXISTS", "an id with an unfinished write is taken"
    other = SessionBuilder()
    other.turn_start()
    other.user_message("Something else entirely.")
    with pytest.raises(SessionLogError) as refused:
        await log.import_log(as_file(header, other.events))
    assert refused.value.code == "SESSION_ALREADY_EXISTS", "other content never continues an unfinished write"
    assert await log.reader.events(sid) == events[:12]

    assert await log.import_log(as_file(header, events)) == (sid, len(events))
    assert await log.header(sid) == msgspec.json.encode(header)
    records = await log.reader.records(sid)  # checks that records continue each other exactly
    assert [e for r in records for e in r.events] == events
    assert len({r.first_seq for r in records}) == len(records)
    assert {s.id: s.events for s in await log.sessions()}[sid] == len(events)


async def test_a_dead_fork_leaves_nothing_visible_and_a_retried_fork_completes_it(logs: Logs) -> None:
    log = await logs.connect()
    events = two_turns().events
    parent = await write_session(log, events, cwd="/repo")
    child = new_session_id()
    _, session, _ = await log.load(parent)
    dead = plan_fork(session, None, now_ms=int(time.time() * 1000))
    await log.store.write_all(child, dead.events)  # every record written; died before the header
    assert not await visible(log, child)

    await asyncio.sleep(0.01)  # the retry happens a moment later
    await log.fork(parent, child)
    stored = await log.reader.events(child)
    assert stored[:-1] == events and msgspec.json.decode(stored[-1])["type"] == END_SEED
    assert decode_header(await log.header(child) or b"").parent_session == parent
