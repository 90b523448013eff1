"""The writer on a 3-node JetStream cluster with R3 streams: what it promises when nodes die.

Losing quorum: a flush is LOG_UNAVAILABLE within the request timeout and nothing unacknowledged is reported
durable; after the cluster recovers, every acknowledged event is there. Losing the stream leader only: the writer
retries within its budget until a new leader answers, and nothing is doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from natsfixtures import new_session_id, start_cluster
from scaffold import Opened, assert_contiguous, eventually, freeze, raws
from sessiongen import user_message_data

from services.context_deriver.service import ContextDeriverService, canonical_messages
from sessionlog.embedded import Cluster
from sessionlog.errors import LogUnavailable, SessionLogError
from sessionlog.events import Event
from sessionlog.jsonl import decode_header
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.micro import call
from sessionlog.provision import partition_of, resources, wait_until_served
from sessionlog.record import Record
from sessionlog.session import Session
from sessionlog.settings import Settings

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

RECOVERY_S = 45.0  # the bound of waiting for a restarted cluster to serve the stream again
HANG_S = 20.0  # added to a request timeout: a bound that only proves an operation did not hang


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of the test's own: these tests kill nodes."""
    nodes = start_cluster(tmp_path / "cluster")
    try:
        yield nodes
    finally:
        for server in nodes.servers:
            server.kill()


class Logs(Opened):
    """Connections and writers a test opened; stopped and closed when it ends, whatever state the cluster is in."""

    def __init__(self, url: str) -> None:
        super().__init__(url, replicas=3)

    async def connect(self, url: str | None = None, **overrides: Any) -> SessionLog:
        log = await super().connect(url, **overrides)
        await every_stream_has_a_leader(log)
        return log


@pytest_asyncio.fixture(loop_scope="module")
async def logs(cluster: Cluster) -> AsyncIterator[Logs]:
    async with Logs(cluster.url) as opened:
        yield opened


async def turn(writer: SessionWriter, text: str) -> list[bytes]:
    number = writer.session.last_turn + 1
    events: list[Event] = [
        await writer.emit("turn/start", {"turn": number}),
        await writer.emit("user/message", user_message_data(text, f"u{number}"), surface_op="append"),
        await writer.emit("turn/end", {"turn": number, "reason": {"kind": "completed"}}),
    ]
    return raws(events)


async def every_stream_has_a_leader(log: SessionLog, timeout: float = 30.0) -> None:
    """Provisioning returns when the R3 streams exist, not when each has elected a leader and answers direct
    gets; a write or a read in between fails (LOG_UNAVAILABLE: no responders). Wait for both."""
    try:
        await wait_until_served(log.nc, log.js, log.settings, timeout)
    except LogUnavailable as err:
        pytest.fail(str(err))


def connected_node(cluster: Cluster, log: SessionLog) -> int:
    url = log.nc.connected_url
    assert url is not None
    return next(i for i, server in enumerate(cluster.servers) if server.port == url.port)


def lose_quorum(cluster: Cluster, log: SessionLog) -> None:
    """Kill every node but the one `log` is connected to: no stream or the meta layer keeps a quorum."""
    survivor = connected_node(cluster, log)
    for i in range(len(cluster)):
        if i != survivor:
            cluster.kill(i)


async def stream_leader(cluster: Cluster, log: SessionLog) -> int:
    info = await log.js.stream_info(log.settings.stream)
    assert info.cluster is not None and info.cluster.leader
    return next(i for i, server in enumerate(cluster.servers) if server.server_name == info.cluster.leader)


