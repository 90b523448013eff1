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

Note (2026-12): JetStream's per-message TTL counts whole seconds, at least 1 s ("500ms" is refused as an invalid
TTL, "1500ms" is cut to 1 s). A lease TTL is therefore rounded up to whole seconds; sub-second leases do not
exist, and tests use 1 s.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from sessionlog.availability import translates_unavailable
from sessionlog.errors import JS_WRONG_LAST_SEQUENCE, LeaseHeld, LeaseLost

HDR_TTL = "Nats-TTL"
HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_MARKER_REASON = "Nats-Marker-Reason"
HDR_KV_OPERATION = "KV-Operation"

_ACQUIRE_ATTEMPTS = 3


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


def ttl_header(ttl_s: float) -> str:
    """The Nats-TTL value for a lease: whole seconds, rounded up so a lease never lives shorter than asked."""
    if not ttl_s >= 1:
        raise ValueError(f"a lease TTL must be at least 1 second (JetStream's per-message TTL), got {ttl_s}")
    return f"{math.ceil(ttl_s)}s"


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
        return Lease(key, value.holder, value.epoch or msg.seq, msg.seq, value.ttl_s)

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
        """Take the lease of `key` if it is free (or expired); LeaseHeld when someone holds it."""
        ttl = ttl_header(ttl_s)
        for _ in range(_ACQUIRE_ATTEMPTS):
            msg = await self._last(key)
            if msg is not None and (held := self._lease_of(key, msg)) is not None:
                raise LeaseHeld(
                    f"lease of {key} held by {held.holder!r} (epoch {held.epoch}); "
                    f"it expires unless refreshed within {held.ttl_s:g}s"
                )
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
        try:
            seq = await self._write(lease.key, value, lease.revision, ttl_header(ttl_s))
        except nats.js.errors.APIError as err:
            if err.err_code in JS_WRONG_LAST_SEQUENCE:
                raise self._lost(lease, await self.current(lease.key)) from err
            raise
        return Lease(lease.key, lease.holder, lease.epoch, seq, ttl_s)

    @translates_unavailable("release the lease of {lease.key}")
    async def release(self, lease: Lease) -> None:
        """Give the lease up now (a delete that expires itself); LeaseLost if it is no longer this one."""
        headers = {
            HDR_KV_OPERATION: "DEL",
            HDR_EXPECTED_LAST_SUBJECT_SEQ: str(lease.revision),
            # The tombstone is not kept forever: the bucket of finished sessions empties itself.
            HDR_TTL: ttl_header(lease.ttl_s),
        }
        try:
            await self._publish(self.subject(lease.key), b"", headers)
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
