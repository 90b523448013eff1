"""The raw tee: the exact bytes the gateway forwarded and the provider's raw response, on the audit stream.

For every forwarded request two entries are published to `sessionlog.raw.<session>` (stream `SESSIONLOG_RAW`):
`Sessionlog-Kind: request` (the bytes sent upstream) and `Sessionlog-Kind: response` (the response body as the
provider sent it: SSE lines or JSON, cut short where the call was cut short). Both carry `Sessionlog-Request-Id`,
the session seq the invariant was checked at (`Sessionlog-Session-Seq`), the route, and for the response the
upstream status and the outcome. An entry larger than one NATS message is split into parts
(`Sessionlog-Part` 0-based, `Sessionlog-Parts`), concatenated in order by a reader.

Publishing runs in the background after the response completes, so the client never waits for the audit; a
failure is logged and counted, and `Nats-Msg-Id` (`<request id>:<kind>:<part>`) makes a retry safe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Final

from nats.js import JetStreamContext

from sessionlog.record import H_RAW_KIND, H_RAW_PART, H_RAW_PARTS, H_RAW_REQUEST_ID, raw_subject

from .metrics import GatewayMetrics

log = logging.getLogger("sessionlog.gateway")

H_REQUEST_ID: Final = H_RAW_REQUEST_ID
H_KIND: Final = H_RAW_KIND
H_PART: Final = H_RAW_PART
H_PARTS: Final = H_RAW_PARTS
# Room left in a NATS message for the headers.
_HEADER_ROOM: Final = 4096


class RawTee:
    """Publishes raw request and response bytes to the audit stream in the background."""

    def __init__(
        self, js: JetStreamContext, *, stream: str, max_payload: int, metrics: GatewayMetrics, timeout_s: float = 5.0
    ) -> None:
        self._js = js
        self._stream = stream
        self._part = max(1024, max_payload - _HEADER_ROOM)
        self._metrics = metrics
        self._timeout = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, session_id: str, entries: list[tuple[str, bytes, Mapping[str, str]]]) -> None:
        """Publish `(kind, data, headers)` entries in order, in the background."""
        task = asyncio.create_task(self._publish_all(session_id, entries), name=f"raw-tee-{session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish_all(self, session_id: str, entries: list[tuple[str, bytes, Mapping[str, str]]]) -> None:
        subject = raw_subject(session_id)
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
                }
                try:
                    await self._js.publish(
                        subject, part, stream=self._stream, headers=all_headers, timeout=self._timeout
                    )
                except Exception as exc:
                    self._metrics.raw_tee_failures.inc()
                    log.warning(
                        "raw tee of request %s (%s part %d) to %s failed: %s",
                        request_id,
                        kind,
                        index,
                        subject,
                        type(exc).__name__,
                    )
                    return

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for the publishes in flight (at shutdown, and in tests)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
