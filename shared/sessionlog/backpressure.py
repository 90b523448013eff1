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
  cluster without quorum: exactly as before), and at the latest at `MAX_WAIT_FACTOR` times that budget, below the
  streams' duplicate window, where a repeat would no longer be recognised by its message id;
- at most `MAX_IN_FLIGHT` records of a connection are in flight; a writer past that waits for a slot, under the same
  budget. Writers slow down to what the server acknowledges instead of failing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

MAX_IN_FLIGHT: Final = 256
# How far acknowledgements of other records may stretch one record's budget (`publish_retry_s` times this), and
# never past the duplicate window (settings require `publish_retry_s` below it).
MAX_WAIT_FACTOR: Final = 4.0


class PublishWindow:
    """The record publishes of one connection: slots, and when the last acknowledgement came."""

    def __init__(self, nc: Client, *, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self._nc = nc
        self._slots = asyncio.Semaphore(max_in_flight)
        self._sent = 0  # tickets, in the order records were handed to the connection
        self._latest = 0  # the latest ticket answered
        self._answers = 0  # how many were answered
        self._answered_at = time.monotonic()
        self._in_flight: set[int] = set()

    @staticmethod
    def cap(budget_s: float, duplicate_window_s: float) -> float:
        """The longest a record may wait, however busy the connection: a repeat must stay inside the window."""
        return max(budget_s, min(budget_s * MAX_WAIT_FACTOR, duplicate_window_s * 0.9))

    def remaining(self, started: float, budget_s: float, cap_s: float) -> float:
        """Seconds left to a record first sent at `started`: `budget_s` from the later of that and the
        connection's last acknowledgement, and never more than `cap_s` from `started`."""
        now = time.monotonic()
        return min(max(started, self._answered_at) + budget_s, started + cap_s) - now

    async def request(self, subject: str, payload: bytes, headers: dict[str, str], *, attempt_s: float,
                      started: float, budget_s: float, cap_s: float) -> Msg:  # fmt: skip
        """One attempt at a record: its answer, or `TimeoutError` when it should be sent again (or given up on:
        the caller asks `remaining`)."""
        while True:  # a slot, waited for in slices so that the budget is asked again as it moves
            left = self.remaining(started, budget_s, cap_s)
            if left <= 0:
                raise nats.errors.TimeoutError
            try:
                await asyncio.wait_for(self._slots.acquire(), timeout=min(attempt_s, left))
                break
            except TimeoutError:
                continue
        try:
            self._sent += 1
            ticket = self._sent
            self._in_flight.add(ticket)
            answer = asyncio.ensure_future(self._nc.request(subject, payload, timeout=cap_s, headers=headers))
            try:
                answers = self._answers
                while True:
                    left = self.remaining(started, budget_s, cap_s)
                    done, _ = await asyncio.wait({answer}, timeout=max(0.0, min(attempt_s, left)))
                    if done:
                        reply = answer.result()
                        if not reply.data.startswith(b'{"error"'):  # a refusal (503: no quorum) is no progress
                            self._latest = max(self._latest, ticket)
                            self._answers += 1
                            self._answered_at = time.monotonic()
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
                if not answer.done():
                    answer.cancel()
        finally:
            self._slots.release()
