"""Leases: one holder per key (a session id for its writer, `partition.NAME.N` for a projection's partition claim),
kept alive by refreshing, gone when its per-message TTL runs out.

A lease is the one entry `$KV.<bucket>.<key>` in the lease bucket (history 1, `allow_msg_ttl`, subject
delete markers; see provision.py). Every write names the sequence it expects to replace
(`Nats-Expected-Last-Subject-Sequence`), so acquire, refresh, release and takeover are compare-and-set on the
server: two candidates never both win. A lease that is not refreshed expires on the server, which writes a
delete marker (`Nats-Marker-Reason: MaxAge`) that watchers see; a takeover then expects the marker's sequence
(or 0, once the marker itself has expired).

The epoch is the stream sequence of the acquiring write. It stays the same across refreshes (the value carries
it) and grows with every takeover, so a record's `Sessionlog-Writer` header tells which tenure wrote it.

nats-py's KV `create(msg_ttl=...)` is not used: it writes `str(int(ttl))` (0.5 s silently becomes "no TTL") and
its create does not treat a server marker as a deleted key. The writes here set the headers themselves.

`LeaseKeeper` holds a writer's lease: it refreshes it in the background and tells the writer when it is lost.

A lease may be *parked* instead of released (`Leases.park`): its holder is then `parked:<holder>` and it never
expires. It says that the last writer let go on purpose, with the session's turn open and waiting for the client
(record mode's gateway, idle or shutting down while a tool runs): the repairer, which closes the open turns of
sessions nobody holds, leaves it alone, and any writer acquires a parked lease as if it were free (compare-and-set,
a new epoch).

Note (2026-12): JetStream's per-message TTL counts whole seconds, at least 1 s ("500ms" is refused as an invalid
TTL, "1500ms" is cut to 1 s). A lease TTL is therefore rounded up to whole seconds; sub-second leases do not
exist, and tests use 1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from sessionlog.availability import translates_unavailable
from sessionlog.errors import JS_WRONG_LAST_SEQUENCE, LeaseHeld, LeaseLost
from sessionlog.tasks import cancel_and_wait

log = logging.getLogger("sessionlog.writer")

HDR_TTL = "Nats-TTL"
HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_MARKER_REASON = "Nats-Marker-Reason"
HDR_KV_OPERATION = "KV-Operation"

_ACQUIRE_ATTEMPTS = 3
PARKED_PREFIX = "parked:"  # the holder of a parked lease: see the module doc


class _LeaseValue(msgspec.Struct, frozen=True, omit_defaults=True):
    holder: str
    ttl_s: float
    epoch: int = 0  # 0 on the acquiring write: its own sequence is the epoch


@dataclass(frozen=True)
class Lease:
    """A lease as last written: `revision` is what the next refresh or release must expect."""

    key: str
    holder: str
    epoch: int
    revision: int
    ttl_s: float

    @property
    def parked(self) -> bool:
        """Let go on purpose with the session's turn open (see the module doc): free to acquire, never expiring."""
        return self.holder.startswith(PARKED_PREFIX)


def ttl_header(ttl_s: float) -> str:
    """The Nats-TTL value for a lease: whole seconds, rounded up so a lease never lives shorter than asked."""
    if not ttl_s >= 1:
        raise ValueError(f"a lease TTL must be at least 1 second (JetStream's per-message TTL), got {ttl_s}")
    return f"{math.ceil(ttl_s)}s"


# How far this host's clock may be ahead of the server's before a live lease could look outlived (`_outlived`).
STALE_MARGIN_S = 30.0


def _outlived(msg: RawStreamMsg, ttl_s: float) -> bool:
    """Whether a lease entry was written longer ago than twice its TTL (and `STALE_MARGIN_S`): every live holder
    rewrites its lease well within one TTL, so such an entry is one the server failed to remove (seen once after
    nats-server restarts: `TTL state is outdated`, and entries of a killed holder still served half an hour later).
    The entry's time is the server's clock, compared with this host's: the margin covers their skew."""
    if msg.time is None:
        return False
    written = msg.time if msg.time.tzinfo is not None else msg.time.replace(tzinfo=UTC)
    return (datetime.now(UTC) - written).total_seconds() > 2 * ttl_s + STALE_MARGIN_S


def _is_tombstone(msg: RawStreamMsg) -> bool:
    headers = msg.headers or {}
    return HDR_MARKER_REASON in headers or headers.get(HDR_KV_OPERATION) in ("DEL", "PURGE")