async def connected_once_recovered(logs: Logs) -> SessionLog:
    """A new connection (which provisions, so every stream must answer), once the restarted cluster serves."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        try:
            return await logs.connect(request_timeout_s=5.0)
        except LogUnavailable:  # a stream without its leader yet
            if time.monotonic() > deadline:
                pytest.fail(f"the cluster did not serve every stream again within {RECOVERY_S}s")
        await asyncio.sleep(0.25)


async def records_once_recovered(log: SessionLog, session_id: str) -> list[Record]:
    """The session's records from the leader, once the stream answers again."""
    deadline = time.monotonic() + RECOVERY_S
    while True:
        try:
            last = await log.reader.leader_get(next_by_subj=f"sessionlog.events.*.{session_id}")
            if last is not None:
                return await log.reader.records(session_id)
        except Exception:  # no leader yet, or the connection still reconnecting
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the cluster did not serve the stream again within {RECOVERY_S}s")
        await asyncio.sleep(0.25)


async def test_losing_quorum_is_log_unavailable_and_every_acknowledged_event_survives(
    cluster: Cluster, logs: Logs
) -> None:
    timeout = 3.0
    log = await logs.connect(request_timeout_s=timeout, publish_retry_s=timeout, lease_ttl_s=60.0)
    sid = new_session_id()
    writer = logs.keep(await log.create(sid))
    acknowledged = await turn(writer, "Before.") + await turn(writer, "Still fine.")
    durable = await writer.flush()
    assert durable == len(acknowledged) - 1

    survivor = connected_node(cluster, log)
    doomed = [i for i in range(len(cluster)) if i != survivor]
    for i in doomed:
        cluster.kill(i)

    unacknowledged = await turn(writer, "Nobody can commit this.")
    with pytest.raises(LogUnavailable) as refused:
        await asyncio.wait_for(writer.flush(), timeout + 10)  # the bound proves a refusal, not a hang
    assert refused.value.code == "LOG_UNAVAILABLE"
    assert writer.durable_seq == durable, "nothing unacknowledged is reported durable"
    await writer.abandon()

    for i in doomed:
        await asyncio.to_thread(cluster.restart, i)
    reader = await connected_once_recovered(logs)
    records = await records_once_recovered(reader, sid)
    assert_contiguous(records)
    stored = [e for r in records for e in r.events]
    assert stored[: len(acknowledged)] == acknowledged, "every acknowledged event is there, in order"
    assert stored[len(acknowledged) :] in ([], unacknowledged), "the unacknowledged record landed whole or not at all"


async def lead_from(log: SessionLog, stream: str, server_name: str) -> None:
    """Move `stream`'s leader to the node `server_name` (a stepdown naming the preferred successor), so that one
    kill -9 takes the leaders of several streams at once."""
    deadline = time.monotonic() + 30.0
    while True:
        info = await log.js.stream_info(stream)
        if info.cluster is not None and info.cluster.leader == server_name:
            return
        with contextlib.suppress(Exception):
            await log.nc.request(
                f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                json.dumps({"placement": {"preferred": server_name}}).encode(),
                timeout=5.0,
            )
        if time.monotonic() > deadline:
            pytest.fail(f"{stream}'s leader did not move to {server_name}")
        await asyncio.sleep(0.5)


async def test_with_default_settings_writers_ride_through_a_kill_9_of_the_stream_and_lease_leader(
    cluster: Cluster, logs: Logs
) -> None:
    # Default settings (R3 apart): the publish retry budget and the lease's refresh margin must outlast the
    # election of new leaders for the event stream and the lease bucket, both lost with one node.
    log = await logs.connect()
    settings = log.settings
    writers = [logs.keep(await log.create(new_session_id())) for _ in range(3)]
    written = {w.session_id: await turn(w, "Before.") for w in writers}
    for writer in writers:
        await writer.flush()
    leader = await stream_leader(cluster, log)
    await lead_from(log, f"KV_{settings.kv_leases}", cluster[leader].server_name)

    cluster.kill(leader)
    killed = time.monotonic()
    for writer in writers:
        written[writer.session_id] += await turn(writer, "During the election.")
    outcomes = await asyncio.gather(
        *(asyncio.wait_for(w.flush(), settings.publish_retry_s + HANG_S) for w in writers), return_exceptions=True
    )
    assert outcomes == [len(written[w.session_id]) - 1 for w in writers], outcomes
    logging.getLogger(__name__).warning(
        "acknowledged again %.1fs after the leader's kill -9", time.monotonic() - killed
    )

    await asyncio.sleep(settings.effective_lease_refresh_s * 1.5)  # refreshes after the election land
    for writer in writers:
        held = await log.leases.current(writer.session_id)
        assert held is not None and held.epoch == writer.epoch, "every writer still holds its lease"
        written[writer.session_id] += await turn(writer, "After.")
        await writer.flush()
        records = await log.reader.records(writer.session_id, min_stream_seq=writer.last_stream_seq)
        assert_contiguous(records)
        assert len({r.first_seq for r in records}) == len(records)
        assert [e for r in records for e in r.events] == written[writer.session_id]
        await writer.close()


