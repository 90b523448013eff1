"""The raw tee: the exact bytes the gateway forwarded and the provider's raw response, on the audit stream.

For every forwarded request two entries are published to `sessionlog.raw.<session>` (stream `SESSIONLOG_RAW`):
`Sessionlog-Kind: request` (the bytes sent upstream) and `Sessionlog-Kind: response` (the response body as the
provider sent it: SSE lines or JSON, cut short where the call was cut short). Both carry `Sessionlog-Request-Id`,
the session seq the invariant was checked at (`Sessionlog-Session-Seq`), the route, and for the response the
upstream status and the outcome. An entry larger than one NATS message is split into parts
(`Sessionlog-Part` 0-based, `Sessionlog-Parts`), concatenated in order by a reader.

An agent's next request repeats its whole context, so storing every request whole would make the raw stream grow
with the square of a session's length (a 500 KB context asked 200 times: 100 MB for one session). A request entry
is therefore stored as a delta of the session's previous request entry when they share a prefix of at least
`MIN_SHARED` bytes: only the bytes after that prefix, with `Sessionlog-Base` (the previous request's id),
`Sessionlog-Base-Prefix`, `Sessionlog-Size` (the whole body's) and `Sessionlog-Root-Seq` (the stream seq of the whole
entry the chain of deltas starts from). The base is always an entry already acknowledged on the same subject, so a
reader that reads a session's subject in order has every base before the delta that needs it
(`sessionlog.audit.RawAssembler`); one that starts in the middle reads the subject again from the root seq. A chain
is cut (the entry stored whole) after `MAX_DEPTH` deltas, or once the bytes stored from its root would exceed twice
the body (a history edit that keeps little of the previous request): the request entries a reader reads again to
rebuild one hold at most about twice its size, and it rebuilds at most `MAX_DEPTH` bodies, while the stored bytes
of a growing session are about what it adds plus one whole request in every `MAX_DEPTH`. The bases are kept in
memory, at most `MAX_BASE_BYTES` of them (the least recently teed session's goes first, and its next request is
stored whole). A session erased (`sessionlog purge`) and made again under the same id while a gateway still holds
its base has its next request stored as a delta of an erased entry; a reader then finds no base and reads that
request without bytes, as a request entry the tee could not publish.

Publishing runs in the background after the response completes, so the client never waits for the audit. Each
message goes through the connection's publish window, as the writers' records do (`RecordStore.publish_raw`,
`sessionlog.backpressure`): one that is not answered (a stalled or dropped connection, a stream electing its
leader) is sent again until it is acknowledged, and given up once `retry_s` (`SESSIONLOG_PUBLISH_RETRY_S`, as the
writers') passed with no acknowledgement on the connection, so a server that is busy but answering does not lose
the audit. `Nats-Msg-Id` (`<request id>:<kind>:<part>`) makes every repeat harmless, so an exchange is stored once
however often it was sent. At most `PUBLISHING` exchanges are published at once (after an outage the backlog goes
out a few at a time on the connection the writers share), and what waits to be teed is bounded
(`max_pending_bytes`). Past that bound an exchange is not teed at all; past the budget, on a refusal, or when the
gateway stops (`drain`) the rest of it is not teed (what was acknowledged before stays). Each is logged and counted
(`sessionlog_gateway_raw_tee_failures`); the audit's provider ledger then lacks that exchange.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from sessionlog.lru import LRU
from sessionlog.record import (
    H_RAW_BASE,
    H_RAW_BASE_PREFIX,
    H_RAW_KIND,
    H_RAW_PART,
    H_RAW_PARTS,
    H_RAW_REQUEST_ID,
    H_RAW_ROOT_SEQ,
    H_RAW_SIZE,
    raw_subject,
)
from sessionlog.store import RecordStore
from sessionlog.tasks import BackgroundWrites

from .metrics import GatewayMetrics

log = logging.getLogger("sessionlog.gateway")

H_REQUEST_ID: Final = H_RAW_REQUEST_ID
H_KIND: Final = H_RAW_KIND
H_PART: Final = H_RAW_PART
H_PARTS: Final = H_RAW_PARTS
# Room left in a NATS message for the headers.
_HEADER_ROOM: Final = 4096
# Bytes of exchanges waiting to be teed, at most (a long outage under load must not hold every body in memory).
MAX_PENDING_BYTES: Final = 256 * 1024 * 1024
PUBLISHING: Final = 8
# A request shares at least this many leading bytes with the session's previous one to be stored as its delta.
MIN_SHARED: Final = 1024
# Bytes of the sessions' last request bodies kept as bases, at most.
MAX_BASE_BYTES: Final = 64 * 1024 * 1024
# Deltas in a chain, at most: a reader that lacks a base rebuilds at most this many bodies to reach it.
MAX_DEPTH: Final = 64


def shared_prefix(a: bytes, b: bytes) -> int:
    """How many leading bytes `a` and `b` have in common (a binary search of memcmp'd windows: no copies)."""
    view = memoryview(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(view[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class Base:
    """A session's last request entry acknowledged on the raw stream: what its next request is a delta of."""

    request_id: str
    body: bytes
    root_seq: int  # stream seq of the first part of the whole entry its chain starts from
    chain_bytes: int  # bytes stored from that entry to this one, both included
    depth: int = 0  # deltas from that entry to this one


def entry_parts(
    kind: str, data: bytes, headers: Mapping[str, str], delta: tuple[Base, int] | None, part_size: int
) -> list[tuple[bytes, dict[str, str]]]:
    """The messages one entry is published as: its data (after the base's prefix, for a delta) in parts of at most
    `part_size` bytes, each with the entry's headers, the delta's and its part's."""
    request_id = headers.get(H_REQUEST_ID, "")
    payload, extra = data, {}
    if delta is not None:
        base, prefix = delta
        payload = data[prefix:]
        extra = {H_RAW_BASE: base.request_id, H_RAW_BASE_PREFIX: str(prefix), H_RAW_SIZE: str(len(data)),
                 H_RAW_ROOT_SEQ: str(base.root_seq)}  # fmt: skip
    parts = [payload[i : i + part_size] for i in range(0, len(payload), part_size)] or [b""]
    out: list[tuple[bytes, dict[str, str]]] = []
    for index, part in enumerate(parts):
        part_headers = {**headers, **extra, H_KIND: kind, H_PART: str(index), H_PARTS: str(len(parts))}
        part_headers["Nats-Msg-Id"] = f"{request_id}:{kind}:{index}"
        out.append((part, part_headers))
    return out


def next_base(request_id: str, data: bytes, delta: tuple[Base, int] | None, first_seq: int) -> Base:
    """What a request entry acknowledged at `first_seq` (its first part) is as the base of the session's next."""
    if delta is None:
        return Base(request_id, data, first_seq, len(data))
    base, prefix = delta
    return Base(request_id, data, base.root_seq, base.chain_bytes + len(data) - prefix, base.depth + 1)


class Bases:
    """The sessions' bases, at most `max_bytes` of bodies (the least recently teed session's goes first)."""

    def __init__(self, max_bytes: int = MAX_BASE_BYTES, min_shared: int = MIN_SHARED) -> None:
        self._bases: LRU[str, Base] = LRU(max_bytes, weigh=lambda base: len(base.body))
        self._min_shared = min_shared

    def delta(self, session_id: str, body: bytes) -> tuple[Base, int] | None:
        """The base to store `body` as a delta of and how many of its bytes it keeps, or None: store it whole."""
        base = self._bases.get(session_id)
        if base is None:
            return None
        prefix = shared_prefix(base.body, body)
        if (
            prefix < self._min_shared
            or base.chain_bytes + len(body) - prefix > 2 * len(body)
            or base.depth >= MAX_DEPTH
        ):
            return None
        return base, prefix

    def stored(self, session_id: str, base: Base) -> None:
        """`base` was acknowledged: the session's next request is a delta of it."""
        self._bases.put(session_id, base)


class RawTee:
    """Publishes raw request and response bytes to the audit stream in the background, each until acknowledged."""

    def __init__(
        self,
        store: RecordStore,
        *,
        stream: str,
        max_payload: int,
        metrics: GatewayMetrics,
        attempt_s: float | None = None,
        retry_s: float = 30.0,
        max_pending_bytes: int = MAX_PENDING_BYTES,
    ) -> None:
        self._store = store
        self._stream = stream
        self._part = max(1024, max_payload - _HEADER_ROOM)
        self._metrics = metrics
        self._attempt_s = attempt_s  # one attempt (None: a record's), then sent again if the window says so
        self._retry_s = retry_s  # no acknowledgement on the connection for this long: the message is given up
        self._max_pending = max_pending_bytes
        self.pending_bytes = 0
        self._writes = BackgroundWrites()
        self.bases = Bases()
        # Exchanges published at once, at most: after an outage the backlog goes out a few at a time, not all at
        # once on the connection the writers share (each part sent again in full when its answer is late).
        self._publishing = asyncio.Semaphore(PUBLISHING)

    def submit(self, session_id: str, entries: list[tuple[str, bytes, Mapping[str, str]]]) -> None:
        """Publish `(kind, data, headers)` entries in order, in the background."""
        size = sum(len(data) for _, data, _ in entries)
        if self.pending_bytes + size > self._max_pending and len(self._writes):
            request_id = entries[0][2].get(H_REQUEST_ID, "") if entries else ""
            self._metrics.raw_tee_failures.inc()
            log.warning(
                "raw tee of request %s not published: %d bytes already wait to be teed (the audit stream is not "
                "answering)",
                request_id,
                self.pending_bytes,
            )
            return
        self.pending_bytes += size
        self._writes.start(self._publish_all(session_id, entries, size), name=f"raw-tee-{session_id}")

    async def _publish_all(
        self, session_id: str, entries: list[tuple[str, bytes, Mapping[str, str]]], size: int
    ) -> None:
        subject = raw_subject(session_id)
        try:
            async with self._publishing:
                await self._publish_entries(session_id, subject, entries)
        finally:
            self.pending_bytes -= size

    async def _publish_entries(
        self, session_id: str, subject: str, entries: list[tuple[str, bytes, Mapping[str, str]]]
    ) -> None:
        for kind, data, headers in entries:
            delta = self.bases.delta(session_id, data) if kind == "request" else None
            first_seq = 0
            for index, (part, all_headers) in enumerate(entry_parts(kind, data, headers, delta, self._part)):
                all_headers["Nats-Expected-Stream"] = self._stream
                try:
                    seq = await self._store.publish_raw(
                        subject, part, all_headers, budget_s=self._retry_s, attempt_s=self._attempt_s
                    )
                except Exception as exc:
                    self._metrics.raw_tee_failures.inc()
                    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    log.warning(
                        "raw tee of request %s (%s part %d) to %s failed: %s (sent again while unanswered, for up "
                        "to %gs without an acknowledgement)",
                        headers.get(H_REQUEST_ID, ""),
                        kind,
                        index,
                        subject,
                        reason,
                        self._retry_s,
                    )
                    return
                first_seq = first_seq or seq
            if kind == "request":
                self.bases.stored(session_id, next_base(headers.get(H_REQUEST_ID, ""), data, delta, first_seq))

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for the publishes in flight, at most `timeout_s` (at shutdown, and in tests); the exchanges still
        being sent again then are given up, logged and counted."""
        given_up = await self._writes.settle(timeout_s)
        if given_up:
            self._metrics.raw_tee_failures.inc(given_up)
            log.warning("raw tee: %d exchanges given up at shutdown (not acknowledged within %ss)", given_up, timeout_s)
