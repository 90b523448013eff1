"""The fleet at scale: every projection run as REPLICAS processes that split the partitions through the lease
bucket, SESSIONS sessions resident, then one replica of each projection killed (SIGKILL) and a new one added.

Phases, one nats-server (then the same on a 3-node cluster with R3 streams):
1. start REPLICAS `sessionlog serve <projection>` processes per projection (claiming partitions, lease TTL
   LEASE_TTL_S), and wait until they have split the partitions;
2. populate: WRITER_PROCESSES processes create SESSIONS sessions with one closed turn each; wait until every
   projection has applied all of it; memory per 1,000 resident sessions = (RSS now - RSS when ready) / sessions
   held, per replica (the median over the replicas that hold at least 90% of an even share: one that lost
   partitions meanwhile holds fewer sessions than its memory grew for);
3. live: the same processes reopen ACTIVE of those sessions and write further turns at LIVE_RATE events/s
   (flushing where an agent does); BEFORE_S seconds in, one replica of each projection is killed with SIGKILL;
   ADD_AFTER_S later a new one is started; the run goes on AFTER_S more seconds.

Meanwhile the driver samples every SAMPLE_S: each replica's /healthz (partitions it owns, sessions it holds) and
each projection's durable consumer per partition (the runner's `<projection>-p<N>`): the lag of a partition is
the age of its oldest record not yet acknowledged (0 when nothing is pending), which is seen whether or not a
live replica owns the partition. Reported per projection: lag p50/p99 before the kill, during (kill to recovery)
and after; takeover (kill until every partition is owned by a live replica again), recovery (takeover until the
lag stays at or under the before-kill p99 for a second), rebalance (the new replica started until it owns its
share), partition moves (ownership changes seen; beyond the kill and the add they are leases lost to starvation).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from sessionlog.embedded import Cluster, EmbeddedServer, free_port
from sessionlog.errors import SessionLogError
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.provision import wait_until_served
from sessionlog.record import partition_filter
from sessionlog.settings import Settings

from .common import QUICK, clean_env, pct, rss_mib, scale, scalef, spawn, stop
from .synth import LogBuilder

PROJECTIONS = ("context-deriver", "repairer", "token-auditor", "ui-replayer")
if QUICK:
    PROJECTIONS = ("context-deriver",)
REPLICAS = scale(4, 2)
SESSIONS = int(os.environ.get("BENCH_FLEET_SESSIONS", "0")) or scale(10_000, 100)
ACTIVE = scale(200, 20)
LIVE_RATE = scale(500, 200)
WRITER_PROCESSES = scale(4, 2)
# Partition leases: a replica refreshes every TTL/3. At 3 s, replicas starved of CPU on this shared 2-core machine
# (load average 20) missed refreshes and partitions kept moving (each move recreates the durable consumer).
LEASE_TTL_S = scalef(5.0, 2.0)
SAMPLE_S = 0.25
BEFORE_S = scalef(15.0, 2.0)
ADD_AFTER_S = scalef(15.0, 4.0)
AFTER_S = scalef(30.0, 3.0)
LIVE_START_S = scalef(6.0, 2.0)  # the live writers' processes start and open their sessions meanwhile
PARTITIONS = 8
# Where the fleet runs: "single,cluster" (both, the default), or one of them for a look at it alone.
WHERE = os.environ.get("BENCH_FLEET_WHERE", "single,cluster").split(",")


def first_turn() -> list[bytes]:
    builder = LogBuilder()
    builder.turn_with_tools(deltas=10, tools=1)
    return builder.events


def later_turns(turns: int) -> list[bytes]:
    """The events after the first turn, for `turns` more turns (a session holding `first_turn()` continues)."""
    builder = LogBuilder()
    builder.turn_with_tools(deltas=10, tools=1)
    start = len(builder.events)
    for _ in range(turns):
        builder.turn_with_tools(deltas=10, tools=1)
    return builder.events[start:]


FLUSH_TYPES = (b'"step/start"', b'"tool/call"', b'"turn/end"')


# ---------------------------------------------------------------------------------------------- writers


async def _populate(url: str, sessions: list[str], settings_extra: dict[str, Any]) -> tuple[float, list[str]]:
    """Each session created with one closed turn; the sessions that failed (with why) are returned, not raised."""
    events = first_turn()
    log = await SessionLog.connect(Settings(_env_file=None, nats_url=url, **settings_extra))
    start = time.perf_counter()
    queue = list(sessions)
    failed: list[str] = []

    async def worker() -> None:
        while queue:
            sid = queue.pop()
            try:
                writer = await log.create(sid)
                for raw in events:
                    await writer.append(raw)
                await writer.close()
            except SessionLogError as err:
                failed.append(f"{sid}: {err.code}: {err}")

    await asyncio.gather(*(worker() for _ in range(50)))
    elapsed = time.perf_counter() - start
    await log.close()
    return elapsed, failed


def populate_process(url: str, sessions: list[str], settings_extra: dict[str, Any]) -> tuple[float, list[str]]:
    return asyncio.run(_populate(url, sessions, settings_extra))


async def _live(url: str, sessions: list[str], rate: float, until: float, settings_extra: dict[str, Any]) -> dict:
    log = await SessionLog.connect(Settings(_env_file=None, nats_url=url, **settings_extra))
    events = later_turns(max(2, int(rate * (until - time.time()) / len(sessions)) // 20 + 2))
    writers: list[SessionWriter] = [await log.open(sid) for sid in sessions]
    cursor = [0] * len(writers)
    flushes: list[float] = []
    errors: list[str] = []
    pending: set[asyncio.Task[None]] = set()

    async def flush(writer: SessionWriter) -> None:
        t = time.perf_counter()
        try:
            await writer.flush()
        except Exception as err:  # reported, never hidden
            errors.append(f"{type(err).__name__}: {err}")
            return
        flushes.append(time.perf_counter() - t)

    emitted = 0
    began = time.perf_counter()
    turn = 0
    failed: set[int] = set()  # sessions whose writer failed: counted in the errors, not written further
    while time.time() < until:
        due = int(rate * (time.perf_counter() - began)) - emitted
        for _ in range(max(0, due)):
            i = turn % len(writers)
            turn += 1
            if cursor[i] >= len(events) or i in failed:
                continue
            raw = events[cursor[i]]
            cursor[i] += 1
            try:
                await writers[i].append(raw)
            except SessionLogError as err:  # a failed flush fails the writer: the next append raises it
                errors.append(f"{err.code}: {err}")
                failed.add(i)
                continue
            emitted += 1
            if any(kind in raw[:60] for kind in FLUSH_TYPES):
                task = asyncio.create_task(flush(writers[i]))
                pending.add(task)
                task.add_done_callback(pending.discard)
        await asyncio.sleep(0.005)
    await asyncio.gather(*pending)
    for writer in writers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.close(), 10)
    await log.close()
    return {
        "emitted": emitted,
        "seconds": time.perf_counter() - began,
        "flushes": flushes,
        "errors": errors,
        "failed_writers": len(failed),
    }


def live_process(url: str, sessions: list[str], rate: float, until: float, settings_extra: dict[str, Any]) -> dict:
    return asyncio.run(_live(url, sessions, rate, until, settings_extra))


# ---------------------------------------------------------------------------------------------- replicas


class Replica:
    def __init__(self, projection: str, index: int, url: str, workdir: Path, replicas: int) -> None:
        self.projection = projection
        self.index = index
        self.port = free_port()
        env = clean_env(
            SESSIONLOG_NATS_URL=url,
            SESSIONLOG_METRICS_PORT=str(self.port),
            SESSIONLOG_UI_PORT=str(free_port()),
            SESSIONLOG_LEASE_TTL_S=str(LEASE_TTL_S),
            SESSIONLOG_REPLICAS=str(replicas),
        )
        self.proc = spawn(["-m", "sessionlog", "serve", projection], env, workdir / f"{projection}-{index}.log")
        self.ready_rss: float | None = None
        self.killed_at: float | None = None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    async def health(self, client: httpx.AsyncClient) -> dict[str, Any] | None:
        try:
            reply = await client.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2.0)
            component: dict[str, Any] = reply.json()["components"][self.projection]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        if component.get("state") == "starting":
            return None  # its health server answers, its projection has not started: it owns nothing yet
        return component


def _stamp(headers: dict[str, str]) -> float | None:
    text = headers.get("Nats-Time-Stamp")
    if not text:
        return None
    main, _, frac = text.rstrip("Z").partition(".")
    base = datetime.datetime.fromisoformat(main).replace(tzinfo=datetime.UTC).timestamp()
    return base + (float("0." + frac) if frac else 0.0)


async def partition_lag(log: SessionLog, projection: str, number: int) -> float | None:
    """Seconds since the oldest record of the partition the projection's consumer has not acknowledged."""
    try:
        info = await log.js.consumer_info(log.settings.stream, f"{projection}-p{number}")
    except Exception:
        return None  # not created yet
    if not info.num_pending and not info.num_ack_pending:
        return 0.0
    # A consumer a new owner just recreated at its checkpoint reports an ack floor of 0 until its first ack: its
    # start sequence is the floor then. With nothing awaiting an ack, everything delivered is applied.
    floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
    if not floor and info.config.opt_start_seq:
        floor = info.config.opt_start_seq - 1
    if not info.num_ack_pending and info.delivered and info.delivered.stream_seq:
        floor = max(floor, info.delivered.stream_seq)
    batch, _ = await log.reader.direct_batch(partition_filter(number), floor + 1, batch=1)
    if not batch:
        return 0.0
    stamp = _stamp(batch[0].headers)
    return None if stamp is None else max(0.0, time.time() - stamp)


