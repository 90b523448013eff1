"""Fault isolation (issue 11, items 1-4) against real nats-server processes, real faults and real services.

What the system promises: one bad record or one bad session never stops anything else. A record a projection
cannot apply, whatever the exception, is quarantined and its partition goes on; the writer refuses events nested
deeper than `MAX_EVENT_DEPTH`; a consumer that fails is restarted and readiness says so meanwhile; a reload that
meets an unavailable log is retried, never quarantined; an undecodable or foreign-format record makes its
session listed as corrupt (listing, the UI and the repairer's start-up go on), and the repairer backs off on a
session it cannot repair; a record under a session id the API refuses is quarantined by every projection; an
operator lists quarantined records and sees why a session is unreadable (`sessionlog quarantine`).

Bad records are published the way any writer the deploy permissions allow could: raw nats-py requests to
`sessionlog.in.<id>`. Tests that leave poison in the stream take a server of their own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from natsfixtures import log_settings, new_session_id
from prometheus_client import REGISTRY
from scaffold import LEASE_TTL_S, WAIT_S, eventually, freeze
from sessiongen import closed_turn
from test_context_deriver import ServiceProcess
from test_repairer import open_turn
from test_runner import (
    ALL,
    CheckedDeriver,
    CheckedState,
    Harness,
    closed_turn_events,
    ids_in_partition,
    projection_name,
)

from services import stack as stack_module
from services.repairer.service import RepairerService
from services.stack import Stack
from services.ui_replayer.service import UIReplayerService
from sessionlog.embedded import EmbeddedServer, free_port
from sessionlog.errors import SessionLogError
from sessionlog.events import MAX_EVENT_DEPTH
from sessionlog.record import Record, encode_payload, in_subject, record_headers
from sessionlog.runner import ProjectionRunner

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

PROJECTIONS = ["context-deriver", "repairer", "token-auditor", "ui-replayer"]
GRACE_S = 0.3


# ---------------------------------------------------------------------------------------------- helpers


def nested(depth: int) -> Any:
    """A JSON value of `depth` nested arrays."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def nested_bytes(depth: int) -> bytes:
    """`nested(depth)` as JSON, written out by hand (an encoder may not reach that deep)."""
    return b"[" * depth + b"]" * depth


def title_event(seq: int, depth: int) -> bytes:
    """A `session/title` event whose `title` is `depth` nested arrays (the event itself is `depth + 2` deep)."""
    return b'{"seq":%d,"time":1,"type":"session/title","data":{"title":%s}}' % (seq, nested_bytes(depth))


async def publish(url: str, session_id: str, payload: bytes, headers: dict[str, str] | None = None) -> int:
    """What any writer the deploy permissions allow can do: one raw nats-py request to `sessionlog.in.<id>`."""
    nc = await nats.connect(url)
    try:
        reply = await nc.request(in_subject(session_id), payload, headers=headers, timeout=5)
    finally:
        await nc.close()
    body = json.loads(reply.data)
    assert "error" not in body, body
    return int(body["seq"])


async def publish_events(
    url: str, session_id: str, events: list[bytes], first_seq: int, *, expected_last: int = 0, **header: str
) -> int:
    """A record with well-formed headers (`header` overrides some) carrying `events` from `first_seq`."""
    payload = encode_payload(events)
    headers = record_headers(
        session_id=session_id,
        first_seq=first_seq,
        count=len(events),
        epoch=0,
        payload=payload,
        expected_last=expected_last,
        open_turn=0,
    )
    headers.update({k.replace("_", "-"): v for k, v in header.items()})
    return await publish(url, session_id, payload, headers)


def settings_for(url: str, **overrides: Any) -> Any:
    return log_settings(
        url,
        partitions="0-7",
        lease_ttl_s=LEASE_TTL_S,
        repair_grace_s=GRACE_S,
        metrics_port=free_port(),
        ui_port=free_port(),
        **overrides,
    )


@pytest_asyncio.fixture(loop_scope="module")
async def own(fresh_server: EmbeddedServer) -> AsyncIterator[tuple[EmbeddedServer, Harness]]:
    async with Harness() as opened:
        yield fresh_server, opened


