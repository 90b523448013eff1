"""The embedded nats-server launcher, connecting, provisioning the JetStream layout, and writer leases.

Everything here runs against real nats-server processes on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time
from pathlib import Path

import msgspec
import nats
import nats.js.errors
import pytest
import pytest_asyncio
from nats.js import JetStreamContext
from natsfixtures import BackendUnavailable, container_server, docker_available, log_settings, new_session_id
from scaffold import eventually

from sessionlog import leases as leases_module
from sessionlog.connection import connect, stop_embedded
from sessionlog.embedded import (
    PORT_FLOOR,
    Cluster,
    EmbeddedServer,
    ServerNotFound,
    ServerStartFailed,
    ServerTooOld,
    check_version,
    ephemeral_port_range,
    free_port,
    parse_version,
    port_pick_range,
)
from sessionlog.errors import LeaseHeld, LeaseLost, LogUnavailable
from sessionlog.leases import Leases, ttl_header
from sessionlog.provision import (
    StreamMismatch,
    event_stream_config,
    headers_stream_config,
    kv_stream_config,
    partition_of,
    provision,
    resources,
    stored_subject,
    stream_config,
)
from sessionlog.record import events_filter, in_subject, partition_filter
from sessionlog.settings import Settings, parse_partition_set, settings_table_markdown

pytest_plugins = ["natsfixtures"]
pytestmark = pytest.mark.integration
# The nc/js fixtures live on the module's loop; async tests must run there too (sync tests take no mark).
on_module_loop = pytest.mark.asyncio(loop_scope="module")


def _fake_binary(tmp_path: Path, output: str) -> Path:
    script = tmp_path / "nats-server"
    script.write_text(f"#!/bin/sh\necho '{output}'\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


async def _ordered_subjects(js: JetStreamContext, stream: str, subject: str, count: int) -> list[str]:
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
    try:
        return [(await sub.next_msg(timeout=2)).subject for _ in range(count)]
    finally:
        await sub.unsubscribe()


# --- settings ------------------------------------------------------------------------------------------------


def test_partition_sets_parse_ranges_and_lists_and_refuse_partitions_past_the_count() -> None:
    assert parse_partition_set("0-3,6", 8) == [0, 1, 2, 3, 6]
    assert parse_partition_set("2, 0,2", 8) == [0, 2]
    for bad in ("0-8", "3-1", "a", "", "1,,2"):
        with pytest.raises(ValueError):
            parse_partition_set(bad, 8)
    with pytest.raises(ValueError, match="partition 9 does not exist"):
        Settings(_env_file=None, partitions="0-3,9")
    assert Settings(_env_file=None, partitions="1,3").owned_partitions() == [1, 3]
    assert Settings(_env_file=None, partition_count=4).owned_partitions() == [0, 1, 2, 3]


def test_settings_read_the_environment_and_document_every_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SESSIONLOG_NATS_URL", "nats://a:4222, nats://b:4222")
    monkeypatch.setenv("SESSIONLOG_PROVIDER_MODEL_MAP", '{"fast": "deepseek-chat"}')
    monkeypatch.setenv("SESSIONLOG_LEASE_TTL_S", "4")
    settings = Settings(_env_file=None)
    assert settings.nats_servers() == ["nats://a:4222", "nats://b:4222"]
    assert settings.provider_model_map == {"fast": "deepseek-chat"}
    assert settings.effective_lease_refresh_s == 1.0
    with pytest.raises(ValueError, match="lease_refresh_s"):
        Settings(_env_file=None, lease_ttl_s=2, lease_refresh_s=2)
    with pytest.raises(ValueError, match="publish_retry_s"):  # a retry must stay within the duplicate window
        Settings(_env_file=None, publish_retry_s=60, duplicate_window_s=60)
    for field, bad in (
        ("projection_max_sessions", 0),
        ("projection_idle_evict_s", -1),
        ("gateway_record_window_ms", -1),
    ):
        with pytest.raises(ValueError, match=field):
            Settings(_env_file=None, **{field: bad})
    table = settings_table_markdown()
    for name in Settings.model_fields:
        assert f"`SESSIONLOG_{name.upper()}`" in table
    assert "| `SESSIONLOG_EMBEDDED_PORT` | `4290` |" in table


# --- the launcher --------------------------------------------------------------------------------------------


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    """A kernel-chosen port is an ephemeral one, which an outgoing connection made before the bind (a route between
    two cluster nodes) can take as its source port: free_port picks below that range, and each port once."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports), ports
    span = ephemeral_port_range()
    if span is None or port_pick_range() is None:
        pytest.skip(f"the ephemeral port range here ({span}) leaves no room below it: the kernel chooses")
    assert all(PORT_FLOOR <= port < span[0] for port in ports), (span, ports)
    for port in ports[:5]:  # free when handed out
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_server_stops_restarts_on_its_port_and_keeps_its_data(tmp_path: Path) -> None:
    async def write(url: str) -> None:
        client = await nats.connect(url)
        try:
            jsc = client.jetstream()
            await jsc.add_stream(name="KEEP", subjects=["keep.>"])
            await jsc.publish("keep.1", b"before")
        finally:
            await client.close()

    async def read(url: str) -> bytes:
        client = await nats.connect(url)
        try:
            return bytes((await client.jetstream().get_msg("KEEP", 1)).data or b"")
        finally:
            await client.close()

    with EmbeddedServer(tmp_path / "data") as server:
        port = server.port
        asyncio.run(write(server.url))
        server.stop()
        assert not server.running
        server.restart()
        assert server.port == port
        assert asyncio.run(read(server.url)) == b"before"
        server.kill()  # a crash: acknowledged data is in the files already
        assert not server.running
        server.restart()
        assert asyncio.run(read(server.url)) == b"before"
        pid = server.pid
    assert pid is not None and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state in /proc says it is gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@on_module_loop
