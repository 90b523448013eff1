"""The repairer service (`sessionlog-repair`, its watch loop and `sessionlog.repair.close`) against real
nats-server processes and real service instances.

What it promises (SPEC section 7): when a session has an open turn and no live writer lease for longer than the
grace period, it appends the closers of `interrupted_turn_closers`, byte for byte, with the right codes
(`TOOL_OUTCOME_UNKNOWN` for a call whose `tool/call` is durable, `TOOL_NOT_STARTED` for one only announced); a
writer that comes back afterwards is fenced with `LEASE_LOST`; two repairers racing land one copy; the endpoint
refuses with `LEASE_HELD` while a live writer holds the session and answers `{"closers": []}` for a closed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from natsfixtures import new_session_id
from scaffold import LEASE_TTL_S, WAIT_S, Opened, eventually, outlived_its_ttl
from sessiongen import assistant_message_data, closed_turn, user_message_data

from services.repairer.service import RepairerService
from sessionlog.errors import SessionLogError
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.micro import ERROR_CODE_HEADER, call
from sessionlog.provision import partition_of
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

GRACE_S = 0.3
CLOSE = "sessionlog.repair.close"


# ---------------------------------------------------------------------------------------------- helpers


class Stack(Opened):
    """The connections, writers and repairers one test started; all stopped at its end."""

    def __init__(self, url: str) -> None:
        super().__init__(url, lease_ttl_s=LEASE_TTL_S, repair_grace_s=GRACE_S)

    async def repairer(self, **overrides: Any) -> RepairerService:
        """A repairer replica on its own connection, claiming partitions as a deployed one does."""
        log = await self.connect(**overrides)
        service = self.keep_service(RepairerService(log))
        await service.start()
        await log.nc.flush()
        return service


@pytest_asyncio.fixture(loop_scope="module")
async def stack(url: str) -> AsyncIterator[Stack]:
    async with Stack(url) as opened:
        yield opened


async def open_turn(writer: SessionWriter, calls: list[tuple[str, bool]], *, step_open: bool = True) -> int:
    """A turn the writer leaves open: a step whose assistant message announces `calls` (id, durable tool/call?),
    flushed as an agent flushes before a tool body. Without `step_open` the turn is open between steps."""
    turn = writer.session.last_turn + 1
    await writer.emit("turn/start", {"turn": turn})
    await writer.emit("user/message", user_message_data("do it", f"u{turn}"), surface_op="append")
    await writer.emit("step/start", {"turn": turn, "step": 1})
    blocks: list[dict[str, Any]] = [{"type": "text", "text": "on it"}]
    blocks += [{"type": "tool-call", "id": cid, "name": "bash", "arguments": '{"cmd":"ls"}'} for cid, _ in calls]
    await writer.emit("assistant/message", assistant_message_data(turn, 1, blocks, f"a{turn}"), surface_op="append")
    for call_id, durable in calls:
        if durable:
            data = {"turn": turn, "step": 1, "callId": call_id, "name": "bash", "arguments": '{"cmd":"ls"}'}
            await writer.emit("tool/call", data)
    if not step_open:
        await writer.emit("step/end", {"turn": turn, "step": 1})
    return await writer.flush()


async def repaired(log: SessionLog, session_id: str, length: int, timeout: float = WAIT_S) -> list[bytes]:
    """Wait until the session's log grows past `length` and its turn is closed; return the events after it."""

    async def closed() -> bool:
        events = await log.reader.events(session_id)
        return len(events) > length and Session(events).open_turn is None

    await eventually(closed, f"session {session_id} repaired", timeout)
    return (await log.reader.events(session_id))[length:]


def codes(closers: list[bytes]) -> list[str | None]:
    out: list[str | None] = []
    for raw in closers:
        event = json.loads(raw)
        error = event["data"].get("error")
        out.append(error["code"] if error else event["type"])
    return out


async def lease_free(log: SessionLog, session_id: str) -> None:
    async def free() -> bool:
        return await log.leases.current(session_id) is None

    await eventually(free, f"the lease of {session_id} expires", timeout=WAIT_S)


# ---------------------------------------------------------------------------------------------- the watch loop


