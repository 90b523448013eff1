"""The fleet overview's data: an index of every session (kept from the stream, not read per page) and the
deployment's health (partitions, lag, owners, quarantine, refusals over time).

`FleetIndex` follows two feeds, so the overview never reads whole logs or one record per session per page:

- the session headers bucket (a KV watch: every header, then each new one): id, created, parent, cwd;
- the event stream's record headers (an ordered consumer with `headers_only`, from stream seq 1, whatever
  partitions this replica owns): the events count, the open turn and the last activity of each session.

A page sorts and filters the rows in memory (10,000 sessions cost a few milliseconds) and reads only what a visible
row needs elsewhere: the writer lease holder (one lease read per row) and, for sessions the projection holds,
tokens and findings. `DeploymentHealth` reads the checkpoints bucket (each projection's partitions and its
quarantined records), the partition leases (owners) and the stream (the last record of each partition), and
samples this process's refusal counters to draw refusals by code over time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import nats.errors
from nats.js import api

from sessionlog.errors import InvalidSessionId, SessionLogError
from sessionlog.ids import check_session_id
from sessionlog.jsonl import decode_header
from sessionlog.log import SessionLog
from sessionlog.metrics import REQUESTS
from sessionlog.reader import StreamReader
from sessionlog.record import FORMAT, H_COUNT, H_FIRST_SEQ, H_FORMAT, H_OPEN_TURN, session_of_subject
from sessionlog.tasks import cancel_and_wait

log = logging.getLogger("sessionlog.ui_replayer")

PAGE_SIZE: Final = 50
HEALTH_TTL_S: Final = 2.0
REFUSAL_SAMPLE_S: Final = 5.0
REFUSAL_SAMPLES: Final = 120  # ten minutes at one sample per five seconds
FEED_RETRY_S: Final = 1.0


@dataclass(slots=True)
class SessionRow:
    """One session as the overview lists it."""

    id: str
    created_at: int = 0
    parent: str | None = None
    cwd: str | None = None
    events: int = 0
    open_turn: int | None = None
    last_activity: int | None = None  # ms: when its last record was stored (else its creation)
    stream_seq: int = 0  # of the last record seen
    error: str | None = None  # `CODE: message` once a record of it does not read (the projections quarantine it)

    def activity(self) -> int:
        return self.last_activity or self.created_at

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Page:
    rows: list[SessionRow]
    total: int  # rows matching the filters
    page: int
    pages: int


@dataclass
class FleetIndex:
    """Every session's row, kept up to date from the headers bucket and the record headers of the stream."""

    log: SessionLog
    rows: dict[str, SessionRow] = field(default_factory=dict)
    listeners: set[asyncio.Queue[list[str]]] = field(default_factory=set)
    stream_seq: int = 0  # the last record header applied
    _order: list[SessionRow] | None = None
    _changed: set[str] = field(default_factory=set)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _headers_read: asyncio.Event = field(default_factory=asyncio.Event)
    _records_target: int | None = None  # the stream's last seq when the index started
    _records_read: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        try:
            info = await self.log.js.stream_info(self.log.settings.stream)
            self._records_target = info.state.last_seq
        except Exception:  # the feed will still follow; the first pages may just be behind
            self._records_target = 0
        if not self._records_target:
            self._records_read.set()
        self._tasks = [
            asyncio.create_task(self._follow_headers(), name="ui-fleet-headers"),
            asyncio.create_task(self._follow_records(), name="ui-fleet-records"),
            asyncio.create_task(self._publish_loop(), name="ui-fleet-publish"),
        ]

    async def caught_up(self, timeout: float) -> bool:
        """Until every header and every record stored when the index started have been read (bounded)."""
        try:
            await asyncio.wait_for(asyncio.gather(self._headers_read.wait(), self._records_read.wait()), timeout)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)

    # ---------------------------------------------------------------------------------- feeds

    def _row(self, session_id: str) -> SessionRow:
        row = self.rows.get(session_id)
        if row is None:
            row = self.rows[session_id] = SessionRow(session_id)
        self._order = None
        self._changed.add(session_id)
        return row

    def take_header(self, session_id: str, raw: bytes) -> None:
        try:
            header = decode_header(raw)
        except Exception:  # a header this build does not read: list the id, leave the rest blank
            self._row(session_id)
            return
        row = self._row(session_id)
        row.created_at = header.created_at
        row.parent = header.parent_session if isinstance(header.parent_session, str) else None
        row.cwd = header.cwd if isinstance(header.cwd, str) else None

    def take_record(self, subject: str, headers: dict[str, str], stream_seq: int, stored_ms: int | None) -> None:
        session_id = session_of_subject(subject)
        try:
            check_session_id(session_id)
        except InvalidSessionId:
            return  # a subject no API can reach is no session (the projections quarantine it)
        try:
            if headers.get(H_FORMAT) != FORMAT:
                raise ValueError(f"missing or unknown {H_FORMAT}")
            next_seq = int(headers[H_FIRST_SEQ]) + int(headers[H_COUNT])
            open_turn = int(headers.get(H_OPEN_TURN, "0"))
        except (KeyError, ValueError) as exc:
            # Anyone allowed to publish to the session's subject can store this: list the session as corrupt.
            row = self._row(session_id)
            if row.error is None:
                row.error = f"CORRUPT_LOG: stream seq {stream_seq} is not a sessionlog record ({exc})"
            return
        row = self._row(session_id)
        if stream_seq <= row.stream_seq:
            return
        row.stream_seq = stream_seq
        row.events = max(row.events, next_seq)
        row.open_turn = open_turn or None
        if stored_ms is not None:
            row.last_activity = stored_ms
        self.stream_seq = max(self.stream_seq, stream_seq)

    async def _follow_headers(self) -> None:
        while True:
            watcher = None
            try:
                kv = await self.log.js.key_value(self.log.settings.kv_sessions)
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:  # the end of the values stored at the start
                        self._headers_read.set()
                        continue
                    if entry.value is None or entry.operation in ("DEL", "PURGE"):
                        continue
                    self.take_header(entry.key, entry.value)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # keep following across reconnects
                log.warning("ui-replayer: session headers feed interrupted: %s", err)
                await asyncio.sleep(FEED_RETRY_S)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]

    async def _follow_records(self) -> None:
        while True:
            sub = None
            try:
                sub = await self.log.js.subscribe(
                    "sessionlog.events.>",
                    stream=self.log.settings.stream,
                    ordered_consumer=True,
                    headers_only=True,
                    deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                    config=api.ConsumerConfig(opt_start_seq=self.stream_seq + 1),
                )
                while True:
                    try:
                        msg = await sub.next_msg(timeout=1.0)
                    except (TimeoutError, nats.errors.TimeoutError):
                        continue
                    meta = msg.metadata
                    stored = meta.timestamp
                    stored_ms = int(stored.timestamp() * 1000) if stored is not None else None
                    self.take_record(msg.subject, dict(msg.headers or {}), meta.sequence.stream, stored_ms)
                    if self._records_target is not None and meta.sequence.stream >= self._records_target:
                        self._records_read.set()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("ui-replayer: record headers feed interrupted: %s", err)
                await asyncio.sleep(FEED_RETRY_S)
            finally:
                if sub is not None:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()

    async def _publish_loop(self) -> None:
        """Hands the ids of changed rows to the open overview pages, at most a few times a second."""
        while True:
            await asyncio.sleep(0.25)
            if not self._changed or not self.listeners:
                self._changed.clear()
                continue
            changed, self._changed = sorted(self._changed), set()
            for queue in list(self.listeners):
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(changed)

    # ---------------------------------------------------------------------------------- queries

    def ordered(self) -> list[SessionRow]:
        """Every row, most recent activity first (cached until a row changes)."""
        if self._order is None:
            self._order = sorted(self.rows.values(), key=lambda r: (r.activity(), r.id), reverse=True)
        return self._order

    def children(self, session_id: str) -> list[SessionRow]:
        return [r for r in self.ordered() if r.parent == session_id]

    def page(
        self,
        *,
        query: str = "",
        state: str = "",
        page: int = 1,
        size: int = PAGE_SIZE,
        extra: Callable[[str], str],
        flagged: Callable[[str], bool] = lambda _: False,
    ) -> Page:
        """One page of the rows that match: `query` in the id, parent, cwd or `extra(id)` (the title); `state`
        `open` (a turn is open), `closed`, `forks` (has a parent) or `findings` (`flagged(id)`)."""
        rows: Iterable[SessionRow] = self.ordered()
        needle = query.strip().lower()
        if state == "open":
            rows = (r for r in rows if r.open_turn)
        elif state == "closed":
            rows = (r for r in rows if not r.open_turn)
        elif state == "forks":
            rows = (r for r in rows if r.parent)
        elif state == "findings":
            rows = (r for r in rows if flagged(r.id))
        if needle:
            rows = (
                r
                for r in rows
                if needle in r.id.lower()
                or needle in (r.parent or "").lower()
                or needle in (r.cwd or "").lower()
                or needle in extra(r.id).lower()
            )
        matching = rows if isinstance(rows, list) else list(rows)
        pages = max(1, -(-len(matching) // size))
        page = min(max(1, page), pages)
        return Page(rows=matching[(page - 1) * size : page * size], total=len(matching), page=page, pages=pages)


# ---------------------------------------------------------------------------------------------- health


@dataclass
class DeploymentHealth:
    """Partitions per projection (owner, applied stream seq, lag in records), quarantined records and refusals over
    time."""

    log: SessionLog
    samples: deque[tuple[float, dict[str, float]]] = field(default_factory=lambda: deque(maxlen=REFUSAL_SAMPLES))
    _cached: tuple[float, dict[str, Any]] | None = None
    _task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.sample()
        self._task = asyncio.create_task(self._sample_loop(), name="ui-refusal-samples")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def sample(self) -> None:
        """The refusal counters of this process (every service `sessionlog up` runs shares them), by code."""
        counts: dict[str, float] = {}
        for metric in REQUESTS.collect():
            for s in metric.samples:
                if s.name.endswith("_total") and s.labels.get("outcome", "ok") != "ok":
                    code = s.labels["outcome"]
                    counts[code] = counts.get(code, 0.0) + s.value
        self.samples.append((time.time(), counts))

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(REFUSAL_SAMPLE_S)
            self.sample()

    def refusals(self) -> dict[str, Any]:
        """Refusals per interval and code (the increase of each counter between samples)."""
        samples = list(self.samples)
        codes = sorted({c for _, counts in samples for c in counts})
        intervals = []
        for (_, before), (t, after) in itertools.pairwise(samples):
            intervals.append({"time": int(t * 1000), "by_code": {c: after.get(c, 0) - before.get(c, 0) for c in codes}})
        totals = samples[-1][1] if samples else {}
        return {"codes": codes, "intervals": intervals, "totals": totals, "every_s": REFUSAL_SAMPLE_S}

    async def read(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._cached is not None and now - self._cached[0] < HEALTH_TTL_S:
            return self._cached[1]
        body = await self._read()
        self._cached = (now, body)
        return body

    async def _read(self) -> dict[str, Any]:
        settings = self.log.settings
        checkpoints: dict[str, dict[int, dict[str, Any]]] = {}
        quarantined: list[dict[str, Any]] = []
        prefix = f"$KV.{settings.kv_checkpoints}."
        entries: dict[str, bytes] = {}
        with contextlib.suppress(SessionLogError, nats.errors.Error):
            reader = StreamReader(self.log.nc, f"KV_{settings.kv_checkpoints}", timeout=settings.request_timeout_s)
            entries = await reader.latest_values(f"{prefix}>")
        for subject, value in entries.items():
            if value:
                name, _, rest = subject[len(prefix) :].partition(".")
                try:
                    body = json.loads(value)
                except ValueError:
                    continue
                if rest.startswith("quarantine."):
                    quarantined.append({"projection": name, **body})
                elif rest.startswith("p") and rest[1:].isdigit():
                    checkpoints.setdefault(name, {})[int(rest[1:])] = body
        names = sorted(checkpoints)
        count = settings.partition_count
        pairs = [(name, n) for name in names for n in range(count)]
        owners = await asyncio.gather(*(self._owner(name, n) for name, n in pairs))
        consumers = await asyncio.gather(*(self._consumer(name, n) for name, n in pairs))
        found = dict(zip(pairs, zip(owners, consumers, strict=True), strict=True))
        projections = []
        for name in names:
            partitions = []
            for n in range(count):
                point = checkpoints[name].get(n, {})
                lease_holder, consumer = found[(name, n)]
                partitions.append(
                    {
                        "partition": n,
                        "owner": lease_holder or point.get("replica"),
                        "claimed": lease_holder is not None,
                        "checkpoint": int(point.get("stream_seq", 0)),
                        "checkpointed_at": point.get("time"),
                        **consumer,
                    }
                )
            projections.append({"projection": name, "partitions": partitions})
        quarantined.sort(key=lambda q: (q.get("projection", ""), q.get("stream_seq", 0)))
        return {
            "projections": projections,
            "quarantined": quarantined,
            "refusals": self.refusals(),
        }

    async def _consumer(self, projection: str, partition: int) -> dict[str, Any]:
        """The partition's durable consumer as the server counts it: the stream seq acknowledged (applied) and the
        records not yet applied (pending delivery plus delivered and unacknowledged). None when nobody consumes it."""
        try:
            info = await self.log.js.consumer_info(self.log.settings.stream, f"{projection}-p{partition}")
        except Exception:  # no such consumer (the partition is not consumed), or not readable
            return {"applied": None, "lag": None}
        return {"applied": info.ack_floor.stream_seq, "lag": info.num_pending + info.num_ack_pending}

    async def _owner(self, projection: str, partition: int) -> str | None:
        try:
            lease = await self.log.leases.current(f"partition.{projection}.{partition}")
        except Exception:
            return None
        return lease.holder if lease is not None else None


async def lease_holders(log_: SessionLog, session_ids: Iterable[str]) -> dict[str, str | None]:
    """The writer lease holder of each session (None: nobody holds it), read concurrently."""
    ids = list(session_ids)

    async def holder(session_id: str) -> str | None:
        try:
            lease = await log_.leases.current(session_id)
        except Exception:
            return None
        return lease.holder if lease is not None else None

    found = await asyncio.gather(*(holder(s) for s in ids))
    return dict(zip(ids, found, strict=True))