async def test_a_lease_that_expires_during_a_failover_is_lease_lost_not_conflict(cluster: Cluster, logs: Logs) -> None:
    # The writer stalls through the election of the lease bucket's leader (its keeper stops, as in a long pause),
    # so its 1 s lease is certainly expired by the new leader. When it writes again, the code says what happened
    # (its lease is gone, and why), never CONFLICT (a competing writer): nobody else wrote.
    log = await logs.connect(lease_ttl_s=1.0)
    writer = logs.keep(await log.create(new_session_id()))
    acknowledged = await turn(writer, "Before.")
    await writer.flush()
    leader = await stream_leader(cluster, log)
    await lead_from(log, f"KV_{log.settings.kv_leases}", cluster[leader].server_name)

    await writer.lease.stop()
    cluster.kill(leader)
    await records_once_recovered(log, writer.session_id)
    deadline = time.monotonic() + RECOVERY_S
    while await lease_answer(log, writer.session_id) is not False:  # the new leader expired the lease
        assert time.monotonic() < deadline, "the lease was not expired after the election"
        await asyncio.sleep(0.25)

    await turn(writer, "After the election.")
    with pytest.raises(SessionLogError) as fenced:
        await asyncio.wait_for(writer.flush(), log.settings.publish_retry_s + HANG_S)
    assert fenced.value.code == "LEASE_LOST", fenced.value
    assert "expired" in fenced.value.message and "not refreshed for" in fenced.value.message
    assert writer.durable_seq == len(acknowledged) - 1
    assert await log.reader.events(writer.session_id) == acknowledged, "nothing was written without the lease"


async def lease_answer(log: SessionLog, session_id: str) -> bool | None:
    """Whether the session's lease is held (None while the lease bucket does not answer)."""
    try:
        return await log.leases.current(session_id) is not None
    except LogUnavailable:
        return None


async def replicas_current(log: SessionLog, timeout: float = 30.0) -> None:
    """Every replica of every stream has everything its leader has (so any survivor holds every write)."""
    deadline = time.monotonic() + timeout
    for resource in resources(log.settings):
        while True:
            info = await log.js.stream_info(resource.stream)
            peers = info.cluster.replicas if info.cluster is not None else None
            if peers and len(peers) == 2 and all(p.current and not p.lag for p in peers):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{resource.label}: replicas not current after {timeout}s: {peers}")
            await asyncio.sleep(0.1)


