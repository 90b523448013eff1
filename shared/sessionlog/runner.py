"""The projection runtime, written once and shared by every service: `ProjectionRunner` wires its parts, a
`CheckpointedFeed` per owned partition (`feed.py`), `Checkpoints` (`checkpoints.py`), the `SessionCache` with its
one `session_at` (`sessioncache.py`) and `PartitionClaims` (`claims.py`); `abort()` stops a replica as a killed
process would (for tests of failover).

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
import logging
import uuid
from typing import Any, Final, Generic

from .checkpoints import Checkpoints, QuarantineList
from .claims import PartitionClaims
from .errors import InvalidSessionId, LogUnavailable
from .feed import FETCH_BATCH, PULL_EXPIRES_S, PULL_HEARTBEAT_S, Apply, CheckpointedFeed
from .ids import check_session_id
from .leases import Lease, Leases
from .log import PURGED_PREFIX, SessionLog
from .lru import LRU
from .provision import partition_of
from .pull import Delivery
from .quarantine import Quarantined
from .record import H_FIRST_SEQ, Record, decode_record, partition_filter, session_of_subject
from .sessioncache import NotReached, Projection, S, SessionCache, SessionLogState, SessionState, reason
from .tasks import cancel_and_wait

__all__ = [
    "FETCH_BATCH",
    "PULL_EXPIRES_S",
    "PULL_HEARTBEAT_S",
    "NotReached",
    "Projection",
    "ProjectionRunner",
    "SessionLogState",
    "SessionState",
]

log = logging.getLogger("sessionlog.runner")

HEALTH_QUARANTINE: Final = 20  # the most recent quarantined records `health()` lists

# The FNV loop of partition_of, once per session rather than once per query.
_partition_of: Final = functools.lru_cache(maxsize=1 << 16)(partition_of)


class ProjectionRunner(Generic[S]):
    """Feeds one projection from the stream; see the module docstring for the guarantees. Its parts: a
    `CheckpointedFeed` per owned partition, `Checkpoints`, the `SessionCache` (`sessions`), `PartitionClaims`."""

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
        self.sessions: SessionCache[S] = SessionCache(
            log_, projection, max_sessions=self.max_sessions, owns=self.owns, quarantine=self._quarantine
        )
        self.feeds: dict[int, CheckpointedFeed] = {}  # the owned partitions' feeds
        self._extra_feeds: list[CheckpointedFeed] = []  # feeds a service follows beside them (`follow`)
        self.checkpoints = Checkpoints(
            log_.js, self.settings.kv_checkpoints, self.name, self.replica_id, retry_s=self.settings.publish_retry_s
        )
        self.quarantine = QuarantineList(log_.nc, self.checkpoints, timeout=self.settings.request_timeout_s)
        leases = Leases(log_.js, self.settings.kv_leases, timeout=self.settings.request_timeout_s)
        self.claims: PartitionClaims | None = (
            PartitionClaims(
                log_.nc, leases, self.name, self.replica_id, self._fixed, own=self._own, disown=self._disown
            )
            if self.claim
            else None
        )
        self._running = False
        self._tasks: list[asyncio.Task[None]] = []
        self._purges: Any = None
        self.started = asyncio.Event()

    @property
    def states(self) -> LRU[str, S]:
        return self.sessions.states

    @property
    def quarantined(self) -> list[Quarantined]:
        """Every record this projection quarantined (also those listed in KV before a restart), oldest first."""
        return self.quarantine.entries

    @property
    def poisoned(self) -> dict[str, Quarantined]:
        return self.sessions.poisoned

    @property
    def claim_failure(self) -> str | None:
        """Why partitions are not being claimed right now (None: the last claim round went through). Without a
        leader no lease can be taken: the replica owns nothing, answers queries from the stream, is not ready."""
        return self.claims.failure if self.claims is not None else None

    # ---------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        self._running = True
        await self.quarantine.recall()
        self._purges = await self.log.nc.subscribe(f"{PURGED_PREFIX}*", cb=self._on_purge)
        if self.claims is not None:
            await self.claims.start()
            ttl, period = self.settings.lease_ttl_s, max(0.2, self.settings.effective_lease_refresh_s)
            self._tasks.append(asyncio.create_task(self.claims.loop(ttl, period), name=f"{self.name}-claims"))
        else:
            for number in self._fixed:
                await self._own(number)
        if self.idle_evict_s is not None:
            evict = self.sessions.evict_idle(self.idle_evict_s)
            self._tasks.append(asyncio.create_task(evict, name=f"{self.name}-evict"))
        self.started.set()

    async def stop(self) -> None:
        """Graceful: finish the record in hand, acknowledge, checkpoint, release claimed partitions."""
        self._running = False
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks.clear()
        if self.claims is not None:
            await self.claims.leave()  # no round asks again: the others count it out before its leases are released
            await self.claims.settle()  # partitions being handed over finish, and their leases are released
        for number in list(self.feeds):
            await self._disown(number, True)
        for feed in self._extra_feeds:
            await feed.stop()
        self._extra_feeds.clear()
        if self.claims is not None:
            await self.claims.stop()
        await self._unsubscribe()
        await self.checkpoints.settle(self.settings.request_timeout_s)

    async def abort(self) -> None:
        """Stop at once, as a process killed mid-work would: nothing is checkpointed, acknowledged or released
        (claimed partitions pass to a survivor when their leases expire). For tests of failover."""
        self._running = False
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.claims is not None:
            await self.claims.abandon()
        for feed in [*self.feeds.values(), *self._extra_feeds]:
            await feed.abort()
        self.feeds.clear()
        self._extra_feeds.clear()
        if self.claims is not None:
            self.claims.held.clear()
            await self.claims.stop()
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        if self._purges is not None:
            with contextlib.suppress(Exception):
                await self._purges.unsubscribe()
            self._purges = None

    def follow(
        self, stream: str, filter_subject: str | None, name: str, apply: Apply, *, start_at: int | None = None
    ) -> CheckpointedFeed:
        """A feed of another stream beside the partitions (durable `<projection>-<name>-<replica>`, checkpoint
        `<projection>.<name>`), started now and stopped with the runner."""
        feed = CheckpointedFeed(
            self.log.nc,
            self.log.js,
            stream,
            filter_subject,
            f"{self.name}-{name}-{self.replica_id}",
            self.checkpoints,
            f"{self.name}.{name}",
            apply,
            label=name,
            start_at=1 if self.rebuild else start_at,
        )
        self._extra_feeds.append(feed)
        feed.start()
        return feed

    async def live_replicas(self, wait_s: float = 0.1) -> list[str]:
        """The replicas of this projection that answer a presence request (this one included)."""
        if self.claims is None:
            return [self.replica_id]
        return await self.claims.live_replicas(wait_s)

    @property
    def owned(self) -> list[int]:
        return sorted(self.feeds)

    def owns(self, session_id: str) -> bool:
        return _partition_of(session_id, self.partition_count) in self.feeds

    async def wait_ready(self, timeout: float = 10.0) -> None:
        """Until every owned partition has caught up with the stream as it was when it started."""
        await asyncio.wait_for(self.started.wait(), timeout)
        for feed in list(self.feeds.values()):
            await asyncio.wait_for(feed.ready.wait(), timeout)

    @property
    def stalled(self) -> dict[int, str]:
        """Owned partitions that are not being consumed right now, and why."""
        return {n: why for n, feed in self.feeds.items() if (why := feed.stalled) is not None}

    def health(self) -> dict[str, Any]:
        stalled = self.stalled
        return {
            "projection": self.name,
            "replica": self.replica_id,
            "ready": all(f.ready.is_set() for f in self.feeds.values())
            and self.started.is_set()
            and not stalled
            and self.claim_failure is None,
            "live": self._running,
            "partitions": self.owned,
            "stalled": sorted(stalled),
            "stalled_reasons": {str(n): why for n, why in sorted(stalled.items())},
            "claim_failure": self.claim_failure,
            "lag_events": {n: f.pending for n, f in self.feeds.items()},
            "sessions": len(self.states),
            "quarantined": len(self.quarantined),
            "quarantine": [q.to_dict() for q in self.quarantined[-HEALTH_QUARANTINE:]],
        }

    # ---------------------------------------------------------------------------------- queries

    async def session_at(self, session_id: str, min_seq: int | None = None, timeout: float = 0.0) -> S | None:
        """The session's state once it holds session seq `min_seq` (see `SessionCache.session_at`)."""
        return await self.sessions.session_at(session_id, min_seq, timeout)

    async def state(self, session_id: str) -> S | None:
        """The session's latest state (`session_at` without a seq to wait for)."""
        return await self.sessions.session_at(session_id)

    async def wait_for(self, session_id: str, seq: int, timeout: float) -> S:
        """The session's state once it has applied session seq `seq` (`session_at` with a seq to wait for)."""
        state = await self.sessions.session_at(session_id, seq, timeout)
        assert state is not None  # a state that reached `seq` exists
        return state

    # ---------------------------------------------------------------------------------- partitions

    async def _own(self, number: int, lease: Lease | None = None) -> None:
        if number in self.feeds:
            return
        if lease is not None and self.claims is not None:
            self.claims.held[number] = lease
        # Views of its sessions read before the claim are dropped: from now on the consumer feeds them.
        self.sessions.forget_where(lambda s: _partition_of(s, self.partition_count) == number)
        feed = CheckpointedFeed(
            self.log.nc,
            self.log.js,
            self.settings.stream,
            partition_filter(number),
            f"{self.name}-p{number}",
            self.checkpoints,
            f"{self.name}.p{number}",
            self._apply_delivery,
            label=str(number),
            start_at=1 if self.rebuild else (max(1, self.from_seq) if self.from_seq is not None else None),
            prepare=self._prefetch,
            still_ours=functools.partial(self._still_ours, number, lease),
        )
        self.feeds[number] = feed
        feed.start()

    async def _still_ours(self, number: int, lease: Lease | None) -> bool:
        return lease is None or self.claims is None or await self.claims.still_held(number)

    async def _disown(self, number: int, release: bool) -> None:
        feed = self.feeds.pop(number, None)
        lease = self.claims.held.pop(number, None) if self.claims is not None else None
        if feed is None:
            return
        await feed.stop()
        self.sessions.forget_where(lambda s: _partition_of(s, self.partition_count) == number)
        if release and lease is not None and self.claims is not None:
            await self.claims.release(lease)

    # ---------------------------------------------------------------------------------- applying

    async def _prefetch(self, burst: list[Delivery]) -> None:
        """Load the sessions a burst touches that are not held, concurrently (bounded), before applying it in
        order: a new owner taking over a partition meets a burst of sessions it has never seen. A session whose
        first record here starts it needs no load (nor one that is held: `prefetch` skips those)."""
        first: dict[str, bool] = {}
        for item in burst:
            session_id = session_of_subject(item.msg.subject)
            if session_id not in first:
                first[session_id] = (item.msg.headers or {}).get(H_FIRST_SEQ) != "0"
        await self.sessions.prefetch(s for s, load in first.items() if load)

    async def _apply_delivery(self, item: Delivery) -> None:
        """Apply one delivered record, or quarantine it, whatever goes wrong; only `LOG_UNAVAILABLE` (a log
        that does not answer while the session is reloaded) propagates, so the record is consumed again later."""
        msg = item.msg
        session_id = session_of_subject(msg.subject)
        try:
            check_session_id(session_id)  # the stream takes any token; nothing the API cannot reach is kept
            record = decode_record(item.stream_seq, msg.subject, msg.headers, msg.data)
            if not self.sessions.apply_live(record):
                await self._apply_record(record)  # the session must be loaded from the stream first
        except LogUnavailable:
            raise
        except InvalidSessionId as err:
            self.sessions.poison(item.stream_seq, session_id, reason(err))
            self.poisoned.pop(session_id, None)  # no API can ask for it: nothing to remember it by
        except Exception as err:
            self.sessions.poison(item.stream_seq, session_id, reason(err))

    async def _apply_record(self, record: Record) -> None:
        await self.sessions.apply_loading(record)

    # ---------------------------------------------------------------------------------- quarantine, purge

    def _quarantine(self, entry: Quarantined) -> None:
        self.quarantine.add(entry, keep=self._running)

    async def _on_purge(self, msg: Any) -> None:
        """An admin erased a session: forget everything about it."""
        self.sessions.purge(msg.subject[len(PURGED_PREFIX) :])
