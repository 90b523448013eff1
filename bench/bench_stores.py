"""The log against what a team would pick instead, on one workload in one run.

The workload is a realistic agent session (`synth.synthetic_log`): turns with a user message, a step that streams
text chunks (provider-sized deltas) and calls tools, the tool results, an answer; every COMPACT_EVERY turns a
compaction replaces the conversation so far with a summary. An agent flushes before every provider request and
before every tool body (`bench_projections.flush_points`), so those are the batch boundaries for every store.

- `floor`: raw nats-py publishes of the same events, one per message: awaited one by one (sync) and all in flight
  (`publish_async`); the session log's writer flushing at the agent's flush points.
- `sqlite`: one row per event (WAL, `synchronous=NORMAL`: like JetStream's file store, no fsync per commit),
  committed per event and per flush point, and read back in order with one envelope decode per event.
- `naive`: the design the log replaces: one mutable messages array per session in a JSON file, read, spliced and
  rewritten (atomic replace) for every message and every compaction. Chunks have no place in it. Reported: the
  cost per message against the array's size, the bytes written, and the originals it lost at compactions
  (counted: messages ever appended that the store can no longer return), against the log's count from a read-back.
- `concurrent`: 100 and 1,000 sessions at once from WRITER_PROCESSES processes, each session replaying the agent
  workload as fast as the stores take it (no model think time); the same with SQLite (one file, every process).
- `read_100k`: SQLite reading a 100,000-event session back in order (bench_log reads the same log from the stream).
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import sqlite3
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from sessionlog.embedded import EmbeddedServer
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.record import in_subject
from sessionlog.settings import Settings

from .common import scale, scalef, stats_ms
from .synth import synthetic_log

AGENT_EVENTS = scale(20_000, 1_500)
COMPACT_EVERY = 10
DELTAS = 40
WRITER_PROCESSES = 4
CONCURRENT = (100, 1_000) if scale(1, 0) else (20,)
CONCURRENT_EVENTS = scale(150, 60)  # per session: about two turns with tools
READ_EVENTS = scale(100_000, 5_000)
NAIVE_SIZES = (100, 1_000, 10_000) if scale(1, 0) else (100, 1_000)
NAIVE_SAMPLES = scale(30, 5)

_MESSAGE_TYPES = (b'"user/message"', b'"assistant/message"', b'"tool/result"')


class _Envelope(msgspec.Struct):
    type: str
    data: msgspec.Raw
    seq: int | None = None
    time: int | None = None
    surfaceOp: Any = None


_envelope = msgspec.json.Decoder(_Envelope)


def flush_points(events: list[bytes]) -> set[int]:
    """Where an agent flushes: before each provider request (step/start), each tool body (tool/call), turn end."""
    return {i for i, raw in enumerate(events) if _envelope.decode(raw).type in ("step/start", "tool/call", "turn/end")}


def agent_workload(n: int) -> tuple[list[bytes], set[int]]:
    events = synthetic_log(n, deltas=DELTAS, compact_every=COMPACT_EVERY)
    return events, flush_points(events)


# ---------------------------------------------------------------------------------------------- the log


async def write_session(writer: SessionWriter, events: list[bytes], points: set[int], flushes: list[float]) -> None:
    """Append every event, flushing at each of `points` (an agent's flush points) and at the end; each flush's
    latency goes to `flushes`."""
    for i, raw in enumerate(events):
        await writer.append(raw)
        if i in points:
            t = time.perf_counter()
            await writer.flush()
            flushes.append(time.perf_counter() - t)
    await writer.flush()


async def log_agent(log: SessionLog, events: list[bytes], points: set[int]) -> dict[str, Any]:
    """The writer on the agent workload: append every event, flush at the flush points."""
    writer = await log.create(f"agent-{uuid.uuid4().hex[:8]}")
    flushes: list[float] = []
    gc.collect()
    start = time.perf_counter()
    await write_session(writer, events, points, flushes)
    elapsed = time.perf_counter() - start
    sid = writer.session_id
    await writer.close()
    back = await log.reader.events(sid)
    kept = sum(1 for raw in back if any(m in raw[:60] for m in _MESSAGE_TYPES))
    return {
        "events": len(events),
        "flushes": len(flushes),
        "events_per_s": len(events) / elapsed,
        "flush": stats_ms(flushes),
        "messages_written": sum(1 for raw in events if any(m in raw[:60] for m in _MESSAGE_TYPES)),
        "messages_readable_after": kept,
    }


async def raw_floors(log: SessionLog, events: list[bytes]) -> dict[str, Any]:
    """One event per message: each publish awaited (sync), and every publish in flight at once (async)."""
    subject = in_subject(f"raw-{uuid.uuid4().hex[:8]}")
    sync_events = events[: scale(3_000, 300)]
    samples = []
    start = time.perf_counter()
    for raw in sync_events:
        t = time.perf_counter()
        await log.js.publish(subject, raw)
        samples.append(time.perf_counter() - t)
    sync_rate = len(sync_events) / (time.perf_counter() - start)
    start = time.perf_counter()
    window = 1_000  # nats-py's pending limit is 4,000 by default; stay below it
    for k in range(0, len(events), window):
        for raw in events[k : k + window]:
            await log.js.publish_async(subject, raw)
        await log.js.publish_async_completed()
    async_rate = len(events) / (time.perf_counter() - start)
    return {
        "sync": {"events": len(sync_events), "events_per_s": sync_rate, "publish": stats_ms(samples)},
        "async": {"events": len(events), "events_per_s": async_rate},
    }


# ---------------------------------------------------------------------------------------------- SQLite


def sqlite_open(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, timeout=60)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS events (session TEXT, seq INTEGER, data BLOB, PRIMARY KEY (session, seq))")
    return db


def sqlite_write(db: sqlite3.Connection, session: str, events: list[bytes], points: set[int] | None) -> dict[str, Any]:
    """Insert every event; commit after each (points None) or at each flush point."""
    commits: list[float] = []
    insert = "INSERT INTO events VALUES (?, ?, ?)"
    start = time.perf_counter()
    db.execute("BEGIN")
    for i, raw in enumerate(events):
        db.execute(insert, (session, i, raw))
        if points is None or i in points:
            t = time.perf_counter()
            db.execute("COMMIT")
            commits.append(time.perf_counter() - t)
            db.execute("BEGIN")
    db.execute("COMMIT")
    elapsed = time.perf_counter() - start
    return {"events": len(events), "commits": len(commits), "events_per_s": len(events) / elapsed, **_commit(commits)}


def _commit(samples: list[float]) -> dict[str, Any]:
    return {"commit": stats_ms(samples)}


def sqlite_read(db: sqlite3.Connection, session: str) -> tuple[int, float]:
    start = time.perf_counter()
    count = 0
    for (raw,) in db.execute("SELECT data FROM events WHERE session = ? ORDER BY seq", (session,)):
        _envelope.decode(raw)
        count += 1
    return count, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- naive


class NaiveStore:
    """One JSON messages array per session, rewritten whole (write to a temporary file, then rename)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.bytes_written = 0

    def _path(self, session: str) -> Path:
        return self.folder / f"{session}.json"

    def read(self, session: str) -> list[Any]:
        path = self._path(session)
        return msgspec.json.decode(path.read_bytes()) if path.exists() else []

    def write(self, session: str, messages: list[Any]) -> None:
        data = msgspec.json.encode(messages)
        tmp = self._path(session).with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self._path(session))
        self.bytes_written += len(data)

    def append(self, session: str, message: Any) -> None:
        messages = self.read(session)
        messages.append(message)
        self.write(session, messages)

    def splice(self, session: str, start: int, end: int, summary: Any) -> None:
        messages = self.read(session)
        messages[start : end + 1] = [summary]
        self.write(session, messages)


