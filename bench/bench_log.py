"""The JetStream log's speed, against baselines measured in the same run on the same server.

Writing: (a) raw nats-py `js.publish` of one event per message (the baseline: per-publish latency p50/p99),
(b) the writer with one event per flush (latency p50/p99; goal: within 1.25x of raw), (c) the writer streaming
chunks with a flush every 50 events (events/s; goal: at least 10x raw events/s).

Reading a 100,000-event session: `reader.events` (the session's records by batch direct get, each record's digest
verified, its payload cut into the events' bytes) against the floor: the raw batch direct gets of the same records
(`StreamReader.direct_batch` paging) plus one msgspec decode of each event (goal: at least 80% of the floor rate).
`SessionLog.load` is reported beside it: the same read plus the full SPEC validation of every event and the
session's state (surface, structure, derived messages), which is what open, resume and fork need; it has no goal.

Reading one session among many: INTERLEAVED_SESSIONS sessions of INTERLEAVED_RECORDS records each, written round
by round so that every session's records are spread over the whole stream (what a fleet's stream looks like), then
READ_SAMPLE of them read whole by `reader.records`, once by the session's stored subject (`sessionlog.events.<p>.<id>`,
what a reader does once connecting verified the partition count) and once by the wildcard over partitions
(`sessionlog.events.*.<id>`, what it did before): the server matches a wildcard against every record in between.

Prints one JSON document. Ratios are within one run; absolute figures depend on the machine.
"""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from sessionlog.embedded import EmbeddedServer
from sessionlog.events import encode_new_event
from sessionlog.header import SessionHeader
from sessionlog.log import SessionLog
from sessionlog.reader import StreamReader
from sessionlog.record import in_subject
from sessionlog.settings import Settings

from .common import scale
from .synth import synthetic_log

PUBLISHES = scale(1500, 150)  # (a) and (b): one event per acknowledged publish
STREAMED = scale(30_000, 2_000)  # (c): chunks, flushed every FLUSH_EVERY
FLUSH_EVERY = 50
READ_EVENTS = scale(100_000, 5_000)
READ_ROUNDS = scale(3, 1)
INTERLEAVED_SESSIONS = scale(10_000, 200)
INTERLEAVED_RECORDS = 10
READ_SAMPLE = scale(300, 50)

_payloads = msgspec.json.Decoder(list[msgspec.Raw])


class _Envelope(msgspec.Struct):
    """The least a reader decodes of an event: its envelope, with `data` left as raw bytes."""

    type: str
    data: msgspec.Raw
    seq: int | None = None
    time: int | None = None


_envelope = msgspec.json.Decoder(_Envelope)