async def wait_caught_up(log: SessionLog, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        lags = [await partition_lag(log, p, n) for p in PROJECTIONS for n in range(PARTITIONS)]
        if all(lag == 0.0 for lag in lags):
            return time.perf_counter() - start
        await asyncio.sleep(0.5)
    raise TimeoutError(f"projections not caught up after {timeout}s")


async def wait_split(replicas: list[Replica], client: httpx.AsyncClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owned: dict[str, set[int]] = {p: set() for p in PROJECTIONS}
        counts: dict[str, list[int]] = {p: [] for p in PROJECTIONS}
        for replica in replicas:
            health = await replica.health(client)
            if health is not None and health.get("ready"):
                owned[replica.projection] |= set(health["partitions"])
                counts[replica.projection].append(len(health["partitions"]))
        share = math.ceil(PARTITIONS / REPLICAS)
        if all(len(owned[p]) == PARTITIONS and len(counts[p]) == REPLICAS and max(counts[p]) <= share
               for p in PROJECTIONS):  # fmt: skip
            return
        await asyncio.sleep(0.25)
    raise TimeoutError("replicas did not split the partitions")


# ---------------------------------------------------------------------------------------------- one fleet


async def fleet(url: str, workdir: Path, replicas_r: int) -> dict[str, Any]:
    settings_extra = {"replicas": replicas_r}
    log = await SessionLog.connect(Settings(_env_file=None, nats_url=url, **settings_extra))
    await wait_until_served(log.nc, log.js, log.settings, 60)
    replicas = [Replica(p, i, url, workdir, replicas_r) for p in PROJECTIONS for i in range(REPLICAS)]
    ctx = multiprocessing.get_context("spawn")
    client = httpx.AsyncClient()
    try:
        started = time.perf_counter()
        await wait_split(replicas, client, 120)
        split_s = time.perf_counter() - started
        for replica in replicas:
            replica.ready_rss = rss_mib(replica.proc.pid)
        run = uuid.uuid4().hex[:6]
        ids = [f"f{run}-{i}" for i in range(SESSIONS)]
        slices = [ids[k::WRITER_PROCESSES] for k in range(WRITER_PROCESSES)]
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(WRITER_PROCESSES, mp_context=ctx) as pool:
            started = time.perf_counter()
            populated = await asyncio.gather(
                *(loop.run_in_executor(pool, populate_process, url, s, settings_extra) for s in slices)
            )
            populate_s = time.perf_counter() - started
        populate_failed = [f for _, failures in populated for f in failures]
        failed_ids = {f.split(":", 1)[0] for f in populate_failed}
        catch_up_s = await wait_caught_up(log, 300)
        memory = []
        for replica in replicas:
            health = await replica.health(client)
            rss = rss_mib(replica.proc.pid)
            held = health["sessions"] if health else 0
            if rss is not None and replica.ready_rss is not None and held:
                # A replica that lost partitions meanwhile (leases lapsed under load) keeps the memory it grew
                # by but holds fewer sessions: only replicas holding their share are measured.
                memory.append({"projection": replica.projection, "sessions": held, "rss_mib": rss,
                               "mib_per_1000_sessions": (rss - replica.ready_rss) / held * 1000,
                               "held_share": held >= 0.9 * SESSIONS / REPLICAS})  # fmt: skip
        # live phase
        active = [sid for sid in ids if sid not in failed_ids][:ACTIVE]
        live_slices = [active[k::WRITER_PROCESSES] for k in range(WRITER_PROCESSES)]
        total_s = BEFORE_S + ADD_AFTER_S + AFTER_S
        samples: list[dict[str, Any]] = []
        events: dict[str, float] = {}
        with ProcessPoolExecutor(WRITER_PROCESSES, mp_context=ctx) as pool:
            begin_at = time.time() + LIVE_START_S
            until = begin_at + total_s
            writers = [loop.run_in_executor(pool, live_process, url, s, LIVE_RATE / WRITER_PROCESSES, until,
                                            settings_extra) for s in live_slices]  # fmt: skip
            await asyncio.sleep(max(0.0, begin_at - time.time()))
            t0 = time.time()
            killed: list[Replica] = []
            added: list[Replica] = []
            while time.time() < until:
                now = time.time() - t0
                if not killed and now >= BEFORE_S:
                    for projection in PROJECTIONS:
                        victim = next(r for r in replicas if r.projection == projection and r.alive)
                        victim.proc.kill()
                        victim.proc.wait()
                        victim.killed_at = now
                        killed.append(victim)
                    events["kill"] = now
                if killed and not added and now >= BEFORE_S + ADD_AFTER_S:
                    for projection in PROJECTIONS:
                        newcomer = Replica(projection, REPLICAS, url, workdir, replicas_r)
                        replicas.append(newcomer)
                        added.append(newcomer)
                    events["add"] = now
                samples.append(await sample(log, replicas, client, now))
                await asyncio.sleep(max(0.0, SAMPLE_S - (time.time() - t0 - now)))
            live = [await w for w in writers]
        return {
            "replicas_per_projection": REPLICAS,
            "stream_replicas": replicas_r,
            "sessions": SESSIONS,
            "active_sessions": ACTIVE,
            "live_target_events_per_s": LIVE_RATE,
            "live_reached_events_per_s": sum(p["emitted"] for p in live) / max(p["seconds"] for p in live),
            "live_flush": _flush_stats([x for p in live for x in p["flushes"]]),
            "live_errors": sum(len(p["errors"]) for p in live),
            "live_failed_writers": sum(p["failed_writers"] for p in live),
            "first_errors": [e for p in live for e in p["errors"]][:3],
            "lease_ttl_s": LEASE_TTL_S,
            "split_s": split_s,
            "populate_s": populate_s,
            "populate_sessions_per_s": SESSIONS / populate_s,
            "populate_failed": len(populate_failed),
            "populate_first_failures": populate_failed[:3],
            "catch_up_after_populate_s": catch_up_s,
            "memory": memory,
            "mib_per_1000_sessions": {
                p: pct([m["mib_per_1000_sessions"] for m in memory if m["projection"] == p and m["held_share"]], 0.5)
                for p in PROJECTIONS
            },
            "events": events,
            "per_projection": {p: analyse(p, samples, events) for p in PROJECTIONS},
            "timeline": samples,
        }
    finally:
        await client.aclose()
        for replica in replicas:
            stop(replica.proc, 10)
        await log.close()


def _flush_stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": pct(values, 0.5) * 1e3, "p99_ms": pct(values, 0.99) * 1e3}


async def sample(log: SessionLog, replicas: list[Replica], client: httpx.AsyncClient, now: float) -> dict[str, Any]:
    # Every partition of every projection and every replica's health at once: on a cluster one consumer info is a
    # round trip to that consumer's leader, and asked in turn they made a sample take over a second.
    alive = [r for r in replicas if r.alive]
    asked = [partition_lag(log, p, n) for p in PROJECTIONS for n in range(PARTITIONS)]
    answers = await asyncio.gather(*asked, *(r.health(client) for r in alive))
    lag_values, healths = answers[: len(asked)], answers[len(asked) :]
    lags: dict[str, list[float | None]] = {
        p: list(lag_values[i * PARTITIONS : (i + 1) * PARTITIONS]) for i, p in enumerate(PROJECTIONS)
    }
    owners: dict[str, dict[str, list[int]]] = {p: {} for p in PROJECTIONS}
    pending: dict[str, dict[str, int]] = {p: {} for p in PROJECTIONS}
    for replica, health in zip(alive, healths, strict=True):
        if health is not None:
            owners[replica.projection][str(replica.index)] = health["partitions"]
            pending[replica.projection].update({str(k): v for k, v in health["lag_events"].items()})
    return {"t": round(now, 3), "lag_s": lags, "owners": owners, "pending_records": pending}


def analyse(projection: str, samples: list[dict[str, Any]], events: dict[str, float]) -> dict[str, Any]:
    kill, add = events.get("kill", math.inf), events.get("add", math.inf)

    def lag_of(s: dict[str, Any]) -> float:
        return max((x for x in s["lag_s"][projection] if x is not None), default=0.0)

    def owned(s: dict[str, Any]) -> int:
        return len({n for parts in s["owners"][projection].values() for n in parts})

    before = [lag_of(s) for s in samples if s["t"] < kill]
    p99_before = pct(before, 0.99)
    takeover = next((s["t"] - kill for s in samples if s["t"] > kill and owned(s) == PARTITIONS), None)
    recovered = None
    taken = kill + (takeover if takeover is not None else math.inf)
    after_kill = [s for s in samples if s["t"] >= taken]
    for k, s in enumerate(after_kill):
        # from this sample through the first one a second or more later (samples may be further apart than that)
        later = next((j for j in range(k, len(after_kill)) if after_kill[j]["t"] >= s["t"] + 1.0), None)
        if later is not None and all(lag_of(x) <= p99_before for x in after_kill[k : later + 1]):
            recovered = s["t"] - taken
            break
    end_during = taken + recovered if recovered is not None else math.inf
    during = [lag_of(s) for s in samples if kill <= s["t"] <= end_during]
    after = [lag_of(s) for s in samples if s["t"] > end_during]
    share = math.ceil(PARTITIONS / REPLICAS)
    newcomer = str(REPLICAS)
    rebalanced = next(
        (s["t"] - add for s in samples if s["t"] > add and len(s["owners"][projection].get(newcomer, [])) >= share - 1
         and all(len(v) <= share for v in s["owners"][projection].values())),
        None,
    )  # fmt: skip
    final = samples[-1]["owners"][projection] if samples else {}
    moves = 0  # a partition seen owned by another replica than at its previous sighting
    last_owner: dict[int, str] = {}
    for s in samples:
        for replica, parts in s["owners"][projection].items():
            for n in parts:
                moves += n in last_owner and last_owner[n] != replica
                last_owner[n] = replica
    return {
        "lag_before_s": {"p50": pct(before, 0.5), "p99": p99_before, "n": len(before)},
        "lag_during_s": {"p50": pct(during, 0.5), "p99": pct(during, 0.99), "max": max(during, default=0.0)},
        "lag_after_s": {"p50": pct(after, 0.5), "p99": pct(after, 0.99), "n": len(after)},
        "takeover_s": takeover,
        "recovered_after_takeover_s": recovered,
        "watched_after_kill_s": samples[-1]["t"] - kill if samples and kill < math.inf else None,
        "lag_threshold_s": p99_before,
        "rebalanced_s": rebalanced,
        "partition_moves": moves,
        "partitions_at_end": {k: sorted(v) for k, v in final.items()},
    }


# ---------------------------------------------------------------------------------------------- main


def _run(url: str, workdir: Path, replicas_r: int) -> dict[str, Any]:
    return asyncio.run(fleet(url, workdir, replicas_r))


def main() -> dict[str, Any]:
    out: dict[str, Any] = {"benchmark": "fleet", "projections": list(PROJECTIONS)}
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        folder = Path(tmp)
        if os.environ.get("BENCH_FLEET_LOGS"):  # the replicas' logs kept there, for a run that needs a look
            folder = Path(os.environ["BENCH_FLEET_LOGS"])
            folder.mkdir(parents=True, exist_ok=True)
        if "single" in WHERE:
            server = EmbeddedServer(folder / "single").start()
            try:
                out["single"] = _run(server.url, folder, 1)
            except Exception:  # the cluster still runs; the document says what failed
                out["single"] = {"error": traceback.format_exc()}
            finally:
                server.kill()
        if "cluster" in WHERE:
            cluster = Cluster(folder / "cluster", size=3, name=f"b{uuid.uuid4().hex[:6]}").start()
            try:
                out["cluster"] = _run(cluster.url, folder, 3)
            except Exception:
                out["cluster"] = {"error": traceback.format_exc()}
            finally:
                for node in cluster.servers:
                    node.kill()
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    sys.stdout.write("\n")