async def test_without_quorum_a_new_process_connects_and_reads_from_a_surviving_replica(
    cluster: Cluster, logs: Logs, tmp_path: Path
) -> None:
    log = await logs.connect()
    sid = new_session_id()
    writer = await log.create(sid)
    written = await turn(writer, "Written while the cluster was whole.")
    await writer.close()
    await replicas_current(log)
    survivor = connected_node(cluster, log)
    lose_quorum(cluster, log)
    url = cluster[survivor].url

    reader = await Opened.connect(logs, url)  # no stream has a leader: the connection must not need one
    header, session, _ = await asyncio.wait_for(reader.load(sid), HANG_S)
    assert decode_header(header).id == sid
    assert [e.raw for e in session] == written
    assert sid in [info.id for info in await asyncio.wait_for(reader.sessions(), HANG_S)], "listing works too"

    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(SESSIONLOG_NATS_URL=url, SESSIONLOG_REPLICAS="3")
    out = tmp_path / "exported.jsonl"
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sessionlog", "export", sid, "-o", str(out)],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    lines = out.read_bytes().splitlines()
    assert lines[1:] == written and decode_header(lines[0]).id == sid
    listed = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sessionlog", "sessions"],
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        timeout=60,
    )
    assert listed.returncode == 0 and sid in listed.stdout.decode(), listed.stderr.decode()


async def test_without_quorum_a_projection_service_starts_answers_from_the_survivor_and_claims_once_it_returns(
    cluster: Cluster, logs: Logs
) -> None:
    # No leader anywhere: no durable consumer can be made and no partition lease taken. The service still starts,
    # answers from the surviving replica (direct gets), says it is not ready, and takes its partitions when the
    # other nodes come back, without a restart.
    log = await logs.connect()
    sid = new_session_id()
    writer = await log.create(sid)
    written = await turn(writer, "Written while the cluster was whole.")
    await writer.close()
    await replicas_current(log)
    survivor = connected_node(cluster, log)
    doomed = [i for i in range(len(cluster)) if i != survivor]
    lose_quorum(cluster, log)

    timeout = 3.0
    served = await Opened.connect(logs, cluster[survivor].url, request_timeout_s=timeout, lease_ttl_s=1.0)
    service = logs.keep_service(ContextDeriverService(served))  # claims its partitions (no fixed set)
    await asyncio.wait_for(service.start(), timeout * 4 + HANG_S)  # the bound only proves no hang
    await served.nc.flush()
    expected = Session()
    for raw in written:
        expected.append(raw)
    reply = await call(served.nc, "sessionlog.context.derive", {"session": sid}, timeout=timeout * 2 + HANG_S)
    assert reply["messages"] == json.loads(canonical_messages(expected)[0]), "answered from the surviving replica"
    assert reply["seq"] == len(written) - 1
    health = service.health()
    assert not health["ready"], health
    assert health["partitions"] == [] or health["stalled"], health

    for i in doomed:
        await asyncio.to_thread(cluster.restart, i)

    async def claimed_and_ready() -> bool:
        now = service.health()
        return bool(now["ready"]) and now["partitions"] == list(range(served.settings.partition_count))

    await eventually(claimed_and_ready, "every partition claimed and the service ready", RECOVERY_S)
    reply = await call(served.nc, "sessionlog.context.derive", {"session": sid}, timeout=timeout * 2 + HANG_S)
    assert reply["messages"] == json.loads(canonical_messages(expected)[0])