class Leases:
    """The lease bucket of one JetStream context."""

    def __init__(self, js: JetStreamContext, bucket: str = "sessionlog-leases", *, timeout: float = 5.0) -> None:
        self._js = js
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.timeout = timeout
        self._decoder = msgspec.json.Decoder(_LeaseValue)

    def subject(self, key: str) -> str:
        return f"$KV.{self.bucket}.{key}"

    async def _last(self, key: str) -> RawStreamMsg | None:
        # Read from the stream leader, not a direct-get follower: a stale answer would only cost a retry, but
        # a lease decision is rare enough to pay for the fresh one.
        try:
            msg: RawStreamMsg = await self._js.get_msg(self.stream, subject=self.subject(key), direct=False)
        except nats.js.errors.NotFoundError:
            return None
        return msg

    def _lease_of(self, key: str, msg: RawStreamMsg) -> Lease | None:
        if _is_tombstone(msg) or msg.seq is None:
            return None
        value = self._decoder.decode(msg.data or b"")
        lease = Lease(key, value.holder, value.epoch or msg.seq, msg.seq, value.ttl_s)
        if not lease.parked and _outlived(msg, value.ttl_s):
            return None  # expired: the server kept it past its Nats-TTL, and its holder has not written since
        return lease

    @translates_unavailable("read the lease of {key}")
    async def current(self, key: str) -> Lease | None:
        """The live lease of `key`, or None when it is free (never held, released or expired)."""
        msg = await self._last(key)
        return self._lease_of(key, msg) if msg is not None else None

    async def _write(self, key: str, value: _LeaseValue, expected: int, ttl: str) -> int:
        headers = {HDR_TTL: ttl, HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected)}
        return await self._publish(self.subject(key), msgspec.json.encode(value), headers)

    async def _publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> int:
        """One lease write; its stream seq. A write nobody stored (no responders while the bucket elects a new
        leader, or a 503) is sent again within the timeout; a timed-out one is not: it may have landed."""
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            try:
                ack = await self._js.publish(
                    subject, payload, timeout=max(0.05, deadline - time.monotonic()), headers=headers
                )
                return int(ack.seq)
            except (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError):
                if time.monotonic() + delay >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    @translates_unavailable("acquire the lease of {key}")
    async def acquire(self, key: str, holder: str, ttl_s: float) -> Lease:
        """Take the lease of `key` if it is free (or expired, or parked); LeaseHeld when someone holds it."""
        ttl = ttl_header(ttl_s)
        for _ in range(_ACQUIRE_ATTEMPTS):
            msg = await self._last(key)
            if msg is not None and (held := self._lease_of(key, msg)) is not None and not held.parked:
                refused = LeaseHeld(
                    f"lease of {key} held by {held.holder!r} (epoch {held.epoch}); "
                    f"it expires unless refreshed within {held.ttl_s:g}s"
                )
                refused.ttl_s = held.ttl_s
                raise refused
            expected = (msg.seq or 0) if msg is not None else 0
            try:
                seq = await self._write(key, _LeaseValue(holder=holder, ttl_s=ttl_s), expected, ttl)
            except nats.js.errors.APIError as err:
                if err.err_code in JS_WRONG_LAST_SEQUENCE:
                    continue  # someone wrote in between, or the marker expired: look again
                raise
            return Lease(key, holder, seq, seq, ttl_s)
        current = await self.current(key)
        who = f"held by {current.holder!r} (epoch {current.epoch})" if current else "contended"
        raise LeaseHeld(f"lease of {key} {who}; gave up after {_ACQUIRE_ATTEMPTS} attempts")

    @translates_unavailable("refresh the lease of {lease.key}")
    async def refresh(self, lease: Lease, ttl_s: float | None = None) -> Lease:
        """Extend the lease; LeaseLost when it expired or was taken over since `lease.revision`."""
        ttl_s = lease.ttl_s if ttl_s is None else ttl_s
        value = _LeaseValue(holder=lease.holder, ttl_s=ttl_s, epoch=lease.epoch)
        seq = await self._write_over(lease, msgspec.json.encode(value), {HDR_TTL: ttl_header(ttl_s)})
        return Lease(lease.key, lease.holder, lease.epoch, seq, ttl_s)

    @translates_unavailable("release the lease of {lease.key}")
    async def release(self, lease: Lease) -> None:
        """Give the lease up now (a delete that expires itself); LeaseLost if it is no longer this one."""
        # The tombstone is not kept forever: the bucket of finished sessions empties itself.
        await self._write_over(lease, b"", {HDR_KV_OPERATION: "DEL", HDR_TTL: ttl_header(lease.ttl_s)})

    @translates_unavailable("park the lease of {lease.key}")
    async def park(self, lease: Lease) -> Lease:
        """Give the lease up, parked (see the module doc); LeaseLost if it is no longer this one."""
        value = _LeaseValue(holder=PARKED_PREFIX + lease.holder, ttl_s=lease.ttl_s, epoch=lease.epoch)
        seq = await self._write_over(lease, msgspec.json.encode(value), {HDR_TTL: "never"})
        return Lease(lease.key, value.holder, lease.epoch, seq, lease.ttl_s)

    async def _write_over(self, lease: Lease, payload: bytes, headers: dict[str, str]) -> int:
        """Write over `lease` as last written (compare-and-set on its revision); its stream seq. LeaseLost when
        another write came first: it expired or was taken over."""
        try:
            return await self._publish(
                self.subject(lease.key), payload, {**headers, HDR_EXPECTED_LAST_SUBJECT_SEQ: str(lease.revision)}
            )
        except nats.js.errors.APIError as err:
            if err.err_code in JS_WRONG_LAST_SEQUENCE:
                raise self._lost(lease, await self.current(lease.key)) from err
            raise

    @staticmethod
    def _lost(lease: Lease, now: Lease | None) -> LeaseLost:
        if now is None:
            return LeaseLost(f"lease of {lease.key}: epoch {lease.epoch} of {lease.holder!r} expired")
        return LeaseLost(
            f"lease of {lease.key}: epoch {lease.epoch} of {lease.holder!r} was taken over by "
            f"{now.holder!r} (epoch {now.epoch})"
        )


