"""Reliability, fault 2 of issue 15: a 3-node cluster with R3 streams and the writers' default settings.

- The stream leader killed with SIGKILL under streaming writers, again and again (each time the node comes back):
  no acknowledged event lost or doubled, and the writers ride through the elections.
- A second node lost (quorum gone): writes refuse with `LOG_UNAVAILABLE` within a bound, reads of what is there still
  answer; the nodes return and the one that was down catches up (its replica has every acknowledged record).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from reliability import Stopwatch, record_figures, rng, scale
from scaffold import WAIT_S, eventually
from sessiongen import streamed_turn
from test_log_cluster import Logs, cluster, every_stream_has_a_leader, logs, records_once_recovered, stream_leader
from test_reliability_server_kill import assert_flushed_events_present_once_in_order, stream_turns

from sessionlog.embedded import Cluster
from sessionlog.errors import LogUnavailable, SessionLogError

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]
__all__ = ["cluster", "logs"]  # fixtures, used by name


async def test_leader_kills_under_writes_with_default_settings_lose_and_double_nothing(
    cluster: Cluster, logs: Logs
) -> None:
    kills = scale(2, 10)
    chance = rng("leader-kill")
    log = await logs.connect()
    writers = [await logs.create(log) for _ in range(scale(3, 8))]
    failures: list[SessionLogError] = []
    stop = asyncio.Event()
    streams = [asyncio.create_task(stream_turns(w, stop, failures)) for w in writers]
    recovered = Stopwatch()
    try:
        for _ in range(kills):
            await asyncio.sleep(chance.uniform(0.5, 2.0))
            leader = await stream_leader(cluster, log)
            before = {w.session_id: w.durable_seq for w in writers}
            cluster.kill(leader)
            killed_at = time.monotonic()

            async def all_wrote_again(before: dict[str, int] = before) -> bool:
                return failures != [] or all(w.durable_seq > before[w.session_id] for w in writers)

            await eventually(all_wrote_again, "every writer acknowledged again after the leader died", 60)
            recovered.since(killed_at)
            assert failures == [], f"a writer failed across a leader election: {failures[0]!r}"
            await asyncio.to_thread(cluster.restart, leader)
            await every_stream_has_a_leader(log)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*streams), WAIT_S * 6)
    assert failures == [], f"a writer failed: {failures[0]!r}"
    written = 0
    for writer in writers:
        await writer.flush()
        written += await assert_flushed_events_present_once_in_order(log, writer)
    record_figures(
        "R3 cluster: stream leader killed under writes (default settings)",
        fault="SIGKILL of the stream leader node, restarted after the election",
        writers=len(writers),
        events_written=written,
        faults_injected=kills,
        events_lost=0,
        duplicates=0,
        worst_recovery_s=recovered.worst,
    )


async def test_a_second_node_lost_refuses_writes_typed_reads_answer_and_the_returning_node_catches_up(
    cluster: Cluster, logs: Logs
) -> None:
    log = await logs.connect()
    writer = await logs.create(log)
    for i in range(3):
        await streamed_turn(writer, f"before {i}")
    acked = await writer.flush()
    session_id = writer.session_id
    leader = await stream_leader(cluster, log)
    down = next(i for i in range(len(cluster)) if i != leader)
    cluster.kill(down)  # one node lost: the stream keeps its quorum
    await streamed_turn(writer, "one node down")
    acked = await writer.flush()
    # A second node lost: the one we are not connected to, so the client keeps a server to talk to.
    connected = log.nc.connected_url
    assert connected is not None
    second = next(i for i in range(len(cluster)) if i != down and cluster[i].port != connected.port)
    cluster.kill(second)
    started = time.monotonic()
    with pytest.raises(LogUnavailable) as caught:
        await streamed_turn(writer, "no quorum")
        await writer.flush()
    refused_after = time.monotonic() - started
    assert caught.value.code == "LOG_UNAVAILABLE"
    assert refused_after < log.settings.request_timeout_s * 3 + 20, "bounded"
    assert writer.durable_seq == acked
    # Reads of what is there still answer (a surviving replica's direct get; it may be stale, not wrong).
    events = await log.reader.events(session_id)
    assert len(events) >= acked + 1
    assert events[: acked + 1] == [e.raw for e in writer.session.events][: acked + 1]
    # Both come back; the stream serves again and the node that was down first has every acknowledged record.
    back_at = time.monotonic()
    for node in (second, down):
        await asyncio.to_thread(cluster.restart, node)
    records = await records_once_recovered(log, session_id)
    assert sum(len(r.events) for r in records) >= acked + 1
    caught_up_s = time.monotonic() - back_at
    record_figures(
        "R3 cluster: quorum lost and regained",
        fault="two of three nodes killed, then restarted",
        events_written=acked + 1,
        faults_injected=2,
        events_lost=0,
        error="LOG_UNAVAILABLE",
        time_to_error_s=round(refused_after, 3),
        worst_recovery_s=round(caught_up_s, 3),
    )
    await writer.abandon()