async def test_the_async_context_manager_starts_and_stops_without_blocking_the_loop(tmp_path: Path) -> None:
    async with EmbeddedServer(tmp_path / "data", monitor_port=None) as server:
        client = await nats.connect(server.url)
        info = await client.jetstream().account_info()
        assert info.limits is not None
        await client.close()
    assert not server.running


def test_an_old_binary_is_refused_before_it_runs(tmp_path: Path) -> None:
    fake = _fake_binary(tmp_path, "nats-server: v2.10.0")
    with pytest.raises(ServerTooOld) as caught:
        EmbeddedServer(tmp_path / "data", binary=fake).start()
    assert caught.value.code == "SERVER_TOO_OLD"
    assert "2.10.0" in caught.value.message and "2.11" in caught.value.message
    assert check_version("nats-server: v2.11.0") == (2, 11, 0)
    assert parse_version("v2.12.0-RC.3") == (2, 12, 0)


def test_a_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ServerNotFound) as caught:
        EmbeddedServer(tmp_path / "data", binary=tmp_path / "no-such-nats-server").start()
    assert caught.value.code == "SERVER_NOT_FOUND"
    assert "no-such-nats-server" in caught.value.message


def test_a_server_that_cannot_start_reports_its_log(tmp_path: Path) -> None:
    with EmbeddedServer(tmp_path / "a") as first:
        second = EmbeddedServer(tmp_path / "b", port=first.port, start_timeout_s=5)
        with pytest.raises(ServerStartFailed) as caught:
            second.start()
        assert "address already in use" in caught.value.message
        assert not second.running


def test_a_cluster_whose_route_port_was_taken_before_it_bound_it_starts_on_ports_picked_again(tmp_path: Path) -> None:
    """A port picked for a node can be taken before the node binds it (CI saw the ephemeral source port of a route
    connection between the other two nodes take a third node's route port): the cluster picks every port again."""
    cluster = Cluster(tmp_path / "c", size=3, name=f"p{os.getpid()}", start_timeout_s=20)
    options = cluster.servers[2].cluster
    assert options is not None
    taken_port = options.port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", taken_port))
        taken.listen()
        try:
            cluster.start()
            assert all(server.running for server in cluster.servers)
            assert taken_port not in [server.cluster.port for server in cluster.servers if server.cluster]
            assert cluster.meta_leader() is not None
        finally:
            cluster.stop()


# --- connecting ----------------------------------------------------------------------------------------------


@on_module_loop
async def test_connect_refuses_a_server_older_than_2_11() -> None:
    # A stand-in that speaks just enough of the protocol to complete the handshake, announcing 2.10.0.
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "FAKE", "version": "2.10.0", "proto": 1, "max_payload": 1048576, "headers": True}
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        while line := await reader.readline():
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
            await writer.drain()
        writer.close()

    fake = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = fake.sockets[0].getsockname()[1]
    try:
        settings = Settings(_env_file=None, nats_url=f"nats://127.0.0.1:{port}")
        with pytest.raises(ServerTooOld, match=r"2\.10\.0"):
            await connect(settings, allow_reconnect=False)
    finally:
        fake.close()
        await fake.wait_closed()


