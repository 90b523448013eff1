"""The synchronous facade (`sessionlog.sync`) against a real nats-server.

What it promises: a caller that blocks its own thread for longer than the lease TTL (a synchronous model call)
keeps its lease, because the lease is refreshed on the facade's own loop thread; create, open and resume work
as in the async API, and a refusal reaches the caller as the same typed error, with nothing written.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from natsfixtures import log_settings, new_session_id
from scaffold import LEASE_TTL_S, WAIT_S
from sessiongen import user_message_data

from sessionlog.embedded import EmbeddedServer
from sessionlog.errors import SessionLogError
from sessionlog.sync import SyncSessionLog, SyncSessionWriter

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration]


@pytest.fixture
def sync_log(fresh_server: EmbeddedServer) -> Iterator[SyncSessionLog]:
    log = SyncSessionLog(log_settings(fresh_server.url, lease_ttl_s=LEASE_TTL_S))
    try:
        yield log
    finally:
        log.close()


def closed_turn(writer: SyncSessionWriter, text: str) -> list[bytes]:
    turn = writer.session.last_turn + 1
    events = [
        writer.emit("turn/start", {"turn": turn}),
        writer.emit("user/message", user_message_data(text, f"u{turn}"), surface_op="append"),
        writer.emit("turn/end", {"turn": turn, "reason": {"kind": "completed"}}),
    ]
    return [e.raw for e in events]


def test_a_caller_that_blocks_longer_than_the_lease_ttl_keeps_its_lease_and_writes_on(
    sync_log: SyncSessionLog,
) -> None:
    sid = new_session_id()
    writer = sync_log.create(sid)
    written = closed_turn(writer, "Before the blocking call.")
    assert writer.flush() == len(written) - 1

    time.sleep(LEASE_TTL_S * 3)  # a synchronous model call: this thread does nothing else meanwhile

    written += closed_turn(writer, "After the blocking call.")
    assert writer.flush() == len(written) - 1
    held = sync_log.run(sync_log.log.leases.current(sid))
    assert held is not None and held.epoch == writer.epoch, "the lease is still this writer's"
    _, session, _ = sync_log.load(sid)
    assert [e.raw for e in session] == written


def test_create_open_and_resume_work_and_a_refusal_keeps_its_code_and_writes_nothing(
    sync_log: SyncSessionLog,
) -> None:
    sid = new_session_id()
    with sync_log.create(sid, cwd="/work") as writer:
        written = closed_turn(writer, "First.")
        with pytest.raises(SessionLogError) as refused:
            writer.emit("step/start", {"turn": 9, "step": 1})  # no turn 9 is open
        assert refused.value.code == "STRUCTURE_INVALID"
        with pytest.raises(SessionLogError) as held:
            sync_log.open(sid)
        assert held.value.code == "LEASE_HELD"

    with sync_log.open(sid) as writer:
        written += closed_turn(writer, "Second.")
        writer.emit("turn/start", {"turn": 3})
        writer.flush()
        writer.abandon()  # dies with turn 3 open

    deadline = time.monotonic() + WAIT_S
    while sync_log.run(sync_log.log.leases.current(sid)) is not None:  # its lease expires
        assert time.monotonic() < deadline, "the abandoned writer's lease did not expire"
        time.sleep(0.05)
    resumed = sync_log.resume(sid)
    events = [e.raw for e in resumed.session]
    assert events[: len(written)] == written
    assert resumed.session.open_turn is None, "resume closed the turn a crash left open"
    resumed.close()