class LeaseKeeper:
    """Holds a writer's lease: refreshes it in the background, knows when it may have lapsed, reports its loss.

    A refresh that fails for want of an answer is retried at once (with a short backoff), not a refresh interval
    later: a lease outlives `ttl - interval` seconds without one, and that margin is what covers a leader
    election. `confirmed_at` is when the last write that landed was sent, so the server's expiry is no earlier
    than `confirmed_at + ttl`: a lease is *overdue* past that, and the writer confirms it before publishing.
    """

    def __init__(self, leases: Leases, lease: Lease, interval_s: float, *, acquired_at: float | None = None) -> None:
        self._leases = leases
        self.lease = lease
        self._interval = interval_s
        self._callbacks: list[Callable[[str], None]] = []
        self._stopping = False
        self._lock = asyncio.Lock()  # one refresh at a time: the loop's and a writer's `confirm()`
        self.confirmed_at = time.monotonic() if acquired_at is None else acquired_at  # when the acquire was sent
        self._task: asyncio.Task[None] | None = asyncio.create_task(self._run(), name=f"lease-{lease.key}")

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    @property
    def overdue(self) -> bool:
        """Whether the lease may have expired on the server (it was not refreshed within its TTL)."""
        return time.monotonic() - self.confirmed_at >= self.lease.ttl_s

    def on_lost(self, callback: Callable[[str], None]) -> None:
        self._callbacks.append(callback)

    async def _run(self) -> None:
        # The flag, not only the cancel, ends the loop: a cancel that lands with a refresh reply can be swallowed.
        delay = 0.0
        while True:
            await asyncio.sleep(delay or max(0.0, self.confirmed_at + self._interval - time.monotonic()))
            if self._stopping:
                return
            try:
                await self.confirm()
                delay = 0.0
            except LeaseLost as err:
                for callback in self._callbacks:
                    callback(err.message)
                return
            except Exception as err:  # no answer: try again soon; the TTL decides whether it is lost
                log.warning("lease refresh for %s failed: %s", self.lease.key, err)
                delay = min(max(0.1, delay * 2), 1.0)

    async def confirm(self) -> None:
        """Refresh the lease now; `LeaseLost` naming the cause when it expired or was taken over."""
        async with self._lock:
            sent = time.monotonic()
            unrefreshed = sent - self.confirmed_at
            try:
                self.lease = await self._leases.refresh(self.lease)
            except LeaseLost as err:
                # A refresh whose ack was lost may still have landed: then the lease is ours at a newer revision.
                current = await self._still_ours()
                if current is None:
                    raise LeaseLost(self._cause(err, unrefreshed)) from None
                self.lease = current
            self.confirmed_at = sent

    def _cause(self, err: LeaseLost, unrefreshed: float) -> str:
        if unrefreshed < self.lease.ttl_s:
            return err.message
        return (
            f"{err.message}: it was not refreshed for {unrefreshed:.1f}s, past its {self.lease.ttl_s:g}s TTL (the "
            "event loop was blocked, for example by a synchronous call, the process was paused, or the log did "
            "not answer)"
        )

    async def lost(self) -> str | None:
        """Why the lease is no longer this holder's, asking the server; None while it still is (or no answer)."""
        try:
            await self.confirm()
        except LeaseLost as err:
            return err.message
        except Exception:
            return None
        return None

    async def _still_ours(self) -> Lease | None:
        """The lease as it stands now if it is still this holder's tenure (a write whose answer was lost may have
        landed at a newer revision), else None."""
        try:
            current = await self._leases.current(self.lease.key)
        except Exception:
            return None
        if current is None or current.holder != self.lease.holder or current.epoch != self.lease.epoch:
            return None
        return current

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def release(self, *, park: bool = False) -> None:
        """Stop refreshing and give the lease up: released, or parked (see the module doc)."""
        await self.stop()
        give_up = self._leases.park if park else self._leases.release
        try:
            await give_up(self.lease)
        except LeaseLost:
            # A refresh cancelled in flight may have landed after all: the lease is then ours at its newer revision.
            current = await self._still_ours()
            if current is not None:
                with contextlib.suppress(LeaseLost):
                    await give_up(current)