CASES = {
    "durable call": ([("c1", True)], True, ["TOOL_OUTCOME_UNKNOWN", "step/end", "turn/end"]),
    "announced call only": ([("c1", False)], True, ["TOOL_NOT_STARTED", "step/end", "turn/end"]),
    "one of each": (
        [("c1", True), ("c2", False), ("c3", True)],
        True,
        ["TOOL_OUTCOME_UNKNOWN", "TOOL_NOT_STARTED", "TOOL_OUTCOME_UNKNOWN", "step/end", "turn/end"],
    ),
    "no calls": ([], True, ["step/end", "turn/end"]),
    "between steps": ([], False, ["turn/end"]),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_writer_killed_mid_turn_is_closed_by_the_repairer_byte_for_byte(stack: Stack, case: str) -> None:
    calls, step_open, expected_codes = CASES[case]
    service = await stack.repairer()
    log = await stack.connect()
    writer = await stack.create(log)
    await closed_turn(writer)
    await open_turn(writer, calls, step_open=step_open)
    prefix = await log.reader.events(writer.session_id)
    await writer.abandon()  # a crash, as far as the log can tell: no flush, no release; the lease expires

    closers = await repaired(log, writer.session_id, len(prefix))
    assert closers == list(interrupted_turn_closers(Session(prefix))), "byte-identical to interrupted_turn_closers"
    assert codes(closers) == expected_codes
    assert json.loads(closers[-1])["data"]["reason"] == {"kind": "interrupted"}
    tail = await log.reader.records(writer.session_id)
    assert tail[-1].events == tuple(closers) and tail[-1].epoch == 0, "one record, atomic, under the repairer epoch"
    assert any(sid == writer.session_id for sid, _ in service.repaired)
    Session(prefix + closers)  # the repaired log passes every rule


async def test_a_writer_process_killed_with_sigkill_is_repaired(stack: Stack, tmp_path: Path) -> None:
    await stack.repairer()
    log = await stack.connect()
    sid = new_session_id("killed")
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_repairer import open_turn
        from sessionlog.log import SessionLog

        async def main():
            log = await SessionLog.connect()
            writer = await log.create({sid!r})
            await open_turn(writer, [("c1", True), ("c2", False)])
            print("flushed", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(SESSIONLOG_NATS_URL=stack.url, SESSIONLOG_LEASE_TTL_S="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.strip() == b"flushed", proc.stderr.read() if proc.stderr else b""
        prefix = await log.reader.events(sid)
        assert await log.leases.current(sid) is not None, "the live writer holds its lease"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    closers = await repaired(log, sid, len(prefix))
    assert closers == list(interrupted_turn_closers(Session(prefix)))
    assert codes(closers) == ["TOOL_OUTCOME_UNKNOWN", "TOOL_NOT_STARTED", "step/end", "turn/end"]


async def test_a_writer_that_comes_back_after_the_repair_is_fenced_and_resumes(stack: Stack) -> None:
    await stack.repairer()
    log = await stack.connect()
    writer = await stack.create(log)
    await open_turn(writer, [("c1", True)])
    prefix = await log.reader.events(writer.session_id)
    await writer.lease.stop()  # the process stalls (a long GC, a laptop lid): it stops refreshing its lease
    closers = await repaired(log, writer.session_id, len(prefix))

    result = _result({"turn": 1, "step": 1, "callId": "c1"})
    with contextlib.suppress(SessionLogError):  # queued; its publish may already have been refused
        await writer.emit("tool/result", result, surface_op="append", source_event_seqs=[len(prefix) - 1])
    with pytest.raises(SessionLogError) as fenced:
        await writer.flush()
    assert fenced.value.code == "LEASE_LOST", "its lease expired: the repairer is not a competing writer"
    assert await log.reader.events(writer.session_id) == prefix + closers, "the late writer changed nothing"

    resumed = await log.resume(writer.session_id)
    try:
        events = await log.reader.events(writer.session_id)
        assert events[: len(prefix) + len(closers)] == prefix + closers, "resume appends no second set of closers"
        assert [json.loads(e)["type"] for e in events[len(prefix) + len(closers) :]] == ["session/end-seed"]
        await closed_turn(resumed)
        await resumed.flush()
        Session(await log.reader.events(writer.session_id))
    finally:
        await resumed.close()


def _result(call: dict[str, Any]) -> dict[str, Any]:
    block = {"type": "tool-result", "toolCallId": call["callId"], "content": [{"type": "text", "text": "late"}]}
    message = {"id": "late", "role": "user", "source": {"kind": "tool", "callId": call["callId"]}, "content": [block]}
    return {"turn": call["turn"], "step": call["step"], "message": message}


async def test_the_repairer_leaves_a_live_writer_alone(stack: Stack) -> None:
    await stack.repairer()
    # A 4 s lease, refreshed every second: a refresh that comes late on a busy machine does not lose it (and a lost
    # lease would rightly have the turn closed).
    ttl_s = 4.0
    log = await stack.connect(lease_ttl_s=ttl_s)
    writer = await stack.create(log)
    await open_turn(writer, [("c1", True)])
    length = writer.next_seq
    # A long tool body: the writer lives on through its refreshes past the lease's TTL, and the repairer, which
    # closes a turn once its lease expired, has had its grace three times over.
    await outlived_its_ttl(writer)
    await asyncio.sleep(GRACE_S * 3)
    assert len(await log.reader.events(writer.session_id)) == length, "nothing appended while the writer lives"
    result = _result({"turn": 1, "step": 1, "callId": "c1"})
    await writer.emit("tool/result", result, surface_op="append", source_event_seqs=[length - 1])
    await writer.emit("step/end", {"turn": 1, "step": 1})
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await writer.close()
    await asyncio.sleep(LEASE_TTL_S + GRACE_S * 2)
    events = await log.reader.events(writer.session_id)
    assert len(events) == length + 3 and b"interrupted" not in b"".join(events)


async def test_a_writer_that_parks_its_lease_with_the_turn_open_is_left_alone_and_taken_over(stack: Stack) -> None:
    """A writer that lets go on purpose while its turn waits for the client (record mode's gateway, idle or
    restarting while a tool runs) parks its lease: the repairer does not close the turn (it closed it as if the
    writer had died, found probing record mode 2026-12-05); the parked lease never expires; the next writer takes it
    over (a new epoch) and the turn goes on; the repairer's own close still can."""
    service = await stack.repairer()
    log = await stack.connect()
    writer = await stack.create(log)
    await open_turn(writer, [("c1", True)])
    length, epoch = writer.next_seq, writer.epoch
    await writer.close(park=True)
    parked = await log.leases.current(writer.session_id)
    assert parked is not None and parked.parked and parked.holder.startswith("parked:")
    await asyncio.sleep(LEASE_TTL_S + GRACE_S * 4)  # past the lease's TTL and the repairer's grace, several rounds
    assert len(await log.reader.events(writer.session_id)) == length, "the parked session's turn was closed"
    assert (await log.leases.current(writer.session_id)) == parked  # it did not expire
    again = await log.open(writer.session_id, continue_open_turn=True)
    assert again.epoch > epoch
    result = _result({"turn": 1, "step": 1, "callId": "c1"})
    await again.emit("tool/result", result, surface_op="append", source_event_seqs=[length - 1])
    await again.emit("step/end", {"turn": 1, "step": 1})
    await again.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await again.close()
    events = await log.reader.events(writer.session_id)
    assert b"interrupted" not in b"".join(events) and Session(events).open_turn is None
    # Parked again with a turn open: an operator's close (the repair command) still closes it.
    third = await log.open(writer.session_id)
    await open_turn(third, [("c2", True)])
    await third.close(park=True)
    assert codes(list(await service.close(writer.session_id))) == ["TOOL_OUTCOME_UNKNOWN", "step/end", "turn/end"]


async def test_a_repairer_started_after_the_writer_died_closes_the_turn(stack: Stack) -> None:
    log = await stack.connect()
    writer = await stack.create(log)
    await open_turn(writer, [("c1", False)])
    prefix = await log.reader.events(writer.session_id)
    await writer.abandon()
    await lease_free(log, writer.session_id)
    await stack.repairer()  # finds the open turn from the session list at start
    closers = await repaired(log, writer.session_id, len(prefix))
    assert closers == list(interrupted_turn_closers(Session(prefix)))


# ---------------------------------------------------------------------------------------------- races


async def test_two_repairers_racing_land_one_copy(stack: Stack) -> None:
    a = await stack.repairer()
    b = await stack.repairer()
    log = await stack.connect()
    writers = [await stack.create(log) for _ in range(6)]
    prefixes = {}
    for i, writer in enumerate(writers):
        await open_turn(writer, [("c1", True), ("c2", i % 2 == 0)])
        prefixes[writer.session_id] = await log.reader.events(writer.session_id)
        await writer.abandon()
    for writer in writers:
        await lease_free(log, writer.session_id)

    async def close(service: RepairerService, session_id: str) -> int:
        with contextlib.suppress(SessionLogError):  # LEASE_HELD while the other one closes it
            return len(await service.close(session_id))
        return -1

    # Both replicas' endpoints and both watch loops, all at once, for every session.
    results = await asyncio.gather(
        *(close(s, w.session_id) for w in writers for s in (a, b, a, b)),
        *(call(log.nc, CLOSE, {"session": w.session_id}, timeout=WAIT_S) for w in writers),
        return_exceptions=True,
    )
    assert not [r for r in results if isinstance(r, BaseException) and not isinstance(r, SessionLogError)], results
    for writer in writers:
        sid = writer.session_id
        prefix = prefixes[sid]
        closers = await repaired(log, sid, len(prefix))
        assert closers == list(interrupted_turn_closers(Session(prefix))), f"{sid}: exactly one copy of the closers"
        landed = [n for s, n in (*a.repaired, *b.repaired) if s == sid]
        assert landed == [len(closers)], f"{sid}: landed {landed}"
    await asyncio.sleep(GRACE_S * 3)  # and the watch loops, running on, add nothing
    for writer in writers:
        assert len(await log.reader.events(writer.session_id)) == len(prefixes[writer.session_id]) + len(
            interrupted_turn_closers(Session(prefixes[writer.session_id]))
        )


async def test_the_same_closers_under_the_same_message_id_land_once(stack: Stack) -> None:
    """The closers are deterministic and published under epoch 0, so two repairers that both passed the lease
    (one stalled past its TTL) publish the same record under the same message id: one copy lands."""
    log = await stack.connect()
    other = await stack.connect()
    writer = await stack.create(log)
    await open_turn(writer, [("c1", True)])
    await writer.abandon()
    records = await log.reader.records(writer.session_id)
    session = Session([e for r in records for e in r.events])
    closers = list(interrupted_turn_closers(session))
    last = records[-1].stream_seq

    async def publish(via: SessionLog) -> int | str:
        try:
            return await via.store.publish(writer.session_id, closers, len(session), last, 0, epoch=0)
        except SessionLogError as err:
            return err.code

    first, second = await asyncio.gather(publish(log), publish(other))
    landed = [r for r in (first, second) if isinstance(r, int)]
    assert landed and all(r == landed[0] for r in landed), (first, second)
    assert all(r == "CONFLICT" for r in (first, second) if isinstance(r, str))
    again = await publish(other)  # a retry within the duplicate window is told it landed, nothing is doubled
    assert again == landed[0] or again == "CONFLICT"
    assert await log.reader.events(writer.session_id) == [e for r in records for e in r.events] + closers


async def _die(service: RepairerService) -> None:
    """A repairer's process dies: its watch loop and consumers stop mid-work, its connection drops, nothing is
    released (its partition leases expire on the server)."""
    await service.abort()
    await service.log.nc.close()


async def test_a_repairer_that_takes_over_a_partition_closes_turns_opened_before_the_takeover(stack: Stack) -> None:
    a = await stack.repairer()
    b = await stack.repairer()

    async def split() -> bool:
        return len(a.runner.owned) == len(b.runner.owned) == 4

    await eventually(split, "the repairers split the partitions")
    log = await stack.connect()
    sid = next(s for s in (new_session_id() for _ in range(1000)) if a.runner.owns(s))
    writer = await stack.create(log, sid)
    await open_turn(writer, [("c1", True)])  # a long tool body: the writer lives on
    prefix = await log.reader.events(sid)
    kv = await log.js.key_value(log.settings.kv_checkpoints)
    number = partition_of(sid, a.runner.partition_count)

    async def checkpointed() -> bool:
        with contextlib.suppress(Exception):
            entry = await kv.get(f"repairer.p{number}")
            return int(json.loads(entry.value)["stream_seq"]) >= writer.last_stream_seq
        return False

    await eventually(checkpointed, "a's checkpoint covers the open turn")
    await _die(a)  # a rolling restart, say: the turn is still open and its writer still alive

    async def took_over() -> bool:
        return b.runner.owns(sid)

    await eventually(took_over, "b takes over a's partitions")
    await writer.abandon()  # now the writer dies
    closers = await repaired(log, sid, len(prefix), timeout=LEASE_TTL_S + GRACE_S + 5)
    assert closers == list(interrupted_turn_closers(Session(prefix)))


# ---------------------------------------------------------------------------------------------- endpoint


async def test_close_refuses_while_a_writer_lives_and_answers_no_closers_for_a_closed_session(stack: Stack) -> None:
    await stack.repairer(repair_grace_s=60.0)  # the watch loop waits; only the endpoint acts here
    log = await stack.connect()
    writer = await stack.create(log)
    await open_turn(writer, [("c1", True), ("c2", False)])
    prefix = await log.reader.events(writer.session_id)

    with pytest.raises(SessionLogError) as refused:
        await call(log.nc, CLOSE, {"session": writer.session_id}, timeout=WAIT_S)
    assert refused.value.code == "LEASE_HELD"
    assert await log.reader.events(writer.session_id) == prefix

    await writer.abandon()
    await lease_free(log, writer.session_id)
    reply = await call(log.nc, CLOSE, {"session": writer.session_id}, timeout=WAIT_S)
    expected = list(interrupted_turn_closers(Session(prefix)))
    assert reply["session"] == writer.session_id
    assert [msgspec.json.encode(c) for c in reply["closers"]] == expected
    assert await log.reader.events(writer.session_id) == prefix + expected
    assert await call(log.nc, CLOSE, {"session": writer.session_id}, timeout=WAIT_S) == {
        "session": writer.session_id,
        "closers": [],
    }, "a second close appends nothing"

    done = await stack.create(log)
    await closed_turn(done)
    await done.close()
    reply = await call(log.nc, CLOSE, {"session": done.session_id}, timeout=WAIT_S)
    assert reply == {"session": done.session_id, "closers": []}

    for payload, code in [
        (b"not json", "INVALID_REQUEST"),
        (b"{}", "INVALID_REQUEST"),
        (b'{"session": 3}', "INVALID_REQUEST"),
        (b'{"session": "a b"}', "INVALID_SESSION_ID"),
        (json.dumps({"session": new_session_id("absent")}).encode(), "SESSION_NOT_FOUND"),
    ]:
        answer = await log.nc.request(CLOSE, payload, timeout=WAIT_S)
        assert (answer.headers or {}).get(ERROR_CODE_HEADER) == code, payload
    assert await call(log.nc, CLOSE, {"session": done.session_id}, timeout=WAIT_S) == reply, "still serving"


async def test_the_repair_session_command_closes_a_session(stack: Stack, tmp_path: Path) -> None:
    await stack.repairer(repair_grace_s=60.0)
    log = await stack.connect()
    writer = await stack.create(log)
    await open_turn(writer, [("c1", False)])
    prefix = await log.reader.events(writer.session_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(SESSIONLOG_NATS_URL=stack.url, SESSIONLOG_METRICS_PORT="0")

    def run() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "sessionlog", "repair-session", writer.session_id],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=60,
        )

    held = await asyncio.to_thread(run)
    assert held.returncode == 1 and b"error LEASE_HELD" in held.stderr, held

    await writer.abandon()
    await lease_free(log, writer.session_id)
    done = await asyncio.to_thread(run)
    assert done.returncode == 0, done
    assert done.stdout.splitlines() == list(interrupted_turn_closers(Session(prefix)))
    assert f"{writer.session_id}: 3 closers appended".encode() in done.stderr
    again = await asyncio.to_thread(run)
    assert again.returncode == 0 and again.stdout == b"" and b"0 closers appended" in again.stderr