@on_module_loop
async def test_connect_without_a_url_starts_the_embedded_server_once(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, nats_url=None, embedded_port=free_port(), data_dir=tmp_path / "home")
    try:
        first = await connect(settings)
        second = await connect(settings)  # reuses the running server
        assert first.connected_url is not None and first.connected_url.port == settings.embedded_port
        assert (tmp_path / "home" / "nats" / "jetstream").is_dir()
        assert (tmp_path / "home" / "nats-server.log").is_file()
        await first.close()
        await second.close()
    finally:
        stop_embedded()


@on_module_loop
async def test_an_unreachable_server_is_log_unavailable_within_seconds() -> None:
    settings = log_settings(f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(LogUnavailable, match="cannot connect to NATS"):
        await asyncio.wait_for(connect(settings), 10)  # the bound proves it gives up, not how fast


@on_module_loop
async def test_a_connection_rides_out_a_server_restart(fresh_server: EmbeddedServer) -> None:
    client = await connect(log_settings(fresh_server.url, request_timeout_s=2))
    try:
        jsc = client.jetstream(timeout=2)
        await jsc.add_stream(name="RIDE", subjects=["ride.>"])
        await asyncio.to_thread(fresh_server.kill)
        await asyncio.to_thread(fresh_server.restart)
        deadline = time.monotonic() + 10
        while not client.is_connected:
            assert time.monotonic() < deadline, "the client did not reconnect"
            await asyncio.sleep(0.05)
        ack = await jsc.publish("ride.1", b"after")
        assert ack.stream == "RIDE"
    finally:
        await client.close()


# --- provisioning --------------------------------------------------------------------------------------------


@on_module_loop
async def test_provisioning_creates_everything_once_and_then_only_verifies(
    fresh_js: JetStreamContext, fresh_server: EmbeddedServer
) -> None:
    js, settings = fresh_js, log_settings(fresh_server.url)
    first = await provision(js, settings)
    assert sorted(first.created) == sorted(r.label for r in resources(settings)) and first.verified == []
    second = await provision(js, settings)
    assert second.created == [] and sorted(second.verified) == sorted(first.created)

    for bucket in (settings.kv_sessions, settings.kv_leases, settings.kv_checkpoints):
        kv = await js.key_value(bucket)
        await kv.put("probe", b"1")
        assert (await kv.get("probe")).value == b"1"
    blobs = await js.object_store(settings.object_store)
    await blobs.put("probe", b"blob")
    assert (await blobs.get("probe")).data == b"blob"

    leases = await stream_config(js, f"KV_{settings.kv_leases}")
    assert leases is not None and leases["allow_msg_ttl"] is True and leases["subject_delete_marker_ttl"] > 0
    events = await stream_config(js, settings.stream)
    assert events is not None
    assert events["deny_delete"] and events["deny_purge"] and events["discard"] == "new"
    assert events["allow_direct"] and events["storage"] == "file" and not events["allow_rollup_hdrs"]


@on_module_loop
async def test_verify_only_lists_what_is_missing_and_creates_nothing(
    fresh_js: JetStreamContext, fresh_server: EmbeddedServer
) -> None:
    settings = log_settings(fresh_server.url)
    report = await provision(fresh_js, settings, create=False)
    assert report.created == [] and len(report.missing) == 6
    assert await stream_config(fresh_js, settings.stream) is None


@on_module_loop
async def test_a_stream_with_another_partition_count_is_reported_and_left_alone(
    fresh_js: JetStreamContext, fresh_server: EmbeddedServer
) -> None:
    js, settings = fresh_js, log_settings(fresh_server.url, partition_count=8)
    await provision(js, settings.model_copy(update={"partition_count": 4}))
    with pytest.raises(StreamMismatch) as caught:
        await provision(js, settings)
    err = caught.value
    assert err.code == "STREAM_MISMATCH"
    assert list(err.differences) == [f"stream {settings.stream}"]  # buckets do not depend on N
    fields = {d.field: d for d in err.differences[f"stream {settings.stream}"]}
    assert set(fields) == {"subject_transform", "partition_count"}
    assert fields["partition_count"].expected == 8 and fields["partition_count"].actual == 4
    assert "partition_count: expected 8, found 4" in err.message
    existing = await stream_config(js, settings.stream)
    assert existing is not None and "partition(4,1)" in existing["subject_transform"]["dest"]


@on_module_loop
async def test_every_differing_field_is_listed_and_nothing_is_created(
    fresh_js: JetStreamContext, fresh_server: EmbeddedServer
) -> None:
    js, settings = fresh_js, log_settings(fresh_server.url)
    await js._nc.request(
        f"$JS.API.STREAM.CREATE.{settings.stream}",
        json.dumps(event_stream_config(settings.model_copy(update={"storage": "memory"}))).encode(),
    )
    await provision(js, settings.model_copy(update={"storage": "memory", "kv_sessions": "other"}))
    other = settings.model_copy(update={"allow_purge": True, "duplicate_window_s": 30.0})
    with pytest.raises(StreamMismatch) as caught:
        await provision(js, other)
    diffs = caught.value.differences
    assert {d.field for d in diffs[f"stream {settings.stream}"]} == {"storage", "deny_purge", "duplicate_window"}
    assert {d.field for d in diffs[f"stream {settings.raw_stream}"]} == {"storage", "deny_purge"}
    assert {d.field for d in diffs[f"kv {settings.kv_leases}"]} == {"storage"}
    # The one missing bucket was not created: the plan failed before anything was committed.
    assert await stream_config(js, f"KV_{settings.kv_sessions}") is None


@on_module_loop
async def test_a_headers_bucket_from_before_write_once_headers_is_reported_and_can_be_updated_in_place(
    fresh_js: JetStreamContext, fresh_server: EmbeddedServer
) -> None:
    js, settings = fresh_js, log_settings(fresh_server.url)
    old = kv_stream_config(settings, settings.kv_sessions)  # what provisioning created before 2026-12-03
    await js._nc.request(f"$JS.API.STREAM.CREATE.{old['name']}", json.dumps(old).encode())
    with pytest.raises(StreamMismatch) as caught:
        await provision(js, settings)
    diffs = caught.value.differences[f"kv {settings.kv_sessions}"]
    assert {d.field for d in diffs} == {"discard_new_per_subject", "allow_rollup_hdrs"}
    assert "docs/operations.md" in caught.value.message
    assert await stream_config(js, settings.stream) is None, "nothing created while the plan failed"
    # JetStream takes both fields as an update of the existing stream, keeping its headers.
    kv = await js.key_value(settings.kv_sessions)
    await kv.put("kept", b"header")
    reply = await js._nc.request(
        f"$JS.API.STREAM.UPDATE.{old['name']}", json.dumps(headers_stream_config(settings)).encode()
    )
    assert "error" not in json.loads(reply.data), reply.data
    report = await provision(js, settings)
    assert f"kv {settings.kv_sessions}" in report.verified
    assert (await kv.get("kept")).value == b"header"
    with pytest.raises(nats.js.errors.APIError):
        await kv.put("kept", b"overwritten")


@on_module_loop
async def test_records_are_stored_under_their_sessions_partition(js: JetStreamContext, provisioned: Settings) -> None:
    n = provisioned.partition_count
    a, b = new_session_id(), new_session_id()
    ids = [a, b, a]
    acks = [await js.publish(in_subject(sid), sid.encode()) for sid in ids]
    stored = [(await js.get_msg(provisioned.stream, ack.seq)).subject for ack in acks]
    assert stored == [stored_subject(sid, n) for sid in ids]
    assert stored[0] == stored[2] == f"sessionlog.events.{partition_of(a, n)}.{a}"
    assert [partition_of(s, 8) for s in ("abc", "xyz", "s-1_2")] == [3, 0, 1]  # as a 2.15 server put them

    # One session's filter finds its records wherever they are; a partition's filter finds all of it.
    assert await _ordered_subjects(js, provisioned.stream, events_filter(a), 2) == [stored[0]] * 2
    p = partition_of(b, n)
    found = await _ordered_subjects(js, provisioned.stream, partition_filter(p), 1)
    assert found[0].split(".")[2] == str(p)

    # No way around the transform: neither a stored subject nor a multi-token one has a stream.
    for subject in (stored[0], f"sessionlog.in.{a}.extra"):
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await js.publish(subject, b"x", timeout=1)


@on_module_loop
async def test_the_log_refuses_deletes_and_purges_unless_purge_is_allowed(
    js: JetStreamContext,
    provisioned: Settings,
    fresh_js: JetStreamContext,
    fresh_server: EmbeddedServer,
) -> None:
    sid = new_session_id()
    ack = await js.publish(in_subject(sid), b"x")
    with pytest.raises(nats.js.errors.APIError, match="purge not permitted"):
        await js.purge_stream(provisioned.stream, subject=events_filter(sid))
    with pytest.raises(nats.js.errors.APIError, match="delete not permitted"):
        await js.delete_msg(provisioned.stream, ack.seq)

    erasable = log_settings(fresh_server.url, allow_purge=True)
    await provision(fresh_js, erasable)
    await fresh_js.publish(in_subject("gone"), b"x")
    await fresh_js.publish(in_subject("kept"), b"y")
    await fresh_js.purge_stream(erasable.stream, subject=events_filter("gone"))
    info = await fresh_js.stream_info(erasable.stream)
    assert info.state.messages == 1


# --- leases --------------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def leases(js: JetStreamContext, provisioned: Settings) -> Leases:
    return Leases(js, provisioned.kv_leases)


def test_lease_ttls_are_whole_seconds_of_at_least_one() -> None:
    assert ttl_header(1) == "1s" and ttl_header(1.2) == "2s"
    with pytest.raises(ValueError, match="at least 1 second"):
        ttl_header(0.5)


@on_module_loop
async def test_a_lease_is_exclusive_refreshable_and_releasable(leases: Leases) -> None:
    sid = new_session_id()
    lease = await leases.acquire(sid, "writer-a", 5)
    assert lease.epoch == lease.revision
    with pytest.raises(LeaseHeld, match="writer-a"):
        await leases.acquire(sid, "writer-b", 5)
    refreshed = await leases.refresh(lease)
    assert refreshed.epoch == lease.epoch and refreshed.revision > lease.revision
    assert await leases.current(sid) == refreshed
    with pytest.raises(LeaseLost):
        await leases.refresh(lease)  # a stale revision is a lost lease
    await leases.release(refreshed)
    assert await leases.current(sid) is None
    with pytest.raises(LeaseLost):
        await leases.release(refreshed)
    again = await leases.acquire(sid, "writer-b", 5)
    assert again.epoch > lease.epoch


@on_module_loop
async def test_an_expired_lease_leaves_a_marker_and_can_be_taken_over(leases: Leases, js: JetStreamContext) -> None:
    sid = new_session_id()
    kv = await js.key_value(leases.bucket)
    watcher = await kv.watch(sid)
    try:
        assert await watcher.updates(timeout=2) is None  # nothing yet
        lease = await leases.acquire(sid, "writer-a", 1)
        assert (await watcher.updates(timeout=2)).revision == lease.revision
        marker = await watcher.updates(timeout=5)  # the server's expiry marker for the unrefreshed 1 s lease
        assert marker.operation == "PURGE" and marker.revision > lease.revision
    finally:
        await watcher.stop()
    assert await leases.current(sid) is None
    taken = await leases.acquire(sid, "writer-b", 5)
    assert taken.epoch > marker.revision
    with pytest.raises(LeaseLost, match="taken over by 'writer-b'"):
        await leases.refresh(lease)


@on_module_loop
async def test_a_lease_entry_the_server_kept_past_its_ttl_is_expired_and_can_be_taken_over(
    leases: Leases, js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found probing record mode, 2026-12-05: after nats-server restarts (its log: `TTL state is outdated`) lease
    entries of a killed gateway were still served half an hour later, every request 409 and `repair-session` LEASE_HELD.
    An entry written longer ago than twice its TTL (and a second) is taken for expired, whatever the server kept.
    Here the entry is written without a Nats-TTL, as one the server never removes, and the margin for clock skew
    (30 s) is 1 s."""
    monkeypatch.setattr(leases_module, "STALE_MARGIN_S", 1.0)
    sid = new_session_id()
    value = msgspec.json.encode({"holder": "vm:6429:dead", "ttl_s": 1})
    await js.publish(leases.subject(sid), value)
    held = await leases.current(sid)
    assert held is not None and held.holder == "vm:6429:dead"  # while it is young, it holds
    with pytest.raises(LeaseHeld):
        await leases.acquire(sid, "writer-b", 5)
    await asyncio.sleep(3.2)  # past 2 x 1 s + 1 s
    assert await leases.current(sid) is None
    taken = await leases.acquire(sid, "writer-b", 5)
    assert taken.holder == "writer-b" and await leases.current(sid) == taken


@on_module_loop
async def test_a_lease_write_nobody_received_is_sent_again_until_the_bucket_answers(
    fresh_server: EmbeddedServer, fresh_js: JetStreamContext
) -> None:
    # No bucket yet: a lease write finds no stream (no responders), as while a bucket elects a new leader.
    settings = log_settings(fresh_server.url)
    leases = Leases(fresh_js, settings.kv_leases, timeout=30.0)
    acquiring = asyncio.create_task(leases.acquire("s1", "writer-a", 5))
    await asyncio.sleep(0.3)
    assert not acquiring.done(), "the write nobody received is retried, not refused"
    await provision(fresh_js, settings)
    lease = await asyncio.wait_for(acquiring, 30.0)
    assert await leases.current("s1") == lease

    nowhere = Leases(fresh_js, "no-such-bucket", timeout=0.5)
    with pytest.raises(LogUnavailable, match="acquire the lease of s1"):
        await asyncio.wait_for(nowhere.acquire("s1", "writer-a", 5), 30.0)


# --- a cluster -----------------------------------------------------------------------------------------------


@on_module_loop
async def test_a_three_node_cluster_elects_a_leader_and_serves_r3_streams(nats_cluster: Cluster) -> None:
    leader = nats_cluster.meta_leader_index(timeout=10)
    assert nats_cluster[leader].server_name == nats_cluster.meta_leader()
    settings = log_settings(nats_cluster.url, replicas=3)
    client = await nats.connect(nats_cluster.urls)
    try:
        jsc = client.jetstream(timeout=10)
        report = await provision(jsc, settings)
        assert len(report.created) == 6
        info = await jsc.stream_info(settings.stream)
        assert info.config.num_replicas == 3 and info.cluster is not None
        assert len(info.cluster.replicas or []) == 2

        async def stored() -> bool:  # a new R3 stream may take a moment to elect its own leader
            try:
                ack = await jsc.publish(in_subject("r3"), b"x")
            except (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError, TimeoutError):
                return False
            return ack.stream == settings.stream

        await eventually(stored, "a publish to the new R3 stream acknowledged", timeout=10)
    finally:
        await client.close()


def test_a_killed_meta_leader_is_replaced_and_rejoins(nats_cluster: Cluster) -> None:
    old = nats_cluster.meta_leader_index(timeout=10)
    nats_cluster.kill(old)
    new = nats_cluster.meta_leader_index(timeout=20)
    assert new != old
    nats_cluster.restart(old)
    assert nats_cluster[old].running


# ---------------------------------------------------------------------------------------------- testcontainers


@pytest.mark.skipif(docker_available(), reason="a Docker engine answers here: the container test runs instead")
def test_choosing_testcontainers_without_a_docker_engine_is_a_clear_error_not_a_hang() -> None:
    refusal = pytest.raises(BackendUnavailable, match="needs the testcontainers package and a running Docker engine")
    with refusal, container_server():
        pass


def test_an_unknown_test_server_backend_is_named_in_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from natsfixtures import TEST_BACKEND_ENV, TEST_URL_ENV, nats_server

    monkeypatch.delenv(TEST_URL_ENV, raising=False)
    monkeypatch.setenv(TEST_BACKEND_ENV, "docker-compose")
    servers = nats_server.__wrapped__(tmp_path_factory)  # type: ignore[attr-defined]
    with pytest.raises(BackendUnavailable, match="must be 'embedded' or 'testcontainers', got 'docker-compose'"):
        next(servers)


@pytest.mark.skipif(not docker_available(), reason="no Docker engine answers here (CI has none)")
@on_module_loop
async def test_the_official_nats_image_started_by_testcontainers_holds_a_session() -> None:
    from sessionlog.log import SessionLog

    with container_server() as server:
        log = await SessionLog.connect(log_settings(server.url))
        try:
            writer = await log.create(new_session_id())
            first = await writer.emit("turn/start", {"turn": 1})
            assert await writer.flush() == 0
            await writer.close()
            _, session, _ = await log.load(writer.session_id)
            assert [e.raw for e in session] == [first.raw]
        finally:
            await log.close()
