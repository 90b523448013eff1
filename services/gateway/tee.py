"""The raw tee: the exact bytes the gateway forwarded and the provider's raw response, on the audit stream.

For every forwarded request two entries are published to `sessionlog.raw.<session>` (stream `SESSIONLOG_RAW`):
`Sessionlog-Kind: request` (the bytes sent upstream) and `Sessionlog-Kind: response` (the response body as the
provider sent it: SSE lines or JSON, cut short where the call was cut short). Both carry `Sessionlog-Request-Id`,
the session seq the invariant was checked at (`Sessionlog-Session-Seq`), the route, and for the response the
upstream status and the outcome. An entry larger than one NATS message is split into parts
(`Sessionlog-Part` 0-based, `Sessionlog-Parts`), concatenated in order by a reader.

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
from typing import Final

from sessionlog.record import H_RAW_KIND, H_RAW_PART, H_RAW_PARTS, H_RAW_REQUEST_ID, raw_subject
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
                await self._publish_entries(subject, entries)
        finally:
            self.pending_bytes -= size

    async def _publish_entries(self, subject: str, entries: list[tuple[str, bytes, Mapping[str, str]]]) -> None:
        for kind, data, headers in entries:
            request_id = headers.get(H_REQUEST_ID, "")
            parts = [data[i : i + self._part] for i in range(0, len(data), self._part)] or [b""]
            for index, part in enumerate(parts):
                all_headers = {
                    **headers,
                    H_KIND: kind,
                    H_PART: str(index),
                    H_PARTS: str(len(parts)),
                    "Nats-Msg-Id": f"{request_id}:{kind}:{index}",
                    "Nats-Expected-Stream": self._stream,
                }
                failure = await self._publish(subject, part, all_headers)
                if failure is not None:
                    self._metrics.raw_tee_failures.inc()
                    log.warning(
                        "raw tee of request %s (%s part %d) to %s failed: %s",
                        request_id,
                        kind,
                        index,
                        subject,
                        failure,
                    )
                    return

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str]) -> str | None:
        """Publish until acknowledged; None once stored, else why not (the budget spent, or a refusal)."""
        try:
            await self._store.publish_raw(subject, data, headers, budget_s=self._retry_s, attempt_s=self._attempt_s)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return f"{reason} (sent again while unanswered, for up to {self._retry_s:g}s without an acknowledgement)"
        return None

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for the publishes in flight, at most `timeout_s` (at shutdown, and in tests); the exchanges still
        being sent again then are given up, logged and counted."""
        given_up = await self._writes.settle(timeout_s)
        if given_up:
            self._metrics.raw_tee_failures.inc(given_up)
            log.warning("raw tee: %d exchanges given up at shutdown (not acknowledged within %ss)", given_up, timeout_s)
