"""Which sessions' logs may have grown since the gateway last read them, learned without asking the stream.

The check mode's derivation (`StreamSource`) would otherwise read the log's tail before every request: one round
trip to JetStream, most of the gateway's own time at 100 messages. A `TailWatch` keeps a core NATS subscription
per session the gateway holds, on the subject writers publish to (`record.in_subject`). Every record published
there is a *hint*: its headers say which session seqs it carries. A hint proves nothing (the stream may refuse the
record, a fenced writer's for instance), so nothing from it is ever applied: it only makes the gateway read the
tail, at once and in the background (`read ahead`), so that the read is usually over before the agent's next
request arrives. A hint that does not continue what is held (a session purged and created again under its id, a
writer's retry) makes the gateway read too, and the read reloads a log that no longer continues the state.

A session read up to next seq `n` may then answer a request without a read (`fresh`) when all of these hold:

- the caller's `X-Session-Seq` is below `n`: everything the caller says it flushed is held, read from the stream;
- no hint announced a seq at or beyond `n`, nor a record that does not continue the state;
- the watch is *confirmed*, and recently: a read that began after this subscription was in place completed less
  than `CONFIRMED_FOR_S` ago, on the connection as it is now. A hint can still be missed: a record accepted just
  before the subscription reached the server, or a cluster server, that is stored after the confirming read; a
  confirming read answered by a follower that lags; hints lost while a connection is half open. The bound on the
  confirmation's age bounds what such a miss costs: a record beyond the caller's seq that no hint announced is
  missed for at most `CONFIRMED_FOR_S`. A reconnect (the epoch is the connection's reconnect count) withdraws every
  confirmation at once. An agent that writes before each request has its watch confirmed again by the read ahead,
  and a session answered from its watch past half the confirmation's life is read again in the background;
- the connection is up;
- the gateway may subscribe there: a NATS user without that permission (`deploy/nats` grants it) gets the
  server's permissions violation, which arrives before the reply to the confirming read, so no watch is confirmed;
  the watch then stops for good (its subscriptions dropped) and every request reads the tail, as it would without
  it (a warning says so once). A connection not made by `sessionlog.connection.connect` cannot report that, so it
  is not watched at all.

Whatever is served was read from the stream, so it holds everything the caller says it flushed. A session that an
admin purges (`sessionlog.admin.purged.<id>`) is forgotten at once. Subscriptions are unbounded on the client side
(a hint is never dropped as a slow consumer) and handled without I/O; each hint carries its record's payload, so a
gateway receives a copy of what its held sessions write.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sessionlog.connection import on_error
from sessionlog.log import PURGED_PREFIX
from sessionlog.record import H_COUNT, H_FIRST_SEQ, in_subject

log = logging.getLogger("sessionlog.gateway")

CONFIRMED_FOR_S: Final = 1.0  # a watch answers without a read only this long after the read that confirmed it
STORE_TRIES: Final = 4  # reads again of a record announced and not found, 5, 10, 20 and 40 ms apart
STORE_WAIT_S: Final = 0.005

# read(session_id): catch the session up from the stream, with a read that starts now; its next seq after (0: none)
Read = Callable[[str], Awaitable[int]]


class TailWatch:
    """Hints of new records, per watched session; see the module docstring. `purged(session_id)` is called when an
    admin erases a session."""

    def __init__(self, nc: Client, read: Read, purged: Callable[[str], None]) -> None:
        self._nc = nc
        self._read = read
        self._purged = purged
        self._subs: dict[str, Subscription] = {}
        self._announced: dict[str, int] = {}  # the highest session seq a hint announced
        self._read_to: dict[str, int] = {}  # the next seq the last read ended at
        # session -> (epoch, monotonic start) of the last read that began after its subscription and completed
        self._confirmed: dict[str, tuple[int, float]] = {}
        self._reading: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()  # a hint arrived while a read was in flight
        self._background: set[asyncio.Task[None]] = set()
        self._purges: Subscription | None = None
        # Off when the connection cannot tell us that a subscription was refused, when one was, or once closed.
        self.enabled = on_error(nc, self._on_error)
        if not self.enabled:
            log.info("the gateway's NATS connection cannot report refused subscriptions: sessions are not watched")

    def _epoch(self) -> int:
        return int(self._nc.stats["reconnects"])

    def watching(self, session_id: str) -> bool:
        return session_id in self._subs

    def _confirmed_for(self, session_id: str) -> float:
        """Seconds since the read that confirmed the watch on the connection as it is now began (inf: none did)."""
        confirmed = self._confirmed.get(session_id)
        if confirmed is None or confirmed[0] != self._epoch():
            return float("inf")
        return time.monotonic() - confirmed[1]

    def fresh(self, session_id: str, next_seq: int, min_seq: int) -> bool:
        """May a state holding every seq below `next_seq` answer a caller that flushed `min_seq`, without a read?"""
        return (
            self.enabled
            and min_seq < next_seq
            and self._announced.get(session_id, -1) < next_seq
            and self._confirmed_for(session_id) < CONFIRMED_FOR_S
            and self._nc.is_connected
        )

    def served(self, session_id: str) -> None:
        """A request was answered from the watch: a confirmation past half its life is renewed in the background,
        so a session in use is never read on a request's path only because its confirmation aged."""
        if self._confirmed_for(session_id) >= CONFIRMED_FOR_S / 2 and session_id not in self._reading:
            self._read_ahead(session_id)

    def settled(self, session_id: str, seq: int = -1) -> bool:
        """The watch is confirmed on the connection as it is now, recently, nothing is being read ahead, and the
        last read holds session seq `seq` (a hint may arrive after a read that already holds its record)."""
        return (
            self._read_to.get(session_id, 0) > seq
            and self._confirmed_for(session_id) < CONFIRMED_FOR_S
            and session_id not in self._reading
        )

    def announced(self, session_id: str) -> int:
        """The highest session seq a hint announced (-1: none)."""
        return self._announced.get(session_id, -1)

    async def watch(self, session_id: str) -> None:
        """Subscribe to the session's hints (once) and confirm the watch with a read in the background; a watch
        already in place whose confirmation is withdrawn or old is confirmed again the same way."""
        if not self.enabled:
            return
        if self._purges is None:
            self._purges = await self._nc.subscribe(f"{PURGED_PREFIX}*", cb=self._on_purge)
        sub = self._subs.get(session_id)
        if sub is None:
            sub = await self._subscribe(session_id)
            if sub is None:
                return
        if not self.settled(session_id):
            self._read_ahead(session_id)

    async def _subscribe(self, session_id: str) -> Subscription | None:
        made: list[Subscription] = []

        async def hint(msg: Msg) -> None:
            # only while this subscription is the session's: the queued hints of one dropped since count no more
            if made and self._subs.get(session_id) is made[0]:
                self._hint(session_id, msg)

        # Unbounded: a dropped hint would let a stale state answer. The callback does no I/O.
        sub = await self._nc.subscribe(in_subject(session_id), cb=hint, pending_msgs_limit=0, pending_bytes_limit=0)
        if session_id in self._subs or not self.enabled:  # watched meanwhile by a concurrent caller, or refused
            await _unsubscribe(sub)
            return None
        made.append(sub)
        self._subs[session_id] = sub
        return sub

    def _hint(self, session_id: str, msg: Msg) -> None:
        headers = msg.headers or {}
        read_to = self._read_to.get(session_id, 0)
        try:
            first = int(headers[H_FIRST_SEQ])
            last = first + int(headers[H_COUNT]) - 1
        except (KeyError, ValueError):
            first = last = read_to  # not a record: something may follow what is held
        if first < read_to:
            last = max(last, read_to)  # it does not continue the state (a session made again, a retry): read
        if last > self._announced.get(session_id, -1):
            self._announced[session_id] = last
        if last >= read_to:
            self._read_ahead(session_id)

    def _read_ahead(self, session_id: str) -> None:
        if session_id in self._reading:
            self._again.add(session_id)
            return
        task = asyncio.create_task(self._ahead(session_id), name=f"gateway-tail-{session_id}")
        self._reading[session_id] = task
        task.add_done_callback(lambda _: self._reading.pop(session_id, None))

    async def _ahead(self, session_id: str) -> None:
        """Read until what is held covers every hint. A hint can come before its record is stored (the server hands
        a message to subscribers before the stream has it), so a read that brings nothing new is tried again a few
        times, a little later each time; a record the stream refused is announced but never comes, and the reads
        stop there."""
        tries = 0
        while (sub := self._subs.get(session_id)) is not None:
            self._again.discard(session_id)
            epoch, started = self._epoch(), time.monotonic()
            before = self._read_to.get(session_id, -1)
            try:
                read_to = await self._read(session_id)
            except Exception as exc:  # the request path reads again and reports what it meets
                log.debug("reading ahead for session %s failed: %s: %s", session_id, type(exc).__name__, exc)
                return
            if self._subs.get(session_id) is not sub:  # forgotten (and maybe watched again) meanwhile
                return
            self._read_to[session_id] = read_to
            if epoch == self._epoch() and self.enabled:  # a refused subscription's error came before this reply
                self._confirmed[session_id] = (epoch, started)
            behind = self._announced.get(session_id, -1) >= read_to
            if session_id in self._again or (behind and read_to > before):
                tries = 0
                continue
            if not behind or tries >= STORE_TRIES:
                return
            await asyncio.sleep(STORE_WAIT_S * 2**tries)  # announced, not stored yet (or refused)
            tries += 1

    def read_to(self, session_id: str, next_seq: int) -> None:
        """A read on the request path ended at `next_seq`."""
        if session_id in self._subs:
            self._read_to[session_id] = max(next_seq, self._read_to.get(session_id, 0))

    def forget(self, session_id: str) -> None:
        """Stop watching the session (its state was dropped)."""
        sub = self._subs.pop(session_id, None)
        for table in (self._announced, self._read_to, self._confirmed):
            table.pop(session_id, None)
        self._again.discard(session_id)
        if sub is not None:
            self._in_background(_unsubscribe(sub))

    async def _on_purge(self, msg: Msg) -> None:
        session_id = msg.subject[len(PURGED_PREFIX) :]
        self.forget(session_id)
        self._purged(session_id)

    def _on_error(self, err: Exception) -> None:
        # nats-py reports a refused subscription as a plain error with the server's text: there is no typed one.
        text = str(err).lower()
        refused = "permissions violation for subscription" in text
        if self.enabled and refused and ('"sessionlog.in.' in text or f'"{PURGED_PREFIX}' in text):
            self.enabled = False  # at once: the confirming read's reply is processed after this
            log.warning(
                "the gateway may not subscribe to %s and %s*: check mode reads the log's tail before every request "
                "(grant it the subscriptions, as deploy/nats does)",
                in_subject("*"),
                PURGED_PREFIX,
            )
            self._in_background(self.close())

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        """Watch nothing more: every subscription dropped, every read ahead stopped."""
        self.enabled = False
        subs = list(self._subs.values())
        if self._purges is not None:
            subs.append(self._purges)
            self._purges = None
        for table in (self._subs, self._announced, self._read_to, self._confirmed):
            table.clear()
        reading = list(self._reading.values())
        for task in reading:
            task.cancel()
        await asyncio.gather(*reading, *(_unsubscribe(sub) for sub in subs), return_exceptions=True)
        background = [t for t in self._background if t is not asyncio.current_task()]
        await asyncio.gather(*background, return_exceptions=True)


async def _unsubscribe(sub: Subscription) -> None:
    try:
        await sub.unsubscribe()
    except Exception as exc:  # a closed connection has dropped it already
        log.debug("unsubscribing a tail watch: %s: %s", type(exc).__name__, exc)