def _message_of(raw: bytes) -> tuple[Any, Any] | None:
    """(message, surface op) of a message event, None for any other event."""
    if not any(m in raw[:60] for m in _MESSAGE_TYPES):
        return None
    event = msgspec.json.decode(raw)
    data = event["data"]
    return data.get("message", data), event.get("surfaceOp")


def naive_agent(folder: Path, events: list[bytes]) -> dict[str, Any]:
    """The agent workload through the naive store: every message appended, every compaction spliced."""
    store = NaiveStore(folder)
    session = f"naive-{uuid.uuid4().hex[:8]}"
    ops: list[float] = []
    appended = 0
    ids_ever: list[str] = []
    start = time.perf_counter()
    for raw in events:
        found = _message_of(raw)
        if found is None:
            continue  # chunks, turn and step markers: the messages array has no place for them
        message, op = found
        t = time.perf_counter()
        if isinstance(op, dict) and op.get("op") == "replace":
            current = store.read(session)
            store.splice(session, 0, len(current) - 1, message)  # what the compaction replaced is gone
        else:
            store.append(session, message)
        ops.append(time.perf_counter() - t)
        appended += 1
        ids_ever.append(message["id"])
    elapsed = time.perf_counter() - start
    final = store.read(session)
    left = {m["id"] for m in final}
    return {
        "events_offered": len(events),
        "messages": appended,
        "messages_per_s": appended / elapsed,
        "op": stats_ms(ops),
        "bytes_written": store.bytes_written,
        "messages_in_store_after": len(final),
        "originals_lost": sum(1 for i in ids_ever if i not in left),
        "chunks_dropped": sum(1 for raw in events if b'"assistant/chunk"' in raw[:60]),
    }


