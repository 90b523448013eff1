"""A continuous pull on a durable JetStream consumer: pull requests kept topped up, deliveries taken in bursts.

nats-py's `fetch()` publishes a pull request and waits for its end on every call; at a live tail that is a
request, a record, a status message and a few task switches per record. Here a pull request for up to `batch`
messages stays open (with an expiry and idle heartbeats), the next one goes out when half of what was asked for
has arrived, and the caller takes everything that has arrived in one go (the way nats.go's and NATS .NET's
`Consume` work). Pending counts follow the server's status messages: `408` (expired) and `409` carry
`Nats-Pending-Messages`, what a request still had open when it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

from nats.aio.client import Client
from nats.aio.msg import Msg

log = logging.getLogger("sessionlog.pull")

STATUS: Final = "Status"
DESCRIPTION: Final = "Description"
PENDING_MESSAGES: Final = "Nats-Pending-Messages"
_ACK: Final = b"+ACK"
_V1_TOKENS: Final = 9  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>


class ConsumerGone(Exception):
    """The server says the consumer no longer exists (deleted, or recreated by someone else)."""


@dataclass(slots=True)
class Delivery:
    """One delivered message and where it sits, read from its reply subject."""

    msg: Msg
    stream_seq: int
    pending: int  # messages of the consumer not yet delivered after this one
    time_ns: int  # when the stream stored it


def delivery(msg: Msg) -> Delivery:
    """Cheaper than `msg.metadata` (no datetime, no frozen dataclasses): the three numbers the runner uses."""
    tokens = msg.reply.split(".")
    if len(tokens) == _V1_TOKENS:
        return Delivery(msg, int(tokens[5]), int(tokens[8]), int(tokens[7]))
    meta = msg.metadata  # the domain-qualified form: let nats-py read it
    return Delivery(msg, meta.sequence.stream, meta.num_pending, int(meta.timestamp.timestamp() * 1e9))


class PullFeed:
    """Keeps pull requests open on one consumer and hands out what arrives, in order, a burst at a time.

    Back-pressure: at most `batch` messages are ever requested and not yet delivered, so what waits here is
    bounded; the consumer's `max_ack_pending` bounds what is delivered and not yet acknowledged.
    """

    def __init__(
        self,
        nc: Client,
        stream: str,
        consumer: str,
        *,
        batch: int,
        expires_s: float,
        heartbeat_s: float,
        api_prefix: str = "$JS.API",
    ) -> None:
        self._nc = nc
        self._next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.consumer = consumer
        self.batch = batch
        self._expires_ns = int(expires_s * 1e9)
        self._heartbeat_ns = int(heartbeat_s * 1e9)
        self._silence_s = 3 * heartbeat_s  # no heartbeat for this long: our requests are gone (a reconnect)
        self._inbox = ""
        self._sub: Any = None
        self._arrived: list[Msg] = []
        self._waiter: asyncio.Future[None] | None = None
        self._outstanding = 0  # requested and not yet delivered (nor ended by a status)
        self._last_heard = time.monotonic()
        self._heard_at = self._last_heard  # unlike _last_heard, not reset when the feed pulls again
        self._retry_at = 0.0
        self._gone = ""  # why the consumer is gone, once the server said so
        # Pull requests live on the connection: a reconnect ends them (and a server that restarted may have lost the
        # consumer itself, which is a cursor kept in memory). The feed asks again at once, and is not `answered`
        # until the consumer has said something on the new connection.
        self._pulled_on = self._heard_on = nc.stats["reconnects"]

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg)
        await self._top_up()

    async def stop(self) -> None:
        self.wake()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    def wake(self) -> None:
        """End a `take` that is waiting (a stop)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _on_msg(self, msg: Msg) -> None:
        self._arrived.append(msg)
        self._heard_on = self._nc.stats["reconnects"]
        self.wake()

    @property
    def answered(self) -> bool:
        """The consumer has said something (a delivery, a status, a heartbeat) since the last reconnect."""
        return self._heard_on == self._nc.stats["reconnects"]

    async def take(self, timeout: float) -> list[Delivery]:
        """What has arrived, in order (waiting up to `timeout` when nothing has); raises ConsumerGone."""
        if not self._arrived:
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            timer = loop.call_later(timeout, self.wake)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self._nc.stats["reconnects"] != self._pulled_on:  # the requests ended with the old connection
            self._pulled_on = self._nc.stats["reconnects"]
            self._outstanding = 0
            self._retry_at = 0.0
        msgs, self._arrived = self._arrived, []
        out: list[Delivery] = []
        if msgs:
            self._last_heard = self._heard_at = time.monotonic()
        for msg in msgs:
            headers = msg.headers
            if not msg.data and headers and STATUS in headers:
                self._on_status(headers)
            else:
                out.append(delivery(msg))
        self._outstanding = max(0, self._outstanding - len(out))
        if self._gone:
            raise ConsumerGone(f"consumer {self.consumer}: {self._gone}")
        if time.monotonic() - self._last_heard > self._silence_s:
            log.info("consumer %s: no delivery or heartbeat for %.1fs, pulling again", self.consumer, self._silence_s)
            self._outstanding = 0
            self._last_heard = time.monotonic()
        await self._top_up()
        return out

    def silent_for(self) -> float:
        """Seconds since the consumer last sent anything (a delivery, a status or a heartbeat)."""
        return time.monotonic() - self._heard_at

    async def ack(self, last: Delivery) -> None:
        """Acknowledge `last` and, under AckPolicy.ALL, everything delivered before it; nothing waits for a reply."""
        await self._nc.publish(last.msg.reply, _ACK)

    def _on_status(self, headers: dict[str, str]) -> None:
        code = headers.get(STATUS, "")
        if code == "100":  # idle heartbeat: the requests are alive
            return
        description = headers.get(DESCRIPTION, "")
        if code == "409" and "Consumer Deleted" in description:
            self._gone = description
            return
        if code == "503":  # no responders: the consumer does not exist (or JetStream is not answering)
            self._gone = "no responders to the pull request"
            return
        pending = headers.get(PENDING_MESSAGES)
        if code in ("404", "408", "409") and pending is not None and pending.isdigit():
            self._outstanding = max(0, self._outstanding - int(pending))  # that request ended with these unfilled
            return
        # A request refused outright (e.g. 409 Exceeded MaxWaiting) or ended without a count: ask again, later.
        log.warning("consumer %s: pull status %s %s", self.consumer, code, description)
        self._outstanding = 0
        self._retry_at = time.monotonic() + 0.1

    async def _top_up(self) -> None:
        if self._outstanding > self.batch // 2 or time.monotonic() < self._retry_at or self._sub is None:
            return
        wanted = self.batch - self._outstanding
        body = {"batch": wanted, "expires": self._expires_ns, "idle_heartbeat": self._heartbeat_ns}
        await self._nc.publish(self._next_subject, json.dumps(body).encode(), reply=self._inbox)
        self._outstanding += wanted
