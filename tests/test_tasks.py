"""Stopping background work always ends (tasks.py, the writer's lease keeper).

On Python 3.11 `asyncio.wait_for`, which nats-py's requests use, swallows a cancel that lands together with the
reply; a stop that cancels once and then waits could wait forever. These tests swallow the cancel on purpose.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from nats.js import JetStreamContext
from natsfixtures import new_session_id

from sessionlog.leases import Lease, LeaseKeeper, Leases
from sessionlog.log import SessionLog
from sessionlog.settings import Settings
from sessionlog.tasks import cancel_and_wait

pytestmark = pytest.mark.asyncio(loop_scope="module")

BOUND_S = 5.0  # a stop that has not ended by then is the bug


async def test_cancel_and_wait_ends_a_task_that_swallows_its_first_cancel() -> None:
    swallowed = 0
    iterations = 0

    async def stubborn() -> None:
        nonlocal swallowed, iterations
        while True:  # a loop with no stop flag: only a second cancel ends it
            iterations += 1
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0.03)
    await asyncio.wait_for(cancel_and_wait(task, recancel_s=0.05), BOUND_S)
    assert task.cancelled()
    assert swallowed == 1
    assert iterations >= 2  # it did run on after the swallowed cancel


async def test_cancel_and_wait_returns_for_a_finished_or_failed_task_and_none() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_and_wait(failed)
    assert isinstance(failed.exception(), RuntimeError)
    await cancel_and_wait(None)


class SwallowingLeases(Leases):
    """The real lease bucket, with each refresh swallowing one cancel the way wait_for does on 3.11."""

    def __init__(self, js: JetStreamContext, bucket: str) -> None:
        super().__init__(js, bucket, timeout=BOUND_S)
        self.refreshing = asyncio.Event()
        self.swallowed = 0
        self.refreshes = 0

    async def refresh(self, lease: Lease, ttl_s: float | None = None) -> Lease:
        self.refreshing.set()
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            self.swallowed += 1
        fresh = await super().refresh(lease, ttl_s)
        self.refreshes += 1
        return fresh


@pytest.mark.integration
async def test_a_lease_keeper_stops_even_when_a_refresh_swallows_the_cancel(
    js: JetStreamContext, provisioned: Settings
) -> None:
    leases = SwallowingLeases(js, provisioned.kv_leases)
    session_id = new_session_id("keeper")
    lease = await leases.acquire(session_id, f"{socket.gethostname()}:{os.getpid()}", 1.0)
    keeper = LeaseKeeper(leases, lease, 0.01)
    await asyncio.wait_for(leases.refreshing.wait(), BOUND_S)

    await asyncio.wait_for(keeper.stop(), BOUND_S)

    assert leases.swallowed == 1
    refreshes = leases.refreshes
    await asyncio.sleep(0.1)
    assert leases.refreshes == refreshes, "the keeper refreshed after it was stopped"
    # The refresh that swallowed the cancel landed: the keeper holds its newer revision and can release it.
    await asyncio.wait_for(keeper.release(), BOUND_S)
    assert await leases.current(session_id) is None


@pytest.mark.integration
async def test_a_writer_closes_and_abandons_within_bounds_while_its_lease_refreshes_constantly(
    provisioned: Settings,
) -> None:
    assert provisioned.nats_url is not None
    settings = Settings(_env_file=None, nats_url=provisioned.nats_url, lease_ttl_s=1.0, lease_refresh_s=0.001)
    log = await SessionLog.connect(settings)
    try:
        for i in range(30):  # each stop races a refresh reply at some point of its cycle
            writer = await log.create(new_session_id("race"))
            await writer.emit("turn/start", {"turn": 1})
            await asyncio.sleep(0.002 * (i % 5))
            stop = writer.close() if i % 2 else writer.abandon()
            await asyncio.wait_for(stop, BOUND_S)
            if i % 2:
                assert await log.leases.current(writer.session_id) is None, "close left the lease held"
    finally:
        await log.close()