def naive_cost_by_size(folder: Path) -> list[dict[str, Any]]:
    """The cost of one more message against the array's size (read + append + rewrite)."""
    store = NaiveStore(folder)
    message = {"id": "m", "role": "user", "source": {"kind": "user"}, "content": [{"type": "text", "text": "q" * 200}]}
    out = []
    for size in NAIVE_SIZES:
        session = f"size-{size}"
        store.write(session, [dict(message, id=f"m{i}") for i in range(size)])
        samples = []
        for _ in range(NAIVE_SAMPLES):
            t = time.perf_counter()
            store.append(session, message)
            samples.append(time.perf_counter() - t)
        out.append({"messages": size, **stats_ms(samples)})
    return out


async def log_cost_by_size(log: SessionLog) -> list[dict[str, Any]]:
    """The log's cost of one more message (append + flush) against the session's size, the same sizes."""
    from .bench_projections import chat_log

    out = []
    for size in NAIVE_SIZES:
        writer = await log.create(f"size-{size}-{uuid.uuid4().hex[:6]}")
        for raw in chat_log(size):
            await writer.append(raw)
        await writer.flush()
        turn = writer.session.last_turn + 1
        await writer.emit("turn/start", {"turn": turn})
        await writer.flush()
        samples = []
        for i in range(NAIVE_SAMPLES):
            message = {"id": f"x{i}", "role": "user", "source": {"kind": "user"},
                       "content": [{"type": "text", "text": "q" * 200}]}  # fmt: skip
            t = time.perf_counter()
            await writer.emit("user/message", message, surface_op="append")
            await writer.flush()
            samples.append(time.perf_counter() - t)
        await writer.close()
        out.append({"messages": size, **stats_ms(samples)})
    return out


# ---------------------------------------------------------------------------------------------- concurrent


async def _log_sessions(url: str, sessions: int, prefix: str, start_at: float) -> dict[str, Any]:
    events, points = agent_workload(CONCURRENT_EVENTS)
    log = await SessionLog.connect(Settings(_env_file=None, nats_url=url))
    writers: list[SessionWriter] = [await log.create(f"{prefix}-{i}") for i in range(sessions)]
    flushes: list[float] = []

    async def one(writer: SessionWriter) -> None:
        await write_session(writer, events, points, flushes)

    await asyncio.sleep(max(0.0, start_at - time.time()))
    start = time.perf_counter()
    await asyncio.gather(*(one(w) for w in writers))
    elapsed = time.perf_counter() - start
    for writer in writers:
        await writer.close()
    await log.close()
    return {"events": len(events) * sessions, "seconds": elapsed, "flushes": flushes}


def _log_process(url: str, sessions: int, prefix: str, start_at: float) -> dict[str, Any]:
    return asyncio.run(_log_sessions(url, sessions, prefix, start_at))


def _sqlite_process(path: str, sessions: int, prefix: str, start_at: float) -> dict[str, Any]:
    """The same sessions on one SQLite file shared by every process, interleaved batch by batch (a synchronous
    store serves one session at a time per process)."""
    events, points = agent_workload(CONCURRENT_EVENTS)
    db = sqlite_open(Path(path))
    cuts = sorted(points | {len(events) - 1})
    batches = [events[a + 1 if k else 0 : b + 1] for k, (a, b) in enumerate(zip([-1, *cuts], cuts, strict=False))]
    commits: list[float] = []
    time.sleep(max(0.0, start_at - time.time()))
    start = time.perf_counter()
    position = [0] * sessions
    for batch in batches:
        for s in range(sessions):
            t = time.perf_counter()
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO events VALUES (?, ?, ?)",
                [(f"{prefix}-{s}", position[s] + k, raw) for k, raw in enumerate(batch)],
            )
            db.execute("COMMIT")
            commits.append(time.perf_counter() - t)
            position[s] += len(batch)
    elapsed = time.perf_counter() - start
    db.close()
    return {"events": len(events) * sessions, "seconds": elapsed, "flushes": commits}