def http_json(port: int, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def http_text(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
        assert reply.status == 200
        return str(reply.read().decode())


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env["SESSIONLOG_NATS_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "sessionlog", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---------------------------------------------------------------------------------------------- 1. nesting


async def test_the_writer_refuses_an_event_nested_deeper_than_the_limit_and_queues_nothing(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    server, harness = own
    log = await harness.connect(server.url)
    writer = await harness.create(log)
    await closed_turn(writer)
    before = writer.next_seq
    for depth in (MAX_EVENT_DEPTH + 1, 980, 5000):
        with pytest.raises(SessionLogError) as refused:
            await writer.emit("session/title", {"title": nested(depth)})
        assert refused.value.code == "EVENT_TOO_DEEP", refused.value
        assert str(MAX_EVENT_DEPTH) in refused.value.message
        assert writer.next_seq == before
        with pytest.raises(SessionLogError) as refused:
            await writer.append(title_event(before, depth))
        assert refused.value.code == "EVENT_TOO_DEEP"
    # At the limit (the envelope and `data` count as two levels) it is accepted, and the writer goes on.
    await writer.emit("session/title", {"title": nested(MAX_EVENT_DEPTH - 2)})
    await closed_turn(writer)
    await writer.flush()
    events = await log.reader.events(writer.session_id)
    assert len(events) == writer.next_seq == before + 7
    assert [json.loads(e)["type"] for e in events[before : before + 1]] == ["session/title"]


async def test_a_deeply_nested_record_is_quarantined_by_every_projection_and_its_partition_goes_on(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    server, harness = own
    settings = settings_for(server.url)
    stack = await Stack.start(PROJECTIONS, settings)
    try:
        for handle in stack.handles.values():
            await handle.runner.wait_ready(WAIT_S)  # type: ignore[attr-defined]
        bad, healthy = ids_in_partition(2, 2)
        # 980 levels: the RecursionError of the report, deeper than Python's stack allows while applying.
        bad_seq = await publish_events(server.url, bad, [title_event(0, 980)], 0)
        log = await harness.connect(server.url)
        writer = await harness.create(log, healthy)
        await closed_turn(writer)
        await writer.flush()
        for name, handle in stack.handles.items():
            runner = handle.runner  # type: ignore[attr-defined]
            state = await runner.wait_for(healthy, writer.durable_seq, timeout=WAIT_S)
            assert state.next_seq == writer.next_seq, name

            async def consumed(runner: Any = runner) -> bool:  # by the partition's consumer, not a load on demand
                return bool(runner.feeds[2].applied >= writer.last_stream_seq)

            await eventually(consumed, f"{name}: partition 2 consumed past the bad record")
            reasons = {q.stream_seq: q.reason for q in runner.quarantined}
            assert bad_seq in reasons and reasons[bad_seq].startswith("EVENT_TOO_DEEP"), (name, reasons)
            assert bad not in runner.states, name
        assert stack.health is not None
        status, report = await asyncio.to_thread(http_json, stack.health.port, "/readyz")
        assert status == 200, report
        for name in PROJECTIONS:
            component = report["components"][name]
            assert component["stalled"] == [] and component["quarantined"] >= 1, (name, component)
            assert bad_seq in [q["stream_seq"] for q in component["quarantine"]], (name, component)
        # A restart meets the same record again: still quarantined, and still consuming.
    finally:
        await stack.stop()
    restarted = await Stack.start(PROJECTIONS, settings_for(server.url))
    try:
        for name, handle in restarted.handles.items():
            runner = handle.runner  # type: ignore[attr-defined]
            await runner.wait_ready(WAIT_S)
            assert bad_seq in {q.stream_seq for q in runner.quarantined}, name  # what the checkpoint bucket kept
            state = await runner.wait_for(healthy, writer.durable_seq, timeout=WAIT_S)
            assert state.next_seq == writer.next_seq
    finally:
        await restarted.stop()


class FragileState(CheckedState):
    """A projection with a bug: a `session/title` whose title is not a string makes `apply` divide by zero."""

    def apply(self, record: Record) -> None:
        for raw in record.events:
            event = json.loads(raw)
            if event["type"] == "session/title" and not isinstance(event["data"].get("title"), str):
                _ = 1 / 0
        super().apply(record)


class FragileDeriver(CheckedDeriver):
    def new_state(self, session_id: str) -> FragileState:
        return FragileState(session_id)


async def test_a_record_whose_applying_raises_anything_is_quarantined_and_the_partition_goes_on(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    server, harness = own
    log = await harness.connect(server.url)
    runner_log = await harness.connect(server.url)
    runner = harness.keep_runner(ProjectionRunner(runner_log, FragileDeriver(projection_name()), partitions=ALL))
    await runner.start()
    await runner.wait_ready(WAIT_S)
    bad, healthy = ids_in_partition(6, 2)
    writer = await harness.create(log, bad)
    await closed_turn(writer)
    await writer.emit("session/title", {"title": ["not", "a", "string"]})
    await writer.flush()
    bad_seq = writer.last_stream_seq
    other = await harness.create(log, healthy)
    await closed_turn(other)
    await other.flush()

    async def consumed() -> bool:
        return runner.feeds[6].applied >= other.last_stream_seq

    await eventually(consumed, "partition 6 consumed past the record that raised")
    state = runner.states.get(healthy)
    assert state is not None and state.next_seq == other.next_seq
    reasons = {q.stream_seq: q.reason for q in runner.quarantined}
    assert reasons.get(bad_seq, "").startswith("ZeroDivisionError"), reasons
    assert runner.health()["ready"] and runner.health()["stalled"] == []
    with pytest.raises(SessionLogError) as refused:
        await runner.state(bad)
    assert refused.value.code == "CORRUPT_LOG"


async def test_a_consumer_that_loses_the_server_is_not_ready_is_restarted_and_resumes(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    server, harness = own
    runner = await harness.runner(server.url, partitions=ALL)
    await runner.wait_ready(WAIT_S)
    assert runner.health()["ready"] and runner.health()["stalled"] == []

    server.kill()

    async def not_ready() -> bool:
        health = runner.health()
        return not health["ready"] and health["stalled"] == ALL

    await eventually(not_ready, "readiness reports the partitions that are not consumed")
    server.restart()

    async def ready() -> bool:
        return bool(runner.health()["ready"])

    await eventually(ready, "consumed again after the server came back", timeout=30)
    # Ready means consumed: each partition's consumer answered on the new connection (it exists).
    consumers = {c.name for c in await runner.log.js.consumers_info(runner.settings.stream)}
    assert consumers >= {f"{runner.name}-p{n}" for n in ALL}, consumers

    # The consumer deleted under the runner (an operator's mistake): the failure is counted, the consumer started
    # again, and the partition's records still reach the projection through it.
    def restarts() -> float:
        return metric("sessionlog_projection_consumer_restarts_total", projection=runner.name, partition="5")

    before = restarts()
    await runner.log.js.delete_consumer(runner.settings.stream, f"{runner.name}-p5")

    async def restarted() -> bool:
        return restarts() > before

    await eventually(restarted, "the failed consumer is counted and started again")
    log = await harness.connect(server.url)
    (session_id,) = ids_in_partition(5, 1)
    writer = await harness.create(log, session_id)
    await closed_turn(writer)
    await writer.flush()

    async def consumed() -> bool:
        return runner.feeds[5].applied >= writer.last_stream_seq and bool(runner.health()["ready"])

    await eventually(consumed, "partition 5 consumed again")
    assert runner.quarantined == []


# ---------------------------------------------------------------------------------------------- 2. transient


async def test_a_reload_that_meets_a_paused_server_is_retried_not_quarantined(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    server, harness = own
    log = await harness.connect(server.url)
    session_id, other = ids_in_partition(4, 2)
    writer = await harness.create(log, session_id)
    await closed_turn(writer)
    await writer.flush()
    # One session in memory at most, and a short request timeout: a pause of a few seconds is an outage to it.
    runner = await harness.runner(server.url, partitions=[4], max_sessions=1, connection={"request_timeout_s": 1.0})
    await runner.wait_ready(WAIT_S)
    await runner.wait_for(session_id, writer.durable_seq, timeout=WAIT_S)
    evictor = await harness.create(log, other)
    await closed_turn(evictor)
    await evictor.flush()
    await runner.wait_for(other, evictor.durable_seq, timeout=WAIT_S)
    assert session_id not in runner.states  # evicted: its next record makes the runner reload it

    real = runner.log.reader.records
    paused: list[int] = []
    assert server.pid is not None
    pid = server.pid

    async def pause_during_reload(sid: str, **kwargs: Any) -> Any:
        if sid == session_id and not paused:
            paused.append(pid)
            await freeze(pid)  # the server stops answering right as the reload asks it
            asyncio.get_running_loop().call_later(3.0, os.kill, pid, signal.SIGCONT)
        return await real(sid, **kwargs)

    runner.log.reader.records = pause_during_reload  # type: ignore[method-assign]
    await closed_turn(writer)
    await writer.flush()

    async def caught_up() -> bool:  # watched, not asked: a query during the pause would rightly fail
        state = runner.states.get(session_id)
        return state is not None and state.next_seq == writer.next_seq

    await eventually(caught_up, "the record applied once the server answers again", timeout=30)
    assert paused, "the reload ran into the pause"
    state = await runner.state(session_id)
    assert state is not None and state.next_seq == writer.next_seq
    assert runner.quarantined == [] and session_id not in runner.poisoned


# ---------------------------------------------------------------------------------------------- 3. corrupt sessions


async def corrupt_sessions(url: str, harness: Harness) -> tuple[str, str, str]:
    """A healthy session, one whose last record is 12 garbage bytes, one whose last record has an unknown
    `Sessionlog-Format`; each with a header and a closed turn before the bad record."""
    log = await harness.connect(url)
    ids = [new_session_id("ok"), new_session_id("garbage"), new_session_id("format")]
    for session_id in ids:
        writer = await harness.create(log, session_id)
        await closed_turn(writer)
        await writer.flush()
        await writer.close()
    await publish(url, ids[1], b"\x00garbage\xff\xfe\x01!")  # 12 bytes
    last = await log.reader.last_record(ids[2])
    assert last is not None
    events = closed_turn_events(6, 2)
    await publish_events(url, ids[2], events, 6, expected_last=last.stream_seq, Sessionlog_Format="2")
    return ids[0], ids[1], ids[2]


async def test_listing_reports_a_session_with_an_undecodable_record_as_corrupt_and_lists_the_others(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    server, harness = own
    healthy, garbage, foreign = await corrupt_sessions(server.url, harness)
    log = await harness.connect(server.url)
    infos = {i.id: i for i in await log.sessions()}
    assert set(infos) == {healthy, garbage, foreign}
    assert infos[healthy].error is None and infos[healthy].events == 6
    assert infos[garbage].error is not None and infos[garbage].error.startswith("CORRUPT_LOG")
    assert infos[foreign].error is not None and "Sessionlog-Format" in infos[foreign].error

    done = await asyncio.to_thread(cli, server.url, "sessions", "--json")
    assert done.returncode == 0, done.stderr
    lines = {row["id"]: row for row in map(json.loads, done.stdout.splitlines())}
    assert lines[garbage]["error"].startswith("CORRUPT_LOG") and lines[healthy]["error"] is None
    table = await asyncio.to_thread(cli, server.url, "sessions")
    assert table.returncode == 0 and "CORRUPT_LOG" in table.stdout, table.stdout + table.stderr

    ui_log = await harness.connect(server.url)
    ui = UIReplayerService(ui_log, host="127.0.0.1", port=0, partitions=[])
    harness.keep_service(ui)
    await ui.start()
    status, body = await asyncio.to_thread(http_json, ui.port, "/api/sessions")
    assert status == 200, body
    listed = {row["id"]: row for row in body}
    assert listed[garbage]["error"].startswith("CORRUPT_LOG") and listed[healthy]["error"] is None
    page = await asyncio.to_thread(http_text, ui.port, "/")
    assert garbage in page and "CORRUPT_LOG" in page and healthy in page


async def test_the_repairer_starts_past_a_corrupt_session_and_still_repairs_the_others(
    own: tuple[EmbeddedServer, Harness], tmp_path: Path
) -> None:
    server, harness = own
    _, garbage, foreign = await corrupt_sessions(server.url, harness)
    log = await harness.connect(server.url)
    dead = await harness.create(log)
    length = await open_turn(dead, [("c1", True)])
    await dead.abandon()  # a writer that died with its turn open
    process = ServiceProcess("repairer", server.url, tmp_path, SESSIONLOG_REPAIR_GRACE_S=str(GRACE_S))
    try:
        process.start()
        report = await process.wait_ready()
        corrupt = report["components"]["repairer"]["corrupt"]
        assert set(corrupt) == {garbage, foreign} and corrupt[garbage].startswith("CORRUPT_LOG"), corrupt

        async def closed() -> bool:
            events = await log.reader.events(dead.session_id)
            return len(events) > length + 1

        await eventually(closed, "the healthy session with an open turn is repaired", timeout=WAIT_S * 2)
        assert process.proc is not None and process.proc.poll() is None, process.output()
    finally:
        process.stop()


async def test_the_repairer_claims_and_reports_before_its_listing_of_every_session_ends(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    """The listing of every session's last record grows with the fleet; a replica does not wait for it to claim its
    partitions, answer its endpoints and report its health, and says it is not ready until the listing is done."""
    server, harness = own
    log = await harness.connect(server.url, repair_grace_s=GRACE_S)
    dead = await harness.create(log)
    length = await open_turn(dead, [("c1", True)])
    await dead.abandon()  # a writer that died with its turn open, before the repairer started
    listing = asyncio.Event()

    class SlowListing(RepairerService):
        async def _learn_open_turns(self) -> None:
            await listing.wait()
            await super()._learn_open_turns()

    repairer = harness.keep_service(SlowListing(await harness.connect(server.url, repair_grace_s=GRACE_S)))
    await asyncio.wait_for(repairer.start(), WAIT_S)  # started while the listing waits

    async def claimed() -> bool:
        return bool(repairer.health()["partitions"])

    await eventually(claimed, "the repairer claims partitions while its listing waits")
    health = repairer.health()
    assert health["open_turns_learned"] is False and health["ready"] is False
    listing.set()

    async def closed() -> bool:
        return repairer.health()["ready"] is True and len(await log.reader.events(dead.session_id)) > length + 1

    await eventually(closed, "the listing ends, the repairer is ready and closes the turn", timeout=WAIT_S * 2)


async def test_the_repairer_backs_off_on_a_session_it_cannot_repair(
    own: tuple[EmbeddedServer, Harness], caplog: pytest.LogCaptureFixture
) -> None:
    server, harness = own
    log = await harness.connect(server.url, repair_grace_s=GRACE_S)
    repairer = harness.keep_service(RepairerService(await harness.connect(server.url, repair_grace_s=GRACE_S)))
    caplog.set_level(logging.WARNING, logger="sessionlog.repairer")
    await repairer.start()
    await repairer.runner.wait_ready(WAIT_S)
    broken = await harness.create(log)
    await open_turn(broken, [("c1", True)])
    await broken.abandon()  # its writer died with the turn open ...
    # ... and 12 bytes follow the open turn (long before its lease expires): the closers cannot be computed.
    await publish(server.url, broken.session_id, b"twelve bytes")

    async def tried() -> bool:
        return any(broken.session_id in r.getMessage() for r in caplog.records)

    await eventually(tried, "the repairer tries the session once")
    caplog.clear()
    await asyncio.sleep(3.0)  # a window in which a watch loop without backoff tries about 20 times
    attempts = [r.getMessage() for r in caplog.records if broken.session_id in r.getMessage()]
    assert len(attempts) <= 3, attempts
    assert repairer.health()["unrepairable"][broken.session_id]["error"].startswith("CORRUPT_LOG")
    lease = await log.leases.current(broken.session_id)
    assert lease is None, "the repairer does not hold the lease of a session it cannot repair"


# ---------------------------------------------------------------------------------------------- 4. foreign ids


async def test_a_record_under_an_id_the_api_refuses_is_quarantined_by_every_projection_and_listed(
    own: tuple[EmbeddedServer, Harness],
) -> None:
    server, harness = own
    await harness.connect(server.url)  # provisions the stream
    foreign = "no$such" + "x" * 130  # one subject token, but not an id the API accepts
    events = closed_turn_events(0, 1)
    foreign_seq = await publish_events(server.url, foreign, events, 0)
    healthy, garbage, _ = await corrupt_sessions(server.url, harness)
    stack = await Stack.start(PROJECTIONS, settings_for(server.url))
    try:
        for name, handle in stack.handles.items():
            runner = handle.runner  # type: ignore[attr-defined]
            await runner.wait_ready(WAIT_S)
            reasons = {q.stream_seq: q.reason for q in runner.quarantined}
            assert reasons.get(foreign_seq, "").startswith("INVALID_SESSION_ID"), (name, reasons)
            assert foreign not in runner.states, name
    finally:
        await stack.stop()

    done = await asyncio.to_thread(cli, server.url, "quarantine", "list", "--json")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {r["projection"] for r in rows if r["stream_seq"] == foreign_seq} == set(PROJECTIONS)
    table = await asyncio.to_thread(cli, server.url, "quarantine", "list")
    assert table.returncode == 0 and "INVALID_SESSION_ID" in table.stdout, table.stdout + table.stderr

    why = await asyncio.to_thread(cli, server.url, "quarantine", "check", garbage)
    assert why.returncode == 1, why.stdout + why.stderr
    assert "CORRUPT_LOG" in why.stdout and "not a sessionlog record" in why.stdout, why.stdout
    fine = await asyncio.to_thread(cli, server.url, "quarantine", "check", healthy)
    assert fine.returncode == 0 and "readable" in fine.stdout, fine.stdout + fine.stderr


async def test_a_stack_answers_health_while_its_services_start_live_and_not_ready(
    own: tuple[EmbeddedServer, Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A liveness probe must not kill a process that is starting: the health server answers from the first moment,
    each service live and not ready (`state: starting`) until it has started; ready once every one has."""
    server, _ = own
    settings = settings_for(server.url)
    gate = asyncio.Event()
    real = stack_module.factory

    def gated(name: str) -> Any:
        start = real(name)

        async def slow(log: Any, options: Any) -> Any:
            if name == "repairer":
                await gate.wait()
            return await start(log, options)

        return slow

    monkeypatch.setattr(stack_module, "factory", gated)
    starting = asyncio.create_task(Stack.start(["context-deriver", "repairer"], settings))
    port = settings.metrics_port

    async def first_started() -> bool:  # answering, and the context-deriver has started (its own health)
        try:
            _, report = await asyncio.to_thread(http_json, port, "/healthz")
        except OSError:
            return False
        return "quarantined" in report["components"]["context-deriver"]

    try:
        await eventually(first_started, "the health server answers while the services start")
        live, report = await asyncio.to_thread(http_json, port, "/healthz")
        ready, _ = await asyncio.to_thread(http_json, port, "/readyz")
        assert (live, ready) == (200, 503), report
        components = report["components"]
        assert components["repairer"] == {"live": True, "ready": False, "state": "starting"}, report
    finally:
        gate.set()
        stack = await asyncio.wait_for(starting, WAIT_S)
    try:

        async def ready_now() -> bool:
            return (await asyncio.to_thread(http_json, port, "/readyz"))[0] == 200

        await eventually(ready_now, "ready once every service started")
        _, report = await asyncio.to_thread(http_json, port, "/readyz")
        assert set(report["components"]) == {"context-deriver", "repairer"}
        assert all(c.get("state") != "starting" for c in report["components"].values()), report
    finally:
        await stack.stop()


async def test_a_stack_answers_health_while_it_waits_for_its_server_and_stops_answering_when_it_gives_up() -> None:
    settings = settings_for(f"nats://127.0.0.1:{free_port()}")  # nothing listens there
    port = settings.metrics_port
    starting = asyncio.create_task(Stack.start(["context-deriver"], settings))
    seen: list[tuple[int, Any]] = []

    async def answered() -> bool:
        try:
            seen.append(await asyncio.to_thread(http_json, port, "/healthz"))
        except OSError:
            return starting.done()
        return True

    try:
        await eventually(answered, "health answered while the server was being reached")
    finally:
        with pytest.raises(SessionLogError):
            await asyncio.wait_for(starting, 60)
    assert seen, "the health server never answered while the server was being reached"
    status, report = seen[0]
    assert status == 200 and report["components"]["context-deriver"]["state"] == "starting", report
    assert report["ready"] is False
    with pytest.raises(OSError):
        await asyncio.to_thread(http_json, port, "/healthz")  # given up: the health server stopped with it
