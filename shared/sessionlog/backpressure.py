"""Back-pressure of record publishes on one connection: a bounded window of publishes in flight, and the progress
of their acknowledgements, which decides how long a record waits before it is sent again or given up on.

A busy server answers every publish, only later. Sending a record again because its answer is late adds to the
queue that made it late; giving up after `publish_retry_s` fails writers of a server that is working (the load of
issue 15: 430 of 1,000 writers failed with `LOG_UNAVAILABLE` at 20,000 events/s on 2 cores). So a record waits
while records of its connection keep being acknowledged, and its budget counts from the last acknowledgement:

- a record is sent again when a record sent after it was acknowledged first (JetStream answers one connection's
  publishes to a stream in order, so this one, or its answer, was lost), or when a whole attempt passed with no
  acknowledgement on the connection and it is the oldest in flight (one probe: when its repeat is answered, the
  others see a later record answered and follow); a repeat carries the same message id and is harmless;
- `LOG_UNAVAILABLE` comes once `publish_retry_s` passed with no acknowledgement on the connection (a server gone, a
  cluster without quorum: exactly as before), and at the latest at `WINDOW_SHARE` of the streams' duplicate window,
  past which a repeat would no longer be recognised by its message id. A tighter cap (four budgets) failed every
  writer of a link the server kept answering, once its queue was more than four budgets long;
- at most `MAX_IN_FLIGHT` records of a connection are in flight; a writer past that waits for a slot, under the same
  budget. Writers slow down to what the server acknowledges instead of failing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import msgspec
import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.js.api import Header

from .errors import js_not_yet

MAX_IN_FLIGHT: Final = 256
# The share of the duplicate window a record may wait while its connection is acknowledging others (settings require
# `publish_retry_s` below the window): the margin keeps its last repeat inside the window.
WINDOW_SHARE: Final = 0.9


class PublishWindow:
    """The record publishes of one connection: slots, and when the last acknowledgement came.

    Answers come to the window's own reply subscription (one per connection, made at the first publish) and wake the
    waiting record directly: a future and a timer per wait, where a request per publish wrapped in a task cost a
    fifth of the writer's time per record (docs/performance.md, issue 12's before and after)."""

    def __init__(self, nc: Client, *, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self._nc = nc
        self._slots = asyncio.Semaphore(max_in_flight)
        self._sent = 0  # tickets, in the order records were handed to the connection
        self._latest = 0  # the latest ticket answered
        self._answers = 0  # how many were answered
        self._answered_at = time.monotonic()
        self._in_flight: set[int] = set()
        self._waiting: dict[int, asyncio.Future[Msg | None]] = {}  # ticket -> the wait its answer ends
        self._early: dict[int, Msg] = {}  # answers that came while their record was between two waits
        self._prefix: str | None = None  # the reply subjects' prefix, once subscribed
        self._subscribing = asyncio.Lock()

    @staticmethod
    def cap(budget_s: float, duplicate_window_s: float) -> float:
        """The longest a record may wait, however busy the connection: a repeat must stay inside the window."""
        return max(budget_s, duplicate_window_s * WINDOW_SHARE)

    def remaining(self, started: float, budget_s: float, cap_s: float) -> float:
        """Seconds left to a record first sent at `started`: `budget_s` from the later of that and the
        connection's last acknowledgement, and never more than `cap_s` from `started`."""
        now = time.monotonic()
        return min(max(started, self._answered_at) + budget_s, started + cap_s) - now

    async def request(self, subject: str, payload: bytes, headers: dict[str, str], *, attempt_s: float,
                      started: float, budget_s: float, cap_s: float) -> Msg:  # fmt: skip
        """One attempt at a record: its answer, or `TimeoutError` when it should be sent again (or given up on:
        the caller asks `remaining`)."""
        prefix = self._prefix if self._prefix is not None else await self._subscribe()
        await self._slot(started, budget_s, cap_s, attempt_s)
        try:
            self._sent += 1
            ticket = self._sent
            self._in_flight.add(ticket)
            try:
                await self._nc.publish(subject, payload, reply=f"{prefix}{ticket}", headers=headers)
                answers = self._answers
                while True:
                    left = self.remaining(started, budget_s, cap_s)
                    reply = await self._answer_within(ticket, max(0.0, min(attempt_s, left)))
                    if reply is not None:
                        if _no_responders(reply):
                            raise nats.errors.NoRespondersError
                        return reply
                    lost = self._latest > ticket  # a later record was answered first
                    # With no answer at all, only the oldest record in flight is sent again (one probe per
                    # attempt): all of them at once would add a queue's worth of repeats to a server that is slow.
                    idle = self._answers == answers and ticket == min(self._in_flight)
                    if lost or idle or self.remaining(started, budget_s, cap_s) <= 0:
                        raise nats.errors.TimeoutError
                    answers = self._answers  # earlier records are still being answered: the server is working
            finally:
                self._in_flight.discard(ticket)
                self._early.pop(ticket, None)
        finally:
            self._slots.release()

    async def _slot(self, started: float, budget_s: float, cap_s: float, attempt_s: float) -> None:
        """A slot in the window, waited for in slices so that the budget is asked again as it moves."""
        if not self._slots.locked():
            await self._slots.acquire()  # free: taken without waiting
            return
        while True:
            left = self.remaining(started, budget_s, cap_s)
            if left <= 0:
                raise nats.errors.TimeoutError
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout=min(attempt_s, left))
                return
            except TimeoutError:
                continue

    async def _answer_within(self, ticket: int, timeout: float) -> Msg | None:
        """The answer to `ticket` if it comes within `timeout` seconds, else None. The wait is a future the answer
        or a timer completes; neither cancels anything, so an answer is never lost between two waits."""
        early = self._early.pop(ticket, None)
        if early is not None:
            return early
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[Msg | None] = loop.create_future()
        self._waiting[ticket] = wake
        timer = loop.call_later(timeout, _complete, wake, None)
        try:
            return await wake
        finally:
            timer.cancel()
            del self._waiting[ticket]

    async def _subscribe(self) -> str:
        """The connection's reply subscription for records, made once."""
        async with self._subscribing:
            if self._prefix is None:
                prefix = f"{self._nc.new_inbox()}."
                await self._nc.subscribe(f"{prefix}*", cb=self._on_answer)
                self._prefix = prefix
            return self._prefix

    async def _on_answer(self, msg: Msg) -> None:
        assert self._prefix is not None
        try:
            ticket = int(msg.subject[len(self._prefix) :])
        except ValueError:
            return
        # An answer is progress whoever it reaches, and whatever it says but "not yet": one to an earlier copy of a
        # record that was sent again (when the record has landed meanwhile, a copy is refused as "wrong last
        # sequence") shows the server working through the queue as much as one that reaches its record.
        # Only a record stored says the ones sent before it were lost when they are still unanswered: a leader may
        # refuse a copy at once, ahead of acknowledgements still waiting for their quorum.
        if not _no_responders(msg) and not _not_yet(msg.data):
            if not msg.data.startswith(b'{"error"'):
                self._latest = max(self._latest, ticket)
            self._answers += 1
            self._answered_at = time.monotonic()
        wake = self._waiting.get(ticket)
        if wake is not None:
            _complete(wake, msg)
        elif ticket in self._in_flight:  # its publish is still being handed to the connection
            self._early[ticket] = msg
        # else: an answer to a record given up on or sent again under a new ticket, dropped


def _no_responders(msg: Msg) -> bool:
    headers = msg.headers
    return headers is not None and headers.get(Header.STATUS) == NO_RESPONDERS_STATUS


def _not_yet(data: bytes) -> bool:
    """Whether an answer is a JetStream error that says "not yet" (`js_not_yet`)."""
    if not data.startswith(b'{"error"'):
        return False
    try:
        error = msgspec.json.decode(data).get("error")
    except (msgspec.DecodeError, AttributeError):
        return False
    return isinstance(error, dict) and js_not_yet(error)


def _complete(wake: asyncio.Future[Msg | None], value: Msg | None) -> None:
    if not wake.done():
        wake.set_result(value)
