"""Partition claims: replicas of a projection split its partitions through the lease bucket
(`partition.<projection>.<N>`). Replicas find each other with a presence request on
`sessionlog.replicas.<projection>`; each takes a fair share, preferring partitions by rendezvous hash, hands extras
to newcomers, and a survivor takes over a dead replica's partitions once their leases expire. Without a leader no
lease can be taken: `failure` says why, and the loop keeps trying.

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
from typing import Any

import nats.errors
from nats.aio.client import Client

from .errors import LeaseHeld, LeaseLost
from .leases import Lease, Leases

log = logging.getLogger("sessionlog.claims")


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
        # Partitions being let go of (their feeds stopping), not claimed again until they are gone from here.
        self._leaving: dict[int, asyncio.Task[None]] = {}

    async def start(self) -> None:
        self._presence = await self.nc.subscribe(f"sessionlog.replicas.{self.projection}", cb=self._answer_presence)

    async def stop(self) -> None:
        if self._presence is not None:
            with contextlib.suppress(Exception):
                await self._presence.unsubscribe()
            self._presence = None

    async def _answer_presence(self, msg: Any) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, self.replica_id.encode())

    async def live_replicas(self, wait_s: float = 0.1) -> list[str]:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        found: set[str] = {self.replica_id}
        try:
            await self.nc.publish(f"sessionlog.replicas.{self.projection}", b"", reply=inbox)
            deadline = time.monotonic() + wait_s
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    reply = await sub.next_msg(timeout=remaining)
                except (TimeoutError, nats.errors.TimeoutError):
                    break
                found.add(reply.data.decode())
        finally:
            await sub.unsubscribe()
        return sorted(found)

    def preference(self, number: int) -> str:
        return hashlib.sha256(f"{self.replica_id}:{number}".encode()).hexdigest()

    async def loop(self, ttl: float, period: float) -> None:
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