def concurrent(url: str, folder: Path) -> list[dict[str, Any]]:
    out = []
    ctx = multiprocessing.get_context("spawn")
    for sessions in CONCURRENT:
        for store in ("sessionlog", "sqlite"):
            share = sessions // WRITER_PROCESSES
            run = uuid.uuid4().hex[:6]
            start_at = time.time() + (scalef(4.0, 1.5) if sessions < 500 else 8.0)
            db = folder / f"concurrent-{run}.db"
            if store == "sqlite":
                sqlite_open(db).close()
            with ProcessPoolExecutor(WRITER_PROCESSES, mp_context=ctx) as pool:
                if store == "sessionlog":
                    futures = [pool.submit(_log_process, url, share, f"c{run}w{k}", start_at)
                               for k in range(WRITER_PROCESSES)]  # fmt: skip
                else:
                    futures = [pool.submit(_sqlite_process, str(db), share, f"c{run}w{k}", start_at)
                               for k in range(WRITER_PROCESSES)]  # fmt: skip
                parts = [f.result() for f in futures]
            flushes = [x for p in parts for x in p["flushes"]]
            events = sum(p["events"] for p in parts)
            seconds = max(p["seconds"] for p in parts)
            out.append({"store": store, "sessions": share * WRITER_PROCESSES, "writer_processes": WRITER_PROCESSES,
                        "events": events, "events_per_s": events / seconds, "flush": stats_ms(flushes)})  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- main


async def _with_log(url: str, events: list[bytes], points: set[int]) -> dict[str, Any]:
    log = await SessionLog.connect(Settings(_env_file=None, nats_url=url))
    try:
        floors = await raw_floors(log, events)
        agent = await log_agent(log, events, points)
        by_size = await log_cost_by_size(log)
    finally:
        await log.close()
    return {"floors": floors, "agent": agent, "by_size": by_size}


def main() -> dict[str, Any]:
    events, points = agent_workload(AGENT_EVENTS)
    with tempfile.TemporaryDirectory(prefix="bench-stores-") as tmp:
        folder = Path(tmp)
        server = EmbeddedServer(folder / "nats").start()
        try:
            measured = asyncio.run(_with_log(server.url, events, points))
            db = sqlite_open(folder / "events.db")
            per_event = sqlite_write(db, "per-event", events, None)
            batched = sqlite_write(db, "batched", events, points)
            big = synthetic_log(READ_EVENTS)[:READ_EVENTS]
            sqlite_write(db, "read", big, set(range(999, len(big), 1000)))
            best = float("inf")
            for _ in range(3):
                gc.collect()
                count, seconds = sqlite_read(db, "read")
                best = min(best, seconds)
            db.close()
            (folder / "naive").mkdir()
            naive = naive_agent(folder / "naive", events)
            naive_sizes = naive_cost_by_size(folder / "naive")
            crowd = concurrent(server.url, folder)
        finally:
            server.kill()
    agent = measured["agent"]
    return {
        "benchmark": "stores",
        "workload": {
            "events": len(events),
            "flush_points": len(points),
            "compact_every_turns": COMPACT_EVERY,
            "chunks": sum(1 for raw in events if b'"assistant/chunk"' in raw[:60]),
            "mean_event_bytes": sum(map(len, events)) / len(events),
        },
        "raw_publish": measured["floors"],
        "sessionlog_agent": agent,
        "sqlite_per_event": per_event,
        "sqlite_batched": batched,
        "sqlite_read_100k": {"events": count, "events_per_s": count / best},
        "naive": naive,
        "append_cost_by_size": {"naive": naive_sizes, "sessionlog": measured["by_size"]},
        "concurrent": crowd,
        "ratios": {
            "agent_over_raw_sync": agent["events_per_s"] / measured["floors"]["sync"]["events_per_s"],
            "agent_over_sqlite_per_event": agent["events_per_s"] / per_event["events_per_s"],
            "agent_over_sqlite_batched": agent["events_per_s"] / batched["events_per_s"],
            "agent_over_raw_async": agent["events_per_s"] / measured["floors"]["async"]["events_per_s"],
            "flush_p99_over_raw_sync_publish_p99": agent["flush"]["p99_ms"]
            / measured["floors"]["sync"]["publish"]["p99_ms"],
            "naive_p50_at_largest_over_smallest": naive_sizes[-1]["p50_ms"] / naive_sizes[0]["p50_ms"],
            "sessionlog_p50_at_largest_over_smallest": measured["by_size"][-1]["p50_ms"]
            / measured["by_size"][0]["p50_ms"],
        },
        "notes": "p99 by nearest rank; SQLite in WAL mode with synchronous=NORMAL (no fsync per commit, as JetStream)",
    }


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    sys.stdout.write("\n")
