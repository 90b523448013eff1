"""The projection runner, written once and shared by every service.

A projection here is per session: its state for a session is a pure function of that session's records, kept
by a `SessionState` with `apply(record)`. The runner feeds it:

- one durable pull consumer per owned partition (`sessionlog.events.<p>.>`), fed by a continuous pull
  (`pull.PullFeed`: requests kept open and topped up, so a live record costs no request of its own); records
  decoded and applied in order, acknowledged after they are applied (ack-all on the last record of a burst);
- idempotent: each session state remembers the stream seq of the last record it applied and skips anything at
  or below it, so a redelivery or an overlap with an on-demand load is never applied twice;
- sessions are loaded on demand from the stream (direct gets) when a record or a query touches one that is not
  in memory, and idle ones are evicted (bounded memory); a record that does not continue its session's state (a
  start mid-stream with `--from-seq`, an eviction) triggers a reload of that session, never a guess;
- checkpoints in KV (`sessionlog-checkpoints`, key `<projection>.p<N>`) hold the applied stream seq of the
  partition. Because every session state can be rebuilt from the stream on demand, the checkpoint needs no
  state blob to be worth something: a restart resumes after it and rebuilds each session when it is touched.
  `rebuild=True` replays the partition from stream seq 1; `from_seq` starts anywhere;
- a poison record (undecodable, refused by the session library, under a session id the API refuses, or one
  whose applying raised anything at all) is quarantined with its stream seq and reason (KV
  `<projection>.quarantine.<seq>`, a metric, `runner.quarantined`, reloaded from KV at start); its session is
  marked poisoned, and every other session goes on. A log that does not answer (`LOG_UNAVAILABLE`) is never a
  reason: the partition stops where it is and consumes again, with backoff;
- each partition's consumer is supervised: whatever ends it is logged and counted
  (`sessionlog_projection_consumer_restarts_total`) and it starts again with backoff; a partition that is not
  being consumed (failed, or hearing nothing from its consumer) is `stalled` in `health()`, which is then not
  ready;
- ownership: a fixed set of partitions (`SESSIONLOG_PARTITIONS=0-7`), or claimed through the lease bucket
  (`partition.<projection>.<N>`) so replicas split the partitions and a survivor takes over a dead replica's
  partitions once their leases expire. Replicas find each other with a presence request on
  `sessionlog.replicas.<projection>`; each takes a fair share, preferring partitions by rendezvous hash.
- a start without quorum (no leader to grant a lease or create a consumer) still starts: queries load sessions by
  direct get from any replica, `health()` is not ready while claims fail (`claim_failure`) or partitions are
  stalled, and the claim loop and each consumer keep trying until the cluster answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import heapq
import itertools
import json
import logging
import math
import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Generic, TypeVar

import nats.errors
from nats.js import api
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from .errors import CorruptLog, InvalidSessionId, LeaseHeld, LeaseLost, LogUnavailable, SessionLogError
from .ids import check_session_id
from .leases import Lease, Leases
from .log import PURGED_PREFIX, SessionLog
from .metrics import APPLIED, CONSUMER_RESTARTS, LAG_EVENTS, LAG_SECONDS, QUARANTINED
from .provision import partition_of
from .pull import ConsumerGone, Delivery, PullFeed
from .quarantine import Quarantined, entries, key
from .record import Record, decode_record, partition_filter, session_of_subject
from .tasks import cancel_and_wait

log = logging.getLogger("sessionlog.runner")

FETCH_BATCH: Final = 256  # at most this many records requested and not yet delivered, per partition
CHECKPOINT_EVERY_S: Final = 1.0
PULL_EXPIRES_S: Final = 10.0  # a pull request's life; the feed sends the next before it ends
PULL_HEARTBEAT_S: Final = 1.0  # idle heartbeats; none for three of these and the feed pulls again
IDLE_WAKE_S: Final = 0.25  # an idle partition still wakes this often (lag metric, checkpoint, stop)
STOP_GRACE_S: Final = 5.0  # a graceful stop waits this long for the record in hand, then cancels
RETRY_FIRST_S: Final = 0.5  # a consumer that failed starts again after this, doubling up to RETRY_MAX_S
RETRY_MAX_S: Final = 10.0
SILENT_S: Final = 3 * PULL_HEARTBEAT_S + 1.0  # no delivery nor heartbeat for this long: the partition is stalled
HEALTH_QUARANTINE: Final = 20  # the most recent quarantined records `health()` lists

# The FNV loop of partition_of, once per session rather than once per query.
_partition_of: Final = functools.lru_cache(maxsize=1 << 16)(partition_of)


class SessionState(ABC):
    """A projection's state for one session; `apply` gets the session's records in order, once each."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.last_stream_seq = 0  # stream seq of the last record applied
        self.next_seq = 0  # the session seq the next record must start at

    @abstractmethod
    def apply(self, record: Record) -> None:
        """Apply one record; raise a SessionLogError to have it quarantined."""