async def test_a_partition_whose_consumer_leader_dies_is_consumed_again_through_a_survivor(
    cluster: Cluster, logs: Logs
) -> None:
    # The node that leads one partition's consumer dies (not the node the service is connected to): the partition
    # is consumed again through a survivor, and what was written after the kill is applied, each record once.
    served = await logs.connect(lease_ttl_s=1.0, request_timeout_s=3.0)
    home = connected_node(cluster, served)
    service = logs.keep_service(ContextDeriverService(served))
    await asyncio.wait_for(service.start(), HANG_S)
    count = served.settings.partition_count

    async def owns_every_partition() -> bool:
        now = service.health()
        return bool(now["ready"]) and now["partitions"] == list(range(count))

    await eventually(owns_every_partition, "every partition claimed and the service ready", RECOVERY_S)
    hosts: dict[int, int] = {}
    for number in range(count):
        info = await served.js.consumer_info(served.settings.stream, f"context-deriver-p{number}")
        assert info.cluster is not None and info.cluster.leader
        hosts[number] = next(i for i, s in enumerate(cluster.servers) if s.server_name == info.cluster.leader)
    partition, doomed = next(((n, i) for n, i in sorted(hosts.items()) if i != home), (None, None))
    if partition is None or doomed is None:  # every consumer led from the service's own node: kill another
        partition, doomed = 0, (home + 1) % len(cluster)
    sid = next(s for s in (new_session_id() for _ in range(10_000)) if partition_of(s, count) == partition)

    writer_log = await logs.connect(cluster[home].url)
    writer = logs.keep(await writer_log.create(sid))
    before = await turn(writer, "Written before the node holding this partition's consumer died.")
    await writer.flush()
    expected = Session()
    for raw in before:
        expected.append(raw)

    async def consumed(stream_seq: int) -> bool:
        # by the partition's own feed: a derive alone could be answered by loading the session from the stream
        feed = service.runner.feeds.get(partition)
        return feed is not None and feed.applied >= stream_seq

    first = await writer_log.reader.last_record(sid)
    assert first is not None
    await eventually(lambda: consumed(first.stream_seq), "the first turn consumed", RECOVERY_S)
    await replicas_current(writer_log)
    cluster.kill(doomed)
    after = await turn(writer, "Written after it died.")
    await writer.flush()
    for raw in after:
        expected.append(raw)
    last = await writer_log.reader.last_record(sid)
    assert last is not None and last.stream_seq > first.stream_seq
    await eventually(lambda: consumed(last.stream_seq), "the turn written after the kill consumed", RECOVERY_S)
    reply = await call(served.nc, "sessionlog.context.derive", {"session": sid}, timeout=5.0)
    assert reply["seq"] == len(before) + len(after) - 1
    assert reply["messages"] == json.loads(canonical_messages(expected)[0]), "each record applied once, in order"
    await eventually(owns_every_partition, "the service ready again, every partition consumed", RECOVERY_S)


async def test_without_quorum_creating_is_log_unavailable_and_listing_answers_from_the_surviving_replica(
    cluster: Cluster, logs: Logs
) -> None:
    # The default request timeout: right after the other nodes die the survivor serves no direct gets for about
    # 1.8 s (no responders), and a read asks again within its timeout.
    timeout = Settings().request_timeout_s
    log = await logs.connect(publish_retry_s=2.0, lease_ttl_s=60.0)
    listed = new_session_id()
    await (await log.create(listed)).close()
    await replicas_current(log)
    lose_quorum(cluster, log)
    with pytest.raises(LogUnavailable):
        await asyncio.wait_for(log.create(new_session_id()), timeout + HANG_S)  # the bound only proves no hang
    sessions = await asyncio.wait_for(log.sessions(), timeout + HANG_S)
    assert listed in [info.id for info in sessions], "listing reads the survivor's replica (direct gets)"


async def test_without_quorum_open_resume_fork_purge_and_blobs_are_log_unavailable(
    cluster: Cluster, logs: Logs
) -> None:
    timeout = 2.0
    log = await logs.connect(request_timeout_s=timeout, publish_retry_s=timeout, lease_ttl_s=60.0, allow_purge=True)
    sid, interrupted = new_session_id(), new_session_id()
    writer = await log.create(sid)
    await turn(writer, "Written while the cluster was whole.")
    await writer.close()
    writer = await log.create(interrupted)
    await writer.emit("turn/start", {"turn": 1})
    await writer.close()
    blob = await log.put_blob(b"stored while the cluster was whole")
    lose_quorum(cluster, log)

    attempts = {  # one lease per session: two attempts on one lease would race each other, not the cluster
        "open": lambda: log.open(sid),
        "resume": lambda: log.resume(interrupted),
        "fork": lambda: log.fork(sid, new_session_id()),
        "purge": lambda: log.purge(sid),
        "put_blob": lambda: log.put_blob(b"nobody can store this"),
        "get_blob": lambda: log.get_blob(blob["attachmentId"]),
    }  # listing sessions reads the survivor's replica: see the test above
    outcomes = await asyncio.gather(
        *(asyncio.wait_for(attempt(), timeout + HANG_S) for attempt in attempts.values()), return_exceptions=True
    )
    escaped = {name: outcome for name, outcome in zip(attempts, outcomes, strict=True)}
    assert {name: type(o) for name, o in escaped.items()} == dict.fromkeys(attempts, LogUnavailable), escaped
    assert all(isinstance(o, LogUnavailable) and o.code == "LOG_UNAVAILABLE" for o in outcomes)


