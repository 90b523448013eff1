"""Which sessions' logs may have grown since the gateway last read them, learned without asking the stream.

The check mode's derivation (`StreamSource`) would otherwise read the log's tail before every request: one round
trip to JetStream, most of the gateway's own time at 100 messages. A `TailWatch` keeps a core NATS subscription
per session the gateway holds, on the subject writers publish to (`record.in_subject`). Every record published
there is a *hint*: its headers say the last session seq it carries. A hint proves nothing (the stream may refuse
the record, a fenced writer's for instance), so nothing from it is ever applied: it only makes the gateway read
the tail, at once and in the background (`read ahead`), so that the read is usually over before the agent's next
request arrives.

A session held at next seq `n` may then answer a request without a read (`fresh`) when all of these hold:

- the caller's `X-Session-Seq` is below `n`: everything the caller says it flushed is held, read from the stream;
- no hint announced a seq at or beyond `n`: nothing newer is known to exist;
- the watch was *confirmed*: a read that began after the subscription was in place has completed, so a record
  published before the subscription is held or announced, on the connection as it is now (a reconnect can drop
  hints: the epoch is the connection's reconnect count, and a reconnect withdraws every confirmation);
- the connection is up;
- the gateway may subscribe there: a NATS user without that permission (`deploy/nats` grants it) gets the
  server's permissions violation, which arrives before the reply to the confirming read, so no watch is ever
  confirmed and every request reads the tail, as it would without the watch (a warning says so once). A
  connection not made by `sessionlog.connection.connect` cannot report that, so it is not watched at all.

Whatever is served was read from the stream, so it is always a durable prefix of the log that holds the caller's
seq; a record beyond the caller's seq that no hint announced yet (a writer on another server racing the request)
is the same race as a tail read made a moment earlier. Subscriptions are unbounded on the client side (a hint is
never dropped as a slow consumer) and handled without I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sessionlog.connection import on_error
from sessionlog.record import H_COUNT, H_FIRST_SEQ, in_subject

log = logging.getLogger("sessionlog.gateway")

# read(session_id): catch the session up from the stream, with a read that starts now; its next seq after (0: none)
Read = Callable[[str], Awaitable[int]]


class TailWatch:
    """Hints of new records, per watched session; see the module docstring."""

    def __init__(self, nc: Client, read: Read) -> None:
        self._nc = nc
        self._read = read
        self._subs: dict[str, Subscription] = {}
        self._published: dict[str, int] = {}  # the highest session seq a hint announced
        self._held: dict[str, int] = {}  # the next seq the last read ended at
        self._confirmed: dict[str, int] = {}  # the epoch in which a read after the subscription completed
        self._reading: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()  # a hint arrived while a read was in flight
        self.reads_ahead = 0
        # Off when the connection cannot tell us that a subscription was refused, or when one was.
        self.enabled = on_error(nc, self._on_error)
        if not self.enabled:
            log.info("the gateway's NATS connection cannot report refused subscriptions: sessions are not watched")

    def _on_error(self, err: Exception) -> None:
        text = str(err).lower()
        if self.enabled and "permissions violation for subscription" in text and '"sessionlog.in.' in text:
            self.enabled = False
            self._confirmed.clear()
            log.warning(
                "the gateway may not subscribe to %s: check mode reads the log's tail before every request "
                "(grant it the subscription, as deploy/nats does)",
                in_subject("*"),
            )

    def _epoch(self) -> int:
        reconnects: int = self._nc.stats["reconnects"]
        return reconnects

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._subs

    def __len__(self) -> int:
        return len(self._subs)

    def fresh(self, session_id: str, next_seq: int, min_seq: int) -> bool:
        """May a state holding every seq below `next_seq` answer a caller that flushed `min_seq`, without a read?"""
        return (
            self.enabled
            and min_seq < next_seq
            and self._published.get(session_id, -1) < next_seq
            and self._confirmed.get(session_id) == self._epoch()
            and self._nc.is_connected
        )

    def settled(self, session_id: str) -> bool:
        """The watch is confirmed on the connection as it is now and nothing is being read ahead."""
        return self._confirmed.get(session_id) == self._epoch() and session_id not in self._reading

    def announced(self, session_id: str) -> int:
        """The highest session seq a hint announced (-1: none)."""
        return self._published.get(session_id, -1)

    async def watch(self, session_id: str) -> None:
        """Subscribe to the session's hints (once) and confirm the watch with a read in the background."""
        if not self.enabled:
            return
        if session_id in self._subs:
            if self._confirmed.get(session_id) != self._epoch():
                self._read_ahead(session_id)  # after a reconnect: confirm again
            return

        async def hint(msg: Msg) -> None:
            self._hint(session_id, msg)

        # Unbounded: a dropped hint would let a stale state answer. The callback does no I/O.
        sub = await self._nc.subscribe(in_subject(session_id), cb=hint, pending_msgs_limit=0, pending_bytes_limit=0)
        if session_id in self._subs:  # watched meanwhile by a concurrent caller
            await sub.unsubscribe()
            return
        self._subs[session_id] = sub
        # The SUB is written before this read's request, on the same connection: the server has it first.
        self._read_ahead(session_id)

    def _hint(self, session_id: str, msg: Msg) -> None:
        headers = msg.headers or {}
        try:
            last = int(headers[H_FIRST_SEQ]) + int(headers[H_COUNT]) - 1
        except (KeyError, ValueError):
            last = self._held.get(session_id, 0)  # not a record: something may follow what is held
        if last > self._published.get(session_id, -1):
            self._published[session_id] = last
        if last >= self._held.get(session_id, 0):
            self._read_ahead(session_id)

    def _read_ahead(self, session_id: str) -> None:
        if session_id in self._reading:
            self._again.add(session_id)
            return
        task = asyncio.create_task(self._ahead(session_id), name=f"gateway-tail-{session_id}")
        self._reading[session_id] = task
        task.add_done_callback(lambda _: self._reading.pop(session_id, None))

    async def _ahead(self, session_id: str) -> None:
        """Read until what is held covers every hint, or a read brings nothing new (a refused record's hint)."""
        while session_id in self._subs:
            self._again.discard(session_id)
            epoch = self._epoch()
            before = self._held.get(session_id, -1)
            try:
                held = await self._read(session_id)
            except Exception as exc:  # the request path reads again and reports what it meets
                log.debug("reading ahead for session %s failed: %s: %s", session_id, type(exc).__name__, exc)
                return
            self.reads_ahead += 1
            if session_id not in self._subs:
                return
            self._held[session_id] = held
            if epoch == self._epoch() and self.enabled:  # a refused subscription's error came before this reply
                self._confirmed[session_id] = epoch
            behind = self._published.get(session_id, -1) >= held
            if session_id not in self._again and not (behind and held > before):
                return

    def held(self, session_id: str, next_seq: int) -> None:
        """A read on the request path ended at `next_seq`."""
        if session_id in self._subs:
            self._held[session_id] = max(next_seq, self._held.get(session_id, 0))

    def forget(self, session_id: str) -> None:
        """Stop watching the session (its state was dropped)."""
        sub = self._subs.pop(session_id, None)
        for table in (self._published, self._held, self._confirmed):
            table.pop(session_id, None)
        self._again.discard(session_id)
        if sub is not None:
            asyncio.get_running_loop().create_task(_unsubscribe(sub))

    async def close(self) -> None:
        subs = list(self._subs.values())
        for table in (self._subs, self._published, self._held, self._confirmed):
            table.clear()
        for task in list(self._reading.values()):
            task.cancel()
        await asyncio.gather(*(_unsubscribe(sub) for sub in subs))


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception as exc:  # a closed connection has dropped it already
        log.debug("unsubscribing a tail watch: %s: %s", type(exc).__name__, exc)