S = TypeVar("S", bound=SessionState)


class Projection(ABC, Generic[S]):
    """What a service keeps: a state per session, plus hooks for the service."""

    name: ClassVar[str]

    @abstractmethod
    def new_state(self, session_id: str) -> S: ...

    def on_applied(self, state: S, record: Record) -> None:
        """Called after a record was applied (live or while loading)."""

    def on_forget(self, session_id: str) -> None:
        """Called when a session's state is dropped (eviction, lost partition, poison)."""


@dataclass(slots=True)
class _Partition:
    number: int
    applied: int = 0  # last stream seq applied and acknowledged
    checkpointed: int = 0
    task: asyncio.Task[None] | None = None
    lease: Lease | None = None
    last_time: float = 0.0  # stream time of the last applied record (epoch s)
    pending: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: bool = False  # a graceful stop: finish the record in hand, acknowledge, return
    applying: bool = False  # a burst is being applied (the stop waits for the record in hand)
    saving: asyncio.Task[None] | None = None  # the checkpoint write in flight
    lag_events: Any = None  # the partition's metric children, looked up once
    lag_seconds: Any = None
    stalled: str | None = None  # why the partition is not being consumed right now (None: it is)
    restarts: Any = None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ProjectionRunner(Generic[S]):
    """Feeds one projection from the stream; see the module docstring for the guarantees."""

    def __init__(
        self,
        log_: SessionLog,
        projection: Projection[S],
        *,
        partitions: list[int] | None = None,
        claim: bool | None = None,
        from_seq: int | None = None,
        rebuild: bool = False,
        max_sessions: int | None = None,
        idle_evict_s: float | None = None,
        replica_id: str | None = None,
    ) -> None:
        self.log = log_
        self.settings = log_.settings
        self.projection = projection
        self.name = projection.name
        self.partition_count = self.settings.partition_count
        fixed = (
            partitions
            if partitions is not None
            else (self.settings.owned_partitions() if self.settings.partitions is not None else None)
        )
        self.claim = claim if claim is not None else fixed is None
        self._fixed = fixed if fixed is not None else list(range(self.partition_count))
        self.from_seq = from_seq
        self.rebuild = rebuild
        # Memory stays bounded (issue 4): by count, and by idleness; both default to the settings.
        self.max_sessions = max_sessions if max_sessions is not None else self.settings.projection_max_sessions
        idle = idle_evict_s if idle_evict_s is not None else self.settings.projection_idle_evict_s
        self.idle_evict_s: float | None = idle or None
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.states: OrderedDict[str, S] = OrderedDict()
        self.poisoned: dict[str, Quarantined] = {}
        self.quarantined: list[Quarantined] = []
        self._quarantined_seqs: set[int] = set()
        self._partitions: dict[int, _Partition] = {}
        self._loading: dict[str, asyncio.Task[S | None]] = {}
        # Per session, a heap of (seq, tiebreak, future): applying a record pops only the waiters it satisfies.
        self._waiters: dict[str, list[tuple[int, int, asyncio.Future[None]]]] = {}
        self._tiebreak = itertools.count()
        self._applied_events = APPLIED.labels(self.name)
        self._last_access: dict[str, float] = {}
        self._running = False
        self._tasks: list[asyncio.Task[None]] = []
        self._presence: Any = None
        self._purges: Any = None
        self._leases = Leases(log_.js, self.settings.kv_leases, timeout=self.settings.request_timeout_s)
        self._kv: Any = None
        # Why partitions are not being claimed right now (None: the last claim round went through). Without a
        # leader no lease can be taken: the replica owns nothing, answers queries from the stream, is not ready.
        self.claim_failure: str | None = "no claim round has completed yet" if self.claim else None
        self.started = asyncio.Event()

    # ---------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._running = True
        # Built, not looked up (`js.key_value` asks the stream leader for its info, which a cluster without quorum
        # has not): checkpoints are read by direct get, and a start without quorum goes on to answer queries.
        bucket = self.settings.kv_checkpoints
        self._kv = KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=self.log.js, direct=True)
        await self._recall_quarantine()
        self._purges = await self.log.nc.subscribe(f"{PURGED_PREFIX}*", cb=self._on_purge)
        if self.claim:
            self._presence = await self.log.nc.subscribe(f"sessionlog.replicas.{self.name}", cb=self._answer_presence)
            self._tasks.append(asyncio.create_task(self._claim_loop(), name=f"{self.name}-claims"))
        else:
            for number in self._fixed:
                await self._own(number)
        if self.idle_evict_s is not None:
            self._tasks.append(asyncio.create_task(self._evict_loop(), name=f"{self.name}-evict"))
        self.started.set()

    async def stop(self) -> None:
        """Graceful: finish the record in hand, acknowledge, checkpoint, release claimed partitions."""
        self._running = False
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks.clear()
        for number in list(self._partitions):
            await self._disown(number, release=True)
        for sub in (self._presence, self._purges):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    @property
    def owned(self) -> list[int]:
        return sorted(self._partitions)

    def owns(self, session_id: str) -> bool:
        return _partition_of(session_id, self.partition_count) in self._partitions

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Until every owned partition has caught up with the stream as it was when it started."""
        await asyncio.wait_for(self.started.wait(), timeout)
        for part in list(self._partitions.values()):
            await asyncio.wait_for(part.ready.wait(), timeout)

    @property
    def stalled(self) -> dict[int, str]:
        """Owned partitions that are not being consumed right now, and why."""
        out: dict[int, str] = {}
        for part in self._partitions.values():
            if part.task is not None and part.task.done() and self._running and not part.stopping:
                out[part.number] = "its consumer task ended"
            elif part.stalled is not None:
                out[part.number] = part.stalled
        return out

    def health(self) -> dict[str, Any]:
        lag = {p.number: p.pending for p in self._partitions.values()}
        stalled = self.stalled
        return {
            "projection": self.name,
            "replica": self.replica_id,
            "ready": all(p.ready.is_set() for p in self._partitions.values())
            and self.started.is_set()
            and not stalled
            and self.claim_failure is None,
            "live": self._running,
            "partitions": self.owned,
            "stalled": sorted(stalled),
            "stalled_reasons": {str(n): why for n, why in sorted(stalled.items())},
            "claim_failure": self.claim_failure,
            "lag_events": lag,
            "sessions": len(self.states),
            "quarantined": len(self.quarantined),
            "quarantine": [q.to_dict() for q in self.quarantined[-HEALTH_QUARANTINE:]],
        }

    # ---------------------------------------------------------------------------------- queries

    async def state(self, session_id: str) -> S | None:
        """The session's state, loaded from the stream when it is not in memory; None if it has no records."""
        state = self.states.get(session_id)
        if state is not None:
            self._touch(session_id)
            return state
        if session_id in self.poisoned:
            raise CorruptLog(f"session {session_id} is quarantined: {self.poisoned[session_id].reason}")
        state = await self._load(session_id)
        if state is None and session_id in self.poisoned:  # the load met a record it could not apply
            raise CorruptLog(f"session {session_id} is quarantined: {self.poisoned[session_id].reason}")
        return state

    async def wait_for(self, session_id: str, seq: int, timeout: float) -> S:
        """The session's state once it has applied session seq `seq` (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        state = await self.state(session_id)
        loop = asyncio.get_running_loop()
        while state is None or state.next_seq <= seq:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                have = -1 if state is None else state.next_seq - 1
                raise TimeoutError(f"session {session_id}: seq {seq} not applied within {timeout}s (have {have})")
            future: asyncio.Future[None] = loop.create_future()
            entry = (seq, next(self._tiebreak), future)
            heapq.heappush(self._waiters.setdefault(session_id, []), entry)
            # Wake at the latest every 0.25 s: a partition lost meanwhile feeds this session no more.
            timer = loop.call_later(min(remaining, 0.25), _settle, future)
            try:
                await future
            finally:
                timer.cancel()
                self._drop_waiter(session_id, entry)
            if not self.owns(session_id):
                # Not fed by a consumer here: look at the stream again.
                self._forget(session_id)
            state = self.states.get(session_id) or await self.state(session_id)
        return state

    def _drop_waiter(self, session_id: str, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        waiters = self._waiters.get(session_id)
        if waiters is None or entry not in waiters:
            return  # resolved: `_resolve` has popped it already
        waiters.remove(entry)
        heapq.heapify(waiters)
        if not waiters:
            del self._waiters[session_id]

    # ---------------------------------------------------------------------------------- applying

    def _touch(self, session_id: str) -> None:
        self.states.move_to_end(session_id)
        self._last_access[session_id] = time.monotonic()

    def _store(self, state: S) -> None:
        self.states[state.session_id] = state
        self._touch(state.session_id)
        while len(self.states) > self.max_sessions:
            oldest = next(iter(self.states))
            self._forget(oldest)

    def _forget(self, session_id: str) -> None:
        if self.states.pop(session_id, None) is not None:
            self._last_access.pop(session_id, None)
            self.projection.on_forget(session_id)

    async def _load(self, session_id: str) -> S | None:
        task = self._loading.get(session_id)
        if task is None:
            task = asyncio.create_task(self._load_now(session_id))
            self._loading[session_id] = task
            task.add_done_callback(lambda _: self._loading.pop(session_id, None))
        return await asyncio.shield(task)

    async def _load_now(self, session_id: str) -> S | None:
        records = await self.log.reader.records(session_id)
        if not records:
            return None
        state = self.projection.new_state(session_id)
        for record in records:
            if not self._apply_to(state, record):
                return None
        existing = self.states.get(session_id)
        if existing is not None and existing.last_stream_seq >= state.last_stream_seq:
            return existing  # a consumer got further meanwhile
        self._store(state)
        self._resolve(state)
        return state

    def _apply_to(self, state: S, record: Record) -> bool:
        """Apply one record to a state; quarantine and poison the session when it is refused, or when applying it
        raises anything at all (applying is pure: the same record would fail the same way on every replay)."""
        try:
            state.apply(record)
            state.last_stream_seq = record.stream_seq
            state.next_seq = record.next_seq
            self._applied_events.inc(len(record.events))
            self.projection.on_applied(state, record)
        except Exception as err:
            self._quarantine(record.stream_seq, state.session_id, _reason(err))
            return False
        return True

    def _apply_live(self, record: Record) -> bool:
        """Apply a record without I/O when the session allows it; False when the session must be loaded first."""
        session_id = record.session_id
        if session_id in self.poisoned:
            self._quarantine(
                record.stream_seq,
                session_id,
                f"session quarantined since stream seq {self.poisoned[session_id].stream_seq}",
            )
            return True
        state = self.states.get(session_id)
        if state is not None:
            if record.stream_seq <= state.last_stream_seq:
                return True  # already applied (a redelivery, or the load that got here first)
            if record.first_seq != state.next_seq:
                return False
            if self._apply_to(state, record):
                self._touch(session_id)
                self._resolve(state)
            else:
                self._forget(session_id)
            return True
        if record.first_seq == 0 and session_id not in self._loading:
            state = self.projection.new_state(session_id)
            if self._apply_to(state, record):
                self._store(state)
                self._resolve(state)
            return True
        return False

    async def _apply_record(self, record: Record) -> None:
        """A record `_apply_live` could not apply: its session must be (re)loaded from the stream first."""
        session_id = record.session_id
        state = self.states.get(session_id)
        # No state, or one that does not continue into this record: rebuild it from the stream, which holds this
        # record too. A load already in flight may have read the stream before this record landed, so after it
        # the record is applied (or the session reloaded) if the state still does not cover it.
        if state is not None:
            self._forget(session_id)
        try:
            state = await self._load(session_id)
            if state is not None and state.last_stream_seq < record.stream_seq:
                if record.first_seq == state.next_seq:
                    if self._apply_to(state, record):
                        self._resolve(state)
                    else:
                        self._forget(session_id)
                else:
                    self._forget(session_id)
                    await self._load(session_id)
        except LogUnavailable:
            raise  # transient: the partition stops here and consumes this record again once the log answers
        except Exception as err:
            self._quarantine(record.stream_seq, session_id, f"reloading the session failed: {_reason(err)}")

    def _resolve(self, state: S) -> None:
        waiters = self._waiters.get(state.session_id)
        if not waiters:
            return
        applied = state.next_seq
        while waiters and waiters[0][0] < applied:
            future = heapq.heappop(waiters)[2]
            if not future.done():
                future.set_result(None)
        if not waiters:
            del self._waiters[state.session_id]

    def _quarantine(self, stream_seq: int, session_id: str, reason: str) -> None:
        entry = Quarantined(stream_seq=stream_seq, session_id=session_id, reason=reason, projection=self.name)
        self.poisoned.setdefault(session_id, entry)
        self._forget(session_id)
        if stream_seq in self._quarantined_seqs:
            return  # met again (a reload, a replay after a restart): listed and counted once
        self._quarantined_seqs.add(stream_seq)
        self.quarantined.append(entry)
        QUARANTINED.labels(self.name).inc()
        log.warning("%s: quarantined stream seq %d of session %s: %s", self.name, stream_seq, session_id, reason)
        if self._kv is not None:
            asyncio.get_running_loop().create_task(self._kv_put(key(self.name, stream_seq), entry.body()))

    async def _recall_quarantine(self) -> None:
        """What this projection quarantined before a restart, so health and stats report the same list. Sessions
        are not poisoned from it: a session touched again meets its bad record again (state is rebuildable)."""
        try:
            found = await entries(
                self.log.nc, self.settings.kv_checkpoints, projection=self.name, timeout=self.settings.request_timeout_s
            )
        except SessionLogError as err:
            log.warning("%s: could not read the quarantine list: %s", self.name, err)
            return
        for entry in found:
            if entry.stream_seq not in self._quarantined_seqs:
                self._quarantined_seqs.add(entry.stream_seq)
                self.quarantined.append(entry)

    async def _kv_put(self, key: str, value: bytes) -> None:
        with contextlib.suppress(Exception):
            await self._kv.put(key, value)

    # ---------------------------------------------------------------------------------- partitions

    async def _own(self, number: int, lease: Lease | None = None) -> None:
        if number in self._partitions:
            return
        part = _Partition(number=number, lease=lease)
        part.lag_events = LAG_EVENTS.labels(self.name, str(number))
        part.lag_seconds = LAG_SECONDS.labels(self.name, str(number))
        part.restarts = CONSUMER_RESTARTS.labels(self.name, str(number))
        self._partitions[number] = part
        part.task = asyncio.create_task(self._consume(part), name=f"{self.name}-p{number}")

    async def _disown(self, number: int, *, release: bool) -> None:
        part = self._partitions.pop(number, None)
        if part is None:
            return
        if part.task is not None:
            # Graceful: the consumer finishes the record in hand, acknowledges and returns; a load that hangs is
            # cancelled after a grace period (what it had not applied is after the checkpoint, so nothing is lost).
            part.stopping = True
            if part.applying:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(part.task), STOP_GRACE_S)
            await cancel_and_wait(part.task)  # nothing in hand (waiting for records, or for JetStream): stop at once
        if part.saving is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await part.saving
        await self._checkpoint(part, force=True)
        for session_id in [s for s in self.states if _partition_of(s, self.partition_count) == number]:
            self._forget(session_id)
        if release and part.lease is not None:
            with contextlib.suppress(Exception):
                await self._leases.release(part.lease)

    async def _start_seq(self, part: _Partition) -> int:
        if self.rebuild:
            return 1
        if self.from_seq is not None:
            return max(1, self.from_seq)
        try:
            entry = await self._kv.get(self._checkpoint_key(part.number))
            seq = int(json.loads(entry.value or b"{}").get("stream_seq", 0))
        except (KeyNotFoundError, NotFoundError, ValueError):
            seq = 0
        return seq + 1

    def _checkpoint_key(self, number: int) -> str:
        return f"{self.name}.p{number}"

    async def _checkpoint(self, part: _Partition, *, force: bool = False) -> None:
        if part.applied <= part.checkpointed and not force:
            return
        if part.applied == 0:
            return
        # What is written is what was applied when the write began: records applied while it is in flight are
        # not covered by it (a later checkpoint covers them).
        applied = part.applied
        body = json.dumps({"stream_seq": applied, "replica": self.replica_id, "time": time.time()}).encode()
        with contextlib.suppress(Exception):
            await self._kv.put(self._checkpoint_key(part.number), body)
            part.checkpointed = max(part.checkpointed, applied)

    def _checkpoint_soon(self, part: _Partition) -> None:
        """Write the checkpoint without holding up the records behind it; one write in flight per partition."""
        if part.applied > part.checkpointed and (part.saving is None or part.saving.done()):
            part.saving = asyncio.create_task(self._checkpoint(part))

    async def _consume(self, part: _Partition) -> None:
        """The partition's consumer, supervised: whatever ends `_follow` (JetStream not answering, the consumer
        deleted, a bug) is logged and counted, and it starts again from what is applied, after a backoff that
        doubles while it keeps failing. It goes on only while the partition is still ours: a replica that took it
        over recreates the same durable, and must not have it deleted again."""
        backoff = RETRY_FIRST_S
        started = False
        while self._running and not part.stopping and not self.log.nc.is_closed:
            applied_before = part.applied
            try:
                if not started:
                    start = await self._start_seq(part)
                    part.applied = start - 1
                    part.checkpointed = part.applied
                    started = True
                await self._follow(part, part.applied + 1)
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                part.stalled = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                part.restarts.inc()
                if isinstance(err, (nats.errors.Error, SessionLogError, ConsumerGone)):
                    log.warning("%s: partition %d: %s", self.name, part.number, part.stalled)
                else:
                    log.exception("%s: partition %d: consumer failed", self.name, part.number)
                if not await self._still_ours(part):
                    log.warning("%s: partition %d: its lease is lost", self.name, part.number)
                    return  # the claim loop disowns it
                if part.applied > applied_before:
                    backoff = RETRY_FIRST_S  # it got somewhere before failing: not a failure loop
                log.warning(
                    "%s: partition %d: consuming again from stream seq %d in %.1fs",
                    self.name,
                    part.number,
                    part.applied + 1,
                    backoff,
                )
                await asyncio.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)

    async def _still_ours(self, part: _Partition) -> bool:
        if part.lease is None:
            return True
        held = part.lease
        try:  # a read: refreshing is the claim loop's, and two refreshes would fence each other
            now = await self._leases.current(held.key)
        except Exception as lease_err:
            log.debug("%s: partition %d: lease read failed: %s", self.name, part.number, lease_err)
            return True
        return now is not None and now.epoch == held.epoch

    async def _follow(self, part: _Partition, start: int) -> None:
        durable = f"{self.name}-p{part.number}"
        js = self.log.js
        with contextlib.suppress(NotFoundError, nats.errors.Error):
            await js.delete_consumer(self.settings.stream, durable)
        config = api.ConsumerConfig(
            durable_name=durable,
            filter_subject=partition_filter(part.number),
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=api.AckPolicy.ALL,
            max_ack_pending=FETCH_BATCH * 4,  # back-pressure: the server holds the rest
            ack_wait=30,
            inactive_threshold=300,
        )
        info = await js.add_consumer(self.settings.stream, config)
        part.stalled = None
        part.pending = info.num_pending or 0
        if part.pending == 0:
            part.ready.set()
        feed = PullFeed(
            self.log.nc,
            self.settings.stream,
            durable,
            batch=FETCH_BATCH,
            expires_s=PULL_EXPIRES_S,
            heartbeat_s=PULL_HEARTBEAT_S,
        )
        await feed.start()
        last_checkpoint = time.monotonic()
        try:
            while self._running and not part.stopping:
                burst = await feed.take(IDLE_WAKE_S)
                if burst:
                    part.applying = True
                    try:
                        done = await self._apply_burst(part, burst)
                    finally:
                        part.applying = False
                    if done is not None:
                        await feed.ack(done)
                        part.pending = done.pending
                        if part.pending == 0:
                            part.ready.set()
                self._update_lag(part)
                silent = feed.silent_for()
                if silent > SILENT_S or not self.log.nc.is_connected:
                    part.stalled = f"no delivery or heartbeat from its consumer for {silent:.0f}s"
                elif part.stalled is not None:
                    part.stalled = None
                now = time.monotonic()
                if now - last_checkpoint >= CHECKPOINT_EVERY_S:
                    self._checkpoint_soon(part)
                    last_checkpoint = now
        finally:
            await feed.stop()

    async def _apply_burst(self, part: _Partition, burst: list[Delivery]) -> Delivery | None:
        """Apply the records of a burst in order; the last one handled (to acknowledge), None when none was."""
        done: Delivery | None = None
        for item in burst:
            if part.stopping:
                break  # graceful stop: the record in hand is finished; the rest comes again after the checkpoint
            seq = item.stream_seq
            if seq > part.applied:
                await self._apply_delivery(item)
                part.applied = seq
                part.last_time = item.time_ns / 1e9
            done = item
        return done

    async def _apply_delivery(self, item: Delivery) -> None:
        """Apply one delivered record, or quarantine it, whatever goes wrong; only `LOG_UNAVAILABLE` (a log
        that does not answer while the session is reloaded) propagates, so the record is consumed again later."""
        msg = item.msg
        session_id = session_of_subject(msg.subject)
        try:
            check_session_id(session_id)  # the stream takes any token; nothing the API cannot reach is kept
            record = decode_record(item.stream_seq, msg.subject, msg.headers, msg.data)
            if not self._apply_live(record):
                await self._apply_record(record)  # the session must be loaded from the stream first
        except LogUnavailable:
            raise
        except InvalidSessionId as err:
            self._quarantine(item.stream_seq, session_id, _reason(err))
            self.poisoned.pop(session_id, None)  # no API can ask for it: nothing to remember it by
        except Exception as err:
            self._quarantine(item.stream_seq, session_id, _reason(err))

    def _update_lag(self, part: _Partition) -> None:
        part.lag_events.set(part.pending)
        lag_s = 0.0 if part.pending == 0 or not part.last_time else max(0.0, time.time() - part.last_time)
        part.lag_seconds.set(lag_s)

    async def _on_purge(self, msg: Any) -> None:
        """An admin erased a session: forget everything about it."""
        session_id = msg.subject[len(PURGED_PREFIX) :]
        self._forget(session_id)
        self.poisoned.pop(session_id, None)
        self.projection.on_forget(session_id)

    # ---------------------------------------------------------------------------------- claims

    async def _answer_presence(self, msg: Any) -> None:
        if msg.reply:
            await self.log.nc.publish(msg.reply, self.replica_id.encode())

    async def live_replicas(self, wait_s: float = 0.1) -> list[str]:
        inbox = self.log.nc.new_inbox()
        sub = await self.log.nc.subscribe(inbox)
        found: set[str] = {self.replica_id}
        try:
            await self.log.nc.publish(f"sessionlog.replicas.{self.name}", b"", reply=inbox)
            deadline = time.monotonic() + wait_s
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    reply = await sub.next_msg(timeout=remaining)
                except (TimeoutError, nats.errors.TimeoutError):
                    break
                found.add(reply.data.decode())
        finally:
            await sub.unsubscribe()
        return sorted(found)

    def _preference(self, number: int) -> str:
        return hashlib.sha256(f"{self.replica_id}:{number}".encode()).hexdigest()

    async def _claim_loop(self) -> None:
        ttl = self.settings.lease_ttl_s
        period = max(0.2, self.settings.effective_lease_refresh_s)
        while self._running and not self.log.nc.is_closed:
            try:
                await self._claim_round(ttl)
                self.claim_failure = None
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the next round tries again
                self.claim_failure = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                log.warning("%s: partition claim round failed: %s", self.name, err)
            await asyncio.sleep(period)

    async def _claim_round(self, ttl: float) -> None:
        replicas = await self.live_replicas()
        share = math.ceil(len(self._fixed) / max(1, len(replicas)))
        for number, part in list(self._partitions.items()):  # keep what we hold
            if part.lease is None:
                continue
            try:
                part.lease = await self._leases.refresh(part.lease)
            except LeaseLost:
                log.warning("%s: lost partition %d", self.name, number)
                await self._disown(number, release=False)
        while len(self._partitions) > share:  # hand extras to newcomers
            extra = max(self._partitions, key=self._preference)
            await self._disown(extra, release=True)
        for number in sorted(self._fixed, key=self._preference):
            if len(self._partitions) >= share:
                break
            if number in self._partitions:
                continue
            try:
                lease = await self._leases.acquire(f"partition.{self.name}.{number}", self.replica_id, ttl)
            except LeaseHeld:
                continue
            await self._own(number, lease)

    # ---------------------------------------------------------------------------------- eviction

    async def _evict_loop(self) -> None:
        assert self.idle_evict_s is not None
        while self._running:
            await asyncio.sleep(max(0.05, self.idle_evict_s / 4))
            cutoff = time.monotonic() - self.idle_evict_s
            for session_id in [s for s, t in self._last_access.items() if t < cutoff]:
                if session_id not in self._waiters:
                    self._forget(session_id)


def _reason(err: BaseException) -> str:
    """A quarantine reason: the code and message of a typed refusal, else the exception's type and text."""
    if isinstance(err, SessionLogError):
        return f"{err.code}: {err.message}"
    return f"{type(err).__name__}: {err}"