async def test_with_every_node_down_reads_are_log_unavailable_not_a_raw_nats_error(
    cluster: Cluster, logs: Logs
) -> None:
    timeout = 2.0
    log = await logs.connect(request_timeout_s=timeout, publish_retry_s=timeout, lease_ttl_s=60.0)
    sid = new_session_id()
    writer = await log.create(sid)
    await turn(writer, "Written while the cluster was whole.")
    await writer.close()
    blob = await log.put_blob(b"stored while the cluster was whole")
    for i in range(len(cluster)):
        cluster.kill(i)

    attempts = {
        "header": lambda: log.header(sid),
        "load": lambda: log.load(sid),
        "records": lambda: log.reader.records(sid),
        "events": lambda: log.reader.events(sid),
        "last_record": lambda: log.reader.last_record(sid),
        "record_of": lambda: log.reader.record_of(sid, 0),
        "leader_get": lambda: log.reader.leader_get(next_by_subj=f"sessionlog.events.*.{sid}"),
        "lease": lambda: log.leases.current(sid),
        "get_blob": lambda: log.get_blob(blob["attachmentId"]),
        "sessions": log.sessions,
    }
    outcomes = await asyncio.gather(
        *(asyncio.wait_for(attempt(), timeout + HANG_S) for attempt in attempts.values()), return_exceptions=True
    )
    escaped = {name: outcome for name, outcome in zip(attempts, outcomes, strict=True)}
    assert {name: type(o) for name, o in escaped.items()} == dict.fromkeys(attempts, LogUnavailable), escaped
    header = escaped["header"]
    assert isinstance(header, LogUnavailable)
    assert header.message.startswith(f"read the header of session {sid}: "), "the message names the operation"


async def test_a_retry_that_meets_its_first_attempt_still_replicating_waits_for_it_and_lands_once(
    cluster: Cluster, logs: Logs
) -> None:
    # Both followers frozen: the leader holds the record's proposal without a quorum. The first attempt times out
    # (a third of the budget); the retry, with the same message id, is answered "duplicate message id is in
    # process" (JetStream 10158). That says the first attempt's outcome is still pending, not that the log is
    # unavailable: the writer must keep asking until the thawed followers commit it, then settle the duplicate.
    log = await logs.connect(request_timeout_s=9.0, lease_ttl_s=60.0)
    sid = new_session_id()
    writer = logs.keep(await log.create(sid))
    written = await turn(writer, "Before.")
    await writer.flush()
    leader = await stream_leader(cluster, log)
    followers = [s.pid for i, s in enumerate(cluster.servers) if i != leader]
    assert all(pid is not None for pid in followers)
    for pid in followers:
        await freeze(pid)  # type: ignore[arg-type]
    try:
        written += await turn(writer, "Proposed while the followers sleep.")
        flushing = asyncio.create_task(writer.flush())
        await asyncio.sleep(4.5)  # the first attempt timed out at 3 s; the retry met it in process
        assert not flushing.done(), flushing.exception() if flushing.done() else None
    finally:
        for pid in followers:
            os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]
    assert await asyncio.wait_for(flushing, 20) == len(written) - 1
    # A just-thawed follower may answer the direct get before it has the record: read up to what was acknowledged.
    records = await log.reader.records(sid, min_stream_seq=writer.last_stream_seq)
    assert_contiguous(records)
    assert [e for r in records for e in r.events] == written  # each event once: the retry was settled, not doubled