def _percentiles(samples: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50_ms": cuts[49] * 1e3, "p99_ms": cuts[98] * 1e3, "mean_ms": statistics.fmean(samples) * 1e3}


def _chunk(turn: int, seq: int | None) -> bytes:
    data = {"turn": turn, "step": 1, "chunk": {"type": "text-delta", "index": 0, "text": "tok "}}
    return encode_new_event("assistant/chunk", data, seq=seq, time=1_780_000_000_000)


async def _timed(count: int, one: Callable[[int], Awaitable[Any]]) -> list[float]:
    samples = []
    for i in range(count):
        start = time.perf_counter()
        await one(i)
        samples.append(time.perf_counter() - start)
    return samples


async def publish_latencies(log: SessionLog) -> tuple[dict[str, float], dict[str, float]]:
    """(a) one event per `js.publish`, each awaited for its acknowledgement, and (b) the writer with one event
    appended and flushed at a time (validation, record, OCC headers, ack). The two alternate, one sample each per
    round, so both see the same machine: a noisy neighbour or a frequency change lands on both sides."""
    subject = in_subject("bench-raw")
    payload = _chunk(1, 0)
    writer = await log.create("bench-flush-each")
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("step/start", {"turn": 1, "step": 1})
    await writer.flush()

    async def raw(i: int) -> None:
        await log.js.publish(subject, payload)

    # Both sides get their event as bytes ready to send: the raw side's payload is encoded once up front, the
    # writer's chunks too, so neither sample includes encoding an event.
    chunks = [_chunk(1, seq) for seq in range(writer.next_seq, writer.next_seq + 100 + PUBLISHES)]

    async def flush_each(i: int) -> None:
        await writer.append(chunks[i])
        await writer.flush()

    for i in range(100):  # warm up both
        await raw(i)
        await flush_each(i)
    raw_samples: list[float] = []
    writer_samples: list[float] = []
    for i in range(100, 100 + PUBLISHES):
        raw_samples += await _timed(1, raw)
        start = time.perf_counter()
        await flush_each(i)
        writer_samples.append(time.perf_counter() - start)
    await writer.close()
    return (
        {"publishes": PUBLISHES, "events_per_s": len(raw_samples) / sum(raw_samples), **_percentiles(raw_samples)},
        {
            "flushes": PUBLISHES,
            "events_per_s": len(writer_samples) / sum(writer_samples),
            **_percentiles(writer_samples),
        },
    )


async def writer_streaming(log: SessionLog) -> dict[str, float]:
    """(c) a stream of chunks as a model produces them, flushed every FLUSH_EVERY events."""
    writer = await log.create("bench-streaming")
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("step/start", {"turn": 1, "step": 1})
    await writer.flush()
    gc.collect()
    start = time.perf_counter()
    for i in range(STREAMED):
        await writer.append(_chunk(1, writer.next_seq))
        if (i + 1) % FLUSH_EVERY == 0:
            await writer.flush()
    await writer.flush()
    elapsed = time.perf_counter() - start
    records = await log.reader.records("bench-streaming")
    await writer.close()
    return {
        "events": STREAMED,
        "events_per_s": STREAMED / elapsed,
        "records": len(records),
        "records_per_s": len(records) / elapsed,
    }


async def reading(log: SessionLog) -> dict[str, Any]:
    """A 100,000-event session read three ways; the best of READ_ROUNDS rounds each."""
    sid = "bench-read"
    events = synthetic_log(READ_EVENTS)[:READ_EVENTS]
    await log.store.write_all(sid, events)
    await log.header_store.create(sid, SessionHeader.new(sid, created_at=1).encode())
    subject = log.reader.session_subject(sid)  # the floor reads the way the reader does: by the stored subject

    async def floor() -> int:
        count, start = 0, 1
        while True:
            batch, pending = await log.reader.direct_batch(subject, start)
            for message in batch:
                for raw in _payloads.decode(message.data):
                    _envelope.decode(raw)
                    count += 1
            if not batch or pending == 0:
                return count
            start = batch[-1].stream_seq + 1

    async def load() -> int:
        _, session, _ = await log.load(sid)
        return len(session)

    async def reader_events() -> int:
        return len(await log.reader.events(sid))

    rates: dict[str, float] = {}
    for name, read in (("floor", floor), ("load", load), ("reader_events", reader_events)):
        best = 0.0
        for _ in range(READ_ROUNDS):
            gc.collect()
            start = time.perf_counter()
            count = await read()
            best = max(best, count / (time.perf_counter() - start))
            assert count == READ_EVENTS, (name, count)
        rates[name] = best
    records = await log.reader.records(sid)
    return {
        "events": READ_EVENTS,
        "records": len(records),
        "bytes": sum(r.payload_size for r in records),
        "floor_events_per_s": rates["floor"],
        "load_events_per_s": rates["load"],
        "reader_events_per_s": rates["reader_events"],
    }


async def interleaved_reading(log: SessionLog) -> dict[str, Any]:
    """One session read among INTERLEAVED_SESSIONS interleaved ones, by its stored subject and by the wildcard."""
    events = synthetic_log(INTERLEAVED_RECORDS * 3)[: INTERLEAVED_RECORDS * 3]
    sids = [f"bench-mix-{n}" for n in range(INTERLEAVED_SESSIONS)]
    last = dict.fromkeys(sids, 0)
    gate = asyncio.Semaphore(256)

    async def one(sid: str, first: int) -> None:
        async with gate:
            last[sid] = await log.store.publish(sid, events[first : first + 3], first, last[sid], 0, epoch=1)

    for first in range(0, len(events), 3):  # round by round: each session's records spread over the stream
        await asyncio.gather(*(one(sid, first) for sid in sids))
    sample = sids[:: max(1, len(sids) // READ_SAMPLE)][:READ_SAMPLE]
    wildcard = StreamReader(log.nc, log.settings.stream, timeout=log.settings.request_timeout_s)
    times: dict[str, list[float]] = {"stored": [], "wildcard": []}
    for sid in sample:
        for name, reader in (("stored", log.reader), ("wildcard", wildcard)):
            start = time.perf_counter()
            records = await reader.records(sid)
            times[name].append(time.perf_counter() - start)
            assert len(records) == INTERLEAVED_RECORDS, (name, sid, len(records))
    stored, wild = _percentiles(times["stored"]), _percentiles(times["wildcard"])
    return {
        "sessions": INTERLEAVED_SESSIONS,
        "records_per_session": INTERLEAVED_RECORDS,
        "stream_records": INTERLEAVED_SESSIONS * INTERLEAVED_RECORDS,
        "read": len(sample),
        "stored_subject": stored,
        "wildcard": wild,
    }


async def run(url: str) -> dict[str, Any]:
    log = await SessionLog.connect(Settings(_env_file=None, nats_url=url))
    try:
        raw, each = await publish_latencies(log)
        streaming = await writer_streaming(log)
        read = await reading(log)
        interleaved = await interleaved_reading(log)
    finally:
        await log.close()
    return {
        "benchmark": "log",
        "raw_publish": raw,
        "writer_flush_each": each,
        "writer_streaming": streaming,
        "read_100k": read,
        "read_interleaved": interleaved,
        "ratios": {
            "flush_each_p50_over_raw_p50": {"value": each["p50_ms"] / raw["p50_ms"], "goal": "<= 1.25"},
            "flush_each_p99_over_raw_p99": {"value": each["p99_ms"] / raw["p99_ms"], "goal": "<= 1.25"},
            "streaming_over_raw_events_per_s": {
                "value": streaming["events_per_s"] / raw["events_per_s"],
                "goal": ">= 10",
            },
            "load_over_floor": {
                "value": read["load_events_per_s"] / read["floor_events_per_s"],
                "goal": "none: reading plus full validation (see the module docstring)",
            },
            "reader_events_over_floor": {
                "value": read["reader_events_per_s"] / read["floor_events_per_s"],
                "goal": ">= 0.8",
            },
            "interleaved_read_wildcard_p50_over_stored_p50": {
                "value": interleaved["wildcard"]["p50_ms"] / interleaved["stored_subject"]["p50_ms"],
                "goal": "none: what reading by the stored subject saves (see the module docstring)",
            },
        },
    }


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sessionlog-bench-") as folder:
        server = EmbeddedServer(Path(folder) / "nats", server_name="bench")
        server.start()
        try:
            return asyncio.run(run(server.url))
        finally:
            server.kill()


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=2)
    sys.stdout.write("\n")
