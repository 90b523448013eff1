"""`CheckpointedFeed`: one durable pull consumer followed from a checkpoint, supervised; what the projection
runtime runs per owned partition, and the token-auditor on the raw stream.

- it starts after the checkpoint (`<name>` in the checkpoints bucket), or at `start_at` when given, and hands each
  delivered message to `apply` in order, once: a redelivery at or below what it applied is skipped; the last
  message of a burst is acknowledged (ack-all) once the burst is applied; `prepare` sees each burst first;
- the applied stream seq is checkpointed about every `CHECKPOINT_EVERY_S` without holding up the messages behind
  it (one write in flight), and on a graceful stop;
- supervised: whatever ends the consumer (JetStream not answering, the consumer deleted, a bug) is logged and
  counted (`sessionlog_projection_consumer_restarts_total`) and it starts again from what is applied, after a
  backoff that doubles while it keeps failing, as long as `still_ours()` says the feed is still this replica's;
- `stalled` says why it is not being consumed right now (including after a reconnect, until its consumer has
  answered on the new connection); `ready` is set once it has caught up with the stream as it
  was when it started; `stop()` finishes the message in hand, `abort()` stops at once, as a dying process would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from .checkpoints import Checkpoints
from .errors import SessionLogError
from .metrics import CONSUMER_RESTARTS, LAG_EVENTS, LAG_SECONDS
from .pull import ConsumerGone, Delivery, PullFeed
from .tasks import cancel_and_wait

log = logging.getLogger("sessionlog.feed")

FETCH_BATCH: Final = 256  # at most this many messages requested and not yet delivered
CHECKPOINT_EVERY_S: Final = 1.0
PULL_EXPIRES_S: Final = 10.0  # a pull request's life; the feed sends the next before it ends
PULL_HEARTBEAT_S: Final = 1.0  # idle heartbeats; none for three of these and the feed pulls again
IDLE_WAKE_S: Final = 0.25  # an idle feed still wakes this often (lag metric, checkpoint, stop)
STOP_GRACE_S: Final = 5.0  # a graceful stop waits this long for the message in hand, then cancels
RETRY_FIRST_S: Final = 0.5  # a consumer that failed starts again after this, doubling up to RETRY_MAX_S
RETRY_MAX_S: Final = 10.0
SILENT_S: Final = 3 * PULL_HEARTBEAT_S + 1.0  # no delivery nor heartbeat for this long: the feed is stalled
SLOW_BURST_S: Final = 2.0  # a burst that takes this long to apply is logged (what it spent preparing, too)

Apply = Callable[[Delivery], Awaitable[None]]
Prepare = Callable[[list[Delivery]], Awaitable[None]]


async def _nothing(burst: list[Delivery]) -> None:
    return None


async def _always() -> bool:
    return True


class CheckpointedFeed:
    """One durable consumer on `filter_subject` of `stream`, applied by `apply`; see the module docstring."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        stream: str,
        filter_subject: str | None,
        durable: str,
        checkpoints: Checkpoints,
        checkpoint: str,
        apply: Apply,
        *,
        label: str,
        start_at: int | None = None,
        prepare: Prepare = _nothing,
        still_ours: Callable[[], Awaitable[bool]] = _always,
    ) -> None:
        self.nc = nc
        self.js = js
        self.stream = stream
        self.filter_subject = filter_subject
        self.durable = durable
        self.checkpoints = checkpoints
        self.checkpoint = checkpoint
        self.label = label
        self.start_at = start_at
        self._apply = apply
        self._prepare = prepare
        self._still_ours = still_ours
        self.applied = 0  # last stream seq applied and acknowledged
        self.checkpointed = 0
        self.last_time = 0.0  # stream time of the last applied message (epoch s)
        self.pending = 0
        self.ready = asyncio.Event()
        self.stopping = False  # a stop: finish the message in hand, acknowledge, return
        self.applying = False  # a burst is being applied (a graceful stop waits for the message in hand)
        self.stalled_reason: str | None = None  # why the feed is not being consumed right now (None: it is)
        self.task: asyncio.Task[None] | None = None
        self._saving: asyncio.Task[None] | None = None  # the checkpoint write in flight
        projection = checkpoints.projection
        self._lag_events = LAG_EVENTS.labels(projection, label)
        self._lag_seconds = LAG_SECONDS.labels(projection, label)
        self._restarts = CONSUMER_RESTARTS.labels(projection, label)

    def start(self) -> None:
        self.task = asyncio.create_task(self._consume(), name=f"{self.checkpoints.projection}-{self.label}")

    @property
    def stalled(self) -> str | None:
        if self.task is not None and self.task.done() and not self.stopping:
            return "its consumer task ended"
        return self.stalled_reason

    async def stop(self) -> None:
        """Graceful: the message in hand is finished and acknowledged, then the applied seq is checkpointed. A load
        that hangs is cancelled after a grace period (what it had not applied is after the checkpoint)."""
        self.stopping = True
        if self.task is not None:
            if self.applying:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(self.task), STOP_GRACE_S)
            await cancel_and_wait(self.task)  # nothing in hand (waiting for messages, or for JetStream): at once
        if self._saving is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._saving
        await self.save(force=True)

    async def abort(self) -> None:
        """Stop at once, as a process that dies: no checkpoint, nothing acknowledged beyond what was."""
        self.stopping = True
        for task in (self.task, self._saving):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def save(self, *, force: bool = False) -> None:
        """Checkpoint what is applied. What is written is what was applied when the write began: messages applied
        while it is in flight are covered by a later one."""
        if self.applied == 0 or (self.applied <= self.checkpointed and not force):
            return
        applied = self.applied
        if await self.checkpoints.write(self.checkpoint, applied):
            self.checkpointed = max(self.checkpointed, applied)

    def _save_soon(self) -> None:
        if self.applied > self.checkpointed and (self._saving is None or self._saving.done()):
            self._saving = asyncio.create_task(self.save())

    async def _consume(self) -> None:
        backoff = RETRY_FIRST_S
        started = False
        while not self.stopping and not self.nc.is_closed:
            applied_before = self.applied
            try:
                if not started:
                    start = (
                        self.start_at if self.start_at is not None else await self.checkpoints.read(self.checkpoint) + 1
                    )
                    self.applied = self.checkpointed = max(1, start) - 1
                    started = True
                await self._follow(self.applied + 1)
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.stalled_reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                self._restarts.inc()
                name = self.checkpoints.projection
                if isinstance(err, (nats.errors.Error, SessionLogError, ConsumerGone)):
                    log.warning("%s: %s: %s", name, self.label, self.stalled_reason)
                else:
                    log.exception("%s: %s: consumer failed", name, self.label)
                if not await self._still_ours():
                    log.warning("%s: %s: its lease is lost", name, self.label)
                    return  # the claims disown it
                if self.applied > applied_before:
                    backoff = RETRY_FIRST_S  # it got somewhere before failing: not a failure loop
                log.warning(
                    "%s: %s: consuming again from stream seq %d in %.1fs", name, self.label, self.applied + 1, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)

    async def _follow(self, start: int) -> None:
        # A replica that took the feed over recreates the same durable at its own start.
        with contextlib.suppress(NotFoundError, nats.errors.Error):
            await self.js.delete_consumer(self.stream, self.durable)
        config = api.ConsumerConfig(
            durable_name=self.durable,
            # Without a filter, created by name (`CONSUMER.CREATE.<stream>.<name>`), the form a role granted
            # "consumers of its own choosing on that stream" may use; a partition's keeps its durable form.
            name=None if self.filter_subject else self.durable,
            filter_subject=self.filter_subject,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
            ack_policy=api.AckPolicy.ALL,
            max_ack_pending=FETCH_BATCH * 4,  # back-pressure: the server holds the rest
            ack_wait=30,
            inactive_threshold=300,
        )
        info = await self.js.add_consumer(self.stream, config)
        self.stalled_reason = None
        self.pending = info.num_pending or 0
        if self.pending == 0:
            self.ready.set()
        feed = PullFeed(
            self.nc,
            self.stream,
            self.durable,
            batch=FETCH_BATCH,
            expires_s=PULL_EXPIRES_S,
            heartbeat_s=PULL_HEARTBEAT_S,
        )
        created = time.monotonic()
        await feed.start()
        last_checkpoint = time.monotonic()
        first = self.pending > 0  # the first delivery is awaited: how long it takes is worth a line when slow
        try:
            while not self.stopping:
                burst = await feed.take(IDLE_WAKE_S)
                if burst:
                    if first and (waited := time.monotonic() - created) >= SLOW_BURST_S:
                        log.warning("%s: %s: the first delivery came %.1fs after the consumer was made",
                                    self.checkpoints.projection, self.label, waited)  # fmt: skip
                    first = False
                    self.applying = True
                    try:
                        done = await self._apply_burst(burst)
                    finally:
                        self.applying = False
                    if done is not None:
                        await feed.ack(done)
                        self.pending = done.pending
                        if self.pending == 0:
                            self.ready.set()
                self._update_lag()
                silent = feed.silent_for()
                if silent > SILENT_S or not self.nc.is_connected:
                    self.stalled_reason = f"no delivery or heartbeat from its consumer for {silent:.0f}s"
                elif not feed.answered:
                    self.stalled_reason = "reconnected: its consumer has not answered on the new connection yet"
                elif self.stalled_reason is not None:
                    self.stalled_reason = None
                now = time.monotonic()
                if now - last_checkpoint >= CHECKPOINT_EVERY_S:
                    self._save_soon()
                    last_checkpoint = now
        finally:
            await feed.stop()

    async def _apply_burst(self, burst: list[Delivery]) -> Delivery | None:
        """Apply the messages of a burst in order; the last one handled (to acknowledge), None when none was."""
        started = time.monotonic()
        await self._prepare([item for item in burst if item.stream_seq > self.applied])
        prepared = time.monotonic()
        done: Delivery | None = None
        for item in burst:
            if self.stopping:
                break  # graceful stop: the message in hand is finished; the rest comes again after the checkpoint
            if item.stream_seq > self.applied:
                await self._apply(item)
                self.applied = item.stream_seq
                self.last_time = item.time_ns / 1e9
            done = item
        took = time.monotonic() - started
        if took >= SLOW_BURST_S:
            log.warning(
                "%s: %s: a burst of %d records took %.1fs (%.1fs preparing it)",
                self.checkpoints.projection, self.label, len(burst), took, prepared - started,
            )  # fmt: skip
        return done

    def _update_lag(self) -> None:
        self._lag_events.set(self.pending)
        lag_s = 0.0 if self.pending == 0 or not self.last_time else max(0.0, time.time() - self.last_time)
        self._lag_seconds.set(lag_s)
