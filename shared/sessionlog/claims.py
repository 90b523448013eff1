"""Partition claims: replicas of a projection split its partitions through the lease bucket
(`partition.<projection>.<N>`). Replicas find each other with a presence request on
`sessionlog.replicas.<projection>`; each takes a fair share, preferring partitions by rendezvous hash, hands extras
to newcomers, and a survivor takes over a dead replica's partitions once their leases expire. Without a leader no
lease can be taken: `failure` says why, and the loop keeps trying.

Membership is what was heard, not what answered in time: every round's request names its sender (so everyone
hears it) and its answers come to an inbox kept for the replica's life, and a replica heard from within a lease
TTL counts as live. An answer later than the round's wait counts in the next round; on a loaded machine answers
came after the wait, newcomers counted nobody and nobody counted them, and they got no partition at all. A replica
that stops says so on the same subject (header `Sessionlog-Leaving`), so its partitions are taken at once, not a
TTL later; one that dies stops being heard and drops out as its leases expire.

Each round refreshes every held lease at once. A partition let go of (handed to a newcomer, or lost) stops its feed
in a task of its own: a feed finishes the burst in hand first, seconds on a loaded machine, and a round that waited
for it let the other leases lapse (taken by another replica while this one still applied their records)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from nats.aio.client import Client

from .errors import LeaseHeld, LeaseLost
from .leases import Lease, Leases

log = logging.getLogger("sessionlog.claims")

H_LEAVING: Final = "Sessionlog-Leaving"  # on a presence message: its sender stops and lets its partitions go
LEFT_GRACE_S: Final = 1.0  # answers from a replica that left, heard this soon after, came late: not counted


def _sender(msg: Any) -> str:
    """The replica a presence message names; "" (counted as nobody) for bytes that are no UTF-8 id."""
    try:
        return str(msg.data.decode())
    except UnicodeDecodeError:
        return ""


def _drop_before(times: dict[str, float], horizon: float) -> None:
    for key in [k for k, t in times.items() if t < horizon]:
        del times[key]


class PartitionClaims:
    """Claims a fair share of `partitions` for `replica_id`; `own(number, lease)` and `disown(number, release)`
    are the runtime's, called as partitions are won and lost."""

    def __init__(
        self,
        nc: Client,
        leases: Leases,
        projection: str,
        replica_id: str,
        partitions: list[int],
        *,
        own: Callable[[int, Lease], Awaitable[None]],
        disown: Callable[[int, bool], Awaitable[None]],
    ) -> None:
        self.nc = nc
        self.leases = leases
        self.projection = projection
        self.replica_id = replica_id
        self.partitions = partitions
        self.held: dict[int, Lease] = {}
        self._own = own
        self._disown = disown
        self.failure: str | None = "no claim round has completed yet"
        self._presence: Any = None
        self._answers: Any = None
        self._inbox = ""
        self._heard: dict[str, float] = {}  # another replica's id -> when it was last heard from (monotonic)
        self._left: dict[str, float] = {}  # a replica that said it leaves -> when
        self.window_s = 5.0  # heard from this recently: live (`loop` makes it the lease TTL)
        # Partitions being let go of (their feeds stopping), not claimed again until they are gone from here.
        self._leaving: dict[int, asyncio.Task[None]] = {}

    @property
    def _subject(self) -> str:
        return f"sessionlog.replicas.{self.projection}"

    async def start(self) -> None:
        self._inbox = self.nc.new_inbox()
        self._answers = await self.nc.subscribe(self._inbox, cb=self._on_answer)
        self._presence = await self.nc.subscribe(self._subject, cb=self._on_presence)

    async def leave(self) -> None:
        """Tell the other replicas this one stops: they count it out now and take what it releases at once. It
        answers no presence request from here on: its feeds may take seconds to stop, and an answer meanwhile would
        count it live for another TTL."""
        await self.stop()
        with contextlib.suppress(Exception):
            await self.nc.publish(self._subject, self.replica_id.encode(), headers={H_LEAVING: "1"})
            await self.nc.flush(timeout=1)

    async def stop(self) -> None:
        for sub in (self._presence, self._answers):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._presence = self._answers = None

    def _hear(self, sender: str) -> None:
        if not sender or sender == self.replica_id:
            return
        now = time.monotonic()
        if now - self._left.get(sender, -math.inf) < LEFT_GRACE_S:
            return  # an answer it sent before it left, come late (answers and notices arrive on two subscriptions)
        self._heard[sender] = now

    async def _on_presence(self, msg: Any) -> None:
        sender = _sender(msg)  # empty from replicas of older builds: not counted here
        if sender == self.replica_id:
            return  # its own request
        if msg.headers and msg.headers.get(H_LEAVING):
            self._heard.pop(sender, None)
            self._left[sender] = time.monotonic()
            return
        self._hear(sender)
        if msg.reply:
            await self.nc.publish(msg.reply, self.replica_id.encode())

    async def _on_answer(self, msg: Any) -> None:
        self._hear(_sender(msg))

    async def live_replicas(self, wait_s: float = 0.1) -> list[str]:
        """Ask every replica to answer, give the answers `wait_s`, and return the replicas heard from within
        `window_s` (this one included): an answer that comes later still counts, in the next round."""
        await self.nc.publish(self._subject, self.replica_id.encode(), reply=self._inbox)
        await asyncio.sleep(wait_s)
        now = time.monotonic()
        _drop_before(self._heard, now - self.window_s)
        _drop_before(self._left, now - LEFT_GRACE_S)
        return sorted({self.replica_id, *self._heard})

    def preference(self, number: int) -> str:
        return hashlib.sha256(f"{self.replica_id}:{number}".encode()).hexdigest()

    async def loop(self, ttl: float, period: float) -> None:
        self.window_s = ttl  # a replica not heard from for a TTL: its leases are expiring too
        while not self.nc.is_closed:
            try:
                await self.round(ttl)
                self.failure = None
            except asyncio.CancelledError:
                raise
            except Exception as err:  # the next round tries again
                self.failure = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                log.warning("%s: partition claim round failed: %s", self.projection, err)
            await asyncio.sleep(period)

    async def round(self, ttl: float) -> None:
        replicas = await self.live_replicas()
        share = math.ceil(len(self.partitions) / max(1, len(replicas)))
        await self._refresh_held()
        while len(self.held) > share:  # hand extras to newcomers
            number = max(self.held, key=self.preference)
            self._let_go(number, self.held.pop(number), release=True)
        for number in sorted(self.partitions, key=self.preference):
            if len(self.held) >= share:
                break
            if number in self.held or number in self._leaving:
                continue
            try:
                lease = await self.leases.acquire(f"partition.{self.projection}.{number}", self.replica_id, ttl)
            except LeaseHeld:
                continue
            await self._own(number, lease)

    async def _refresh_held(self) -> None:
        """Refresh every held lease at once: one round trip for all, not one per partition."""
        held = list(self.held.items())
        results = await asyncio.gather(*(self.leases.refresh(lease) for _, lease in held), return_exceptions=True)
        failed: BaseException | None = None
        for (number, lease), result in zip(held, results, strict=True):
            if self.held.get(number) is not lease:
                continue  # let go of meanwhile
            if isinstance(result, Lease):
                self.held[number] = result
            elif isinstance(result, LeaseLost):
                log.warning("%s: lost partition %d", self.projection, number)
                self._let_go(number, self.held.pop(number), release=False)
            else:
                failed = failed or result
        if failed is not None:
            raise failed

    def _let_go(self, number: int, lease: Lease, *, release: bool) -> None:
        """Stop a partition's feed and (`release`) give its lease up, in a task of its own: a feed finishes the
        burst in hand first, which can take seconds, and the leases kept must be refreshed meanwhile. The partition
        is no longer held from now on, so it is neither refreshed nor counted in the share."""
        task = asyncio.create_task(self._stop_and_release(number, lease, release), name=f"let-go-{number}")
        self._leaving[number] = task
        task.add_done_callback(lambda done: self._leaving.pop(number) if self._leaving.get(number) is done else None)

    async def _stop_and_release(self, number: int, lease: Lease, release: bool) -> None:
        try:
            await self._disown(number, False)
        except Exception as err:
            log.warning("%s: stopping partition %d failed: %s", self.projection, number, err)
        if release:
            await self.release(lease)

    async def settle(self) -> None:
        """Wait for the partitions being let go of (a graceful stop)."""
        while self._leaving:
            await asyncio.gather(*self._leaving.values(), return_exceptions=True)

    async def abandon(self) -> None:
        """Stop letting go of partitions at once (a replica that dies)."""
        tasks = list(self._leaving.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def still_held(self, number: int) -> bool:
        """Whether the lease of a partition is still ours (by reading it: refreshing is the loop's, and two
        refreshes would fence each other); True when it cannot be read."""
        held = self.held.get(number)
        if held is None:
            return False
        try:
            now = await self.leases.current(held.key)
        except Exception as lease_err:
            log.debug("%s: partition %d: lease read failed: %s", self.projection, number, lease_err)
            return True
        return now is not None and now.epoch == held.epoch

    async def release(self, lease: Lease) -> None:
        with contextlib.suppress(Exception):
            await self.leases.release(lease)
