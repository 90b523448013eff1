"""How long a 3-node R3 cluster is without a stream leader after the leader's kill -9, against the writer's defaults.

Each round moves the lease bucket's leader to the event stream's leader (so one kill takes both), kills that node
with SIGKILL and measures the time until a publish to the event stream is acknowledged again; a writer with the
default settings flushes a record meanwhile and must ride through (no error). The node is restarted before the
next round. The defaults must cover the worst election with margin: `publish_retry_s` (the publish retry budget)
and `lease_ttl_s - lease_refresh_s` (how long a lease outlives a missed refresh).

Run alone (it kills nodes): `python -m bench bench_election`. Prints one JSON document.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sessionlog.embedded import Cluster
from sessionlog.log import SessionLog
from sessionlog.provision import resources
from sessionlog.settings import Settings

ROUNDS = 5


async def _leader(log: SessionLog, stream: str) -> str:
    while True:
        with contextlib.suppress(Exception):
            info = await log.js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader:
                return str(info.cluster.leader)
        await asyncio.sleep(0.1)


async def _move_leader(log: SessionLog, stream: str, to: str) -> None:
    while await _leader(log, stream) != to:
        request = json.dumps({"placement": {"preferred": to}}).encode()
        with contextlib.suppress(Exception):
            await log.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, timeout=5.0)
        await asyncio.sleep(0.5)


async def _all_led(log: SessionLog) -> None:
    for resource in resources(log.settings):
        await _leader(log, resource.stream)


async def _round(cluster: Cluster, log: SessionLog) -> dict[str, Any]:
    settings = log.settings
    await _all_led(log)
    leader = await _leader(log, settings.stream)
    await _move_leader(log, f"KV_{settings.kv_leases}", leader)
    writer = await log.create(f"bench-{uuid.uuid4().hex[:8]}")
    await writer.emit("turn/start", {"turn": 1})
    await writer.flush()
    index = next(i for i, server in enumerate(cluster.servers) if server.server_name == leader)

    cluster.kill(index)
    killed = time.monotonic()
    probe = "sessionlog.in.bench-probe"  # an empty payload: the stream stores it, no reader looks at it
    acked = None
    while acked is None:
        try:
            reply = await log.nc.request(probe, b"[]", timeout=1.0)
            if b'"error"' not in reply.data:
                acked = time.monotonic() - killed
        except Exception:
            await asyncio.sleep(0.05)
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    try:
        await writer.flush()
        outcome = "rode through"
    except Exception as err:
        outcome = f"fenced: {err}"
    await writer.abandon()
    await asyncio.to_thread(cluster.restart, index)
    return {"acknowledged_again_s": round(acked, 2), "default_writer": outcome}


async def _run(rounds: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="bench-election-"))
    cluster = Cluster(base, size=3, name=f"e{uuid.uuid4().hex[:4]}").start()
    try:
        settings = Settings(_env_file=None, nats_url=cluster.url, replicas=3)
        log = None
        deadline = time.monotonic() + 60
        while log is None:
            try:
                log = await SessionLog.connect(settings)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        results = [await _round(cluster, log) for _ in range(rounds)]
        await log.close()
    finally:
        for server in cluster.servers:
            server.kill()
    times = [r["acknowledged_again_s"] for r in results]
    return {
        "rounds": results,
        "election_s": {"min": min(times), "median": statistics.median(times), "max": max(times)},
        "defaults": {
            "publish_retry_s": settings.publish_retry_s,
            "lease_outlives_missed_refresh_s": settings.lease_ttl_s - settings.effective_lease_refresh_s,
        },
    }


def main(rounds: int = ROUNDS) -> dict[str, Any]:
    return asyncio.run(_run(rounds))


if __name__ == "__main__":
    json.dump(main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS), sys.stdout, indent=2)
    sys.stdout.write("\n")
