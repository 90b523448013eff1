"""The writer of one session (`SessionWriter`): validates, queues, batches and publishes, holding the lease.

A writer validates every event with the session library before it is queued, so a bad event never reaches
the stream. Queued events are published as records (one JetStream message = a contiguous run of events) when
the write-behind window closes, when the batch reaches its size bound, or on `flush()`, which returns only
when JetStream has acknowledged everything queued: it is the durability checkpoint. Publishing, the size rule
and the batching rule are the record store's (`store.py`); the writer owns the queue, the window, what is in
doubt after an interrupted publish, and the lease (`leases.LeaseKeeper`): a writer whose lease is lost or whose
record is refused is fenced and writes nothing more.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from msgspec import UNSET

from .errors import Conflict, LeaseLost, LogUnavailable, SessionLogError
from .events import Event, Message, Source, TextBlock, encode_new_event
from .leases import LeaseKeeper
from .session import Session
from .store import WrongLastRecord
from .surface import ReplaceOp
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from .log import SessionLog

log = logging.getLogger("sessionlog.writer")


def now_ms() -> int:
    return int(time.time() * 1000)


class SessionWriter:
    """The one writer of a session: validates, queues, batches, publishes, and holds the lease."""

    def __init__(
        self, log: SessionLog, session_id: str, session: Session, *, last_stream_seq: int, lease: LeaseKeeper
    ) -> None:
        self.log = log
        self.session_id = session_id
        self._session = session
        self._lease = lease
        self._store = log.store
        self._epoch = lease.epoch
        self._last_stream_seq = last_stream_seq
        self._durable = len(session)  # number of events acknowledged
        self._pending: list[bytes] = []
        self._pending_turns: list[int] = []  # the open turn after each pending event (0: none)
        self._pending_first = len(session)
        self._waiters: list[tuple[int, asyncio.Future[int]]] = []
        self._wake = asyncio.Event()
        self._failed: SessionLogError | None = None
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        settings = log.settings
        self._window = settings.write_window_ms / 1000
        self._max_events = settings.write_max_events
        self._max_bytes = self._store.max_record_bytes
        self._pending_bytes = 2
        self._draining = False  # a publish loop (`_drain`) is running, in the background task or in a flush
        # The size of a batch whose publish was interrupted (0: none). It may have landed under its message id,
        # so it is published again exactly as it was sent, before anything queued after it.
        self._in_doubt = 0
        self._task = asyncio.create_task(self._run(), name=f"sessionlog-writer-{session_id}")
        lease.on_lost(self._lease_lost)

    # ---------------------------------------------------------------------------------- state

    @property
    def session(self) -> Session:
        """The writer's validated view of the log (durable and queued events)."""
        return self._session

    @property
    def durable_seq(self) -> int:
        """The last seq JetStream has acknowledged, -1 when none."""
        return self._durable - 1

    @property
    def next_seq(self) -> int:
        return len(self._session)

    @property
    def epoch(self) -> int:
        return self._lease.epoch

    @property
    def last_stream_seq(self) -> int:
        return self._last_stream_seq

    @property
    def window_ms(self) -> float:
        """The write-behind window: events queued within it (and not flushed) publish as one record."""
        return self._window * 1000

    @window_ms.setter
    def window_ms(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"a write window is not negative, got {value}")
        self._window = value / 1000

    @property
    def lease(self) -> LeaseKeeper:
        """The lease this writer holds (tests stop its refreshes to play a stalled process)."""
        return self._lease

    @property
    def failed(self) -> SessionLogError | None:
        """Why the writer is fenced (it writes nothing more), or None while it may write."""
        return self._failed

    # ---------------------------------------------------------------------------------- appending

    async def append(self, raw: bytes) -> Event:
        """Validate one event and queue it; raises the SPEC error and queues nothing when it is refused."""
        self._raise_if_failed()
        self._store.check_size(raw, len(self._session))
        event = self._session.append(raw)
        self._pending.append(raw)
        self._pending_turns.append(self._session.open_turn or 0)
        self._pending_bytes += len(raw) + 1
        if len(self._pending) >= self._max_events or self._pending_bytes >= self._max_bytes:
            self._wake.set()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._window, self._wake.set)
        if len(self._pending) > 8 * self._max_events:  # back-pressure: do not let the queue grow unbounded
            await self.flush()
        return event

    async def emit(
        self,
        event_type: str,
        data: Any,
        *,
        surface_op: Any = UNSET,
        source_event_seqs: Any = UNSET,
        time_ms: int | None = None,
    ) -> Event:
        """Encode a new event (seq and time filled in) and append it."""
        raw = encode_new_event(
            event_type,
            data,
            seq=self.next_seq if self._session.has_seqs else None,
            time=time_ms if time_ms is not None else now_ms(),
            surface_op=surface_op,
            source_event_seqs=source_event_seqs,
        )
        return await self.append(raw)

    async def compact(self, start: int, end: int, summary: str | Message, *, message_id: str | None = None) -> Event:
        """Replace surface nodes start..end with a summary user message whose provenance names every shadowed
        node; refused by the SPEC rules (including `REPLACE_SPLITS_TOOL_PAIR`) before anything is sent."""
        plan = self._session.surface.plan_replace(self.next_seq, ReplaceOp(start=start, end=end))
        if isinstance(summary, str):
            summary = Message(
                id=message_id or f"compaction-{uuid.uuid4()}",
                role="user",
                source=Source(kind="plugin", plugin="compact"),
                content=(TextBlock(summary),),
            )
        return await self.emit(
            "user/message",
            summary,
            surface_op={"op": "replace", "start": start, "end": end},
            source_event_seqs=sorted(plan.shadowed),
        )

    async def flush(self) -> int:
        """Wait until every queued event is acknowledged; return the last durable seq."""
        self._raise_if_failed()
        target = len(self._session)
        if self._durable >= target:
            return self._durable - 1
        if not self._draining:
            # Nothing is being published: publish from here, saving two hops through the background task (the
            # per-flush latency is what an agent pays before every provider request and tool body).
            await self._drain()
            self._raise_if_failed()
            if self._durable >= target:
                return self._durable - 1
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        self._wake.set()
        return await future

    async def close(self, *, park: bool = False) -> None:
        """Flush what is queued, stop, and release the lease. `park`: park it instead (`leases`), for a session
        whose open turn waits for its client (the repairer then leaves the turn open)."""
        if self._closed:
            return
        try:
            if self._failed is None:
                await self.flush()
        finally:
            self._closed = True
            await cancel_and_wait(self._task)
            await self._lease.release(park=park)

    async def abandon(self) -> None:
        """Stop without flushing or releasing the lease (a crash, as far as the log can tell)."""
        self._closed = True
        await cancel_and_wait(self._task)
        await self._lease.stop()

    async def discard(self, *, park: bool = False) -> None:
        """Stop without publishing what is queued, and release the lease (`park`: park it, as `close`): for events
        that must not be written (a request refused once its first events were queued). What was flushed before
        stays; a batch already sent lands or not, and a writer that takes the session next is fenced by the stream
        if it lands after its load (every record names the seq it follows). Never raises: a lease that cannot be
        released expires."""
        self._closed = True
        await cancel_and_wait(self._task)
        try:
            await self._lease.release(park=park)
        except Exception as err:
            log.warning("writer of %s: releasing the lease after discarding its queue: %s", self.session_id, err)

    async def __aenter__(self) -> SessionWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------------------------------- internals

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise Conflict(f"writer of session {self.session_id} is closed")

    def _lease_lost(self, reason: str) -> None:
        self._fence(self._lease_lost_error(reason))

    def _lease_lost_error(self, reason: str, *, seq: int | None = None) -> LeaseLost:
        return LeaseLost(
            f"writer of session {self.session_id} lost its lease ({reason}); it writes nothing more and nothing "
            f"after seq {self._durable - 1} is reported written: open or resume the session again",
            seq=seq,
        )

    def _fence(self, error: SessionLogError) -> None:
        if self._failed is None:
            self._failed = error
            log.warning("writer fenced: %s", error)
            # A fenced writer writes nothing more: stop refreshing, so the repairer can close its turn.
            asyncio.get_running_loop().create_task(self._lease.stop())
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(error)
        self._waiters.clear()
        self._wake.set()

    async def _run(self) -> None:
        while not self._closed:  # a swallowed cancel (see tasks.py) must not keep a closed writer's loop alive
            await self._wake.wait()
            self._wake.clear()
            if self._failed is not None:
                return
            if not self._draining:  # a flush publishing in its own task takes everything queued meanwhile too
                await self._drain()

    async def _drain(self) -> None:
        """Publish queued events as records until none is left (or the writer is fenced)."""
        self._draining = True
        try:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            while self._pending and self._failed is None:
                count, size = self._store.cut(self._pending, exactly=self._in_doubt)
                batch = self._pending[:count]
                first = self._pending_first
                try:
                    if self._lease.overdue:
                        await self._confirm_lease(first)
                    stream_seq = await self._store.publish(
                        self.session_id,
                        batch,
                        first,
                        self._last_stream_seq,
                        self._pending_turns[count - 1],
                        epoch=self._epoch,
                        in_doubt=self._in_doubt > 0,
                    )
                except asyncio.CancelledError:
                    # The record may have landed; whoever publishes next settles that by its digest (so it must send
                    # this very batch again), and the background task carries on for the other flushes.
                    self._in_doubt = len(batch)
                    self._wake.set()
                    raise
                except WrongLastRecord as err:
                    # Someone else's record follows ours: a newer tenure's fence or closers when our lease is gone
                    # (LEASE_LOST), a competing writer when it is still ours (CONFLICT).
                    reason = await self._lease.lost()
                    self._fence(err if reason is None else self._lease_lost_error(reason, seq=first))
                    return
                except SessionLogError as err:
                    self._fence(err)
                    return
                except Exception as err:  # a client-side failure (buffer full, connection closed): not written
                    self._fence(
                        LogUnavailable(
                            f"session {self.session_id}: publishing seqs from {first} failed ({type(err).__name__}: "
                            f"{err}); nothing after seq {first - 1} is reported written",
                            seq=first,
                        )
                    )
                    return
                self._in_doubt = 0
                del self._pending[: len(batch)]
                del self._pending_turns[: len(batch)]
                self._pending_bytes -= size
                self._pending_first += len(batch)
                self._last_stream_seq = stream_seq
                self._durable = self._pending_first
                self._resolve()
        finally:
            self._draining = False

    async def _confirm_lease(self, first: int) -> None:
        """Before publishing on a lease that was not refreshed within its TTL (the loop was blocked, the process
        paused): refresh it now, so a lapsed lease is `LEASE_LOST` naming why and not a record written without
        it. A refresh without an answer lets the publish go on: the fence decides then (`SessionLog.open`)."""
        try:
            await self._lease.confirm()
        except LeaseLost as err:
            raise self._lease_lost_error(err.message, seq=first) from None
        except Exception as err:
            log.warning("lease of %s not confirmed before publishing: %s", self.session_id, err)

    def _resolve(self) -> None:
        keep: list[tuple[int, asyncio.Future[int]]] = []
        for target, future in self._waiters:
            if self._durable >= target:
                if not future.done():
                    future.set_result(self._durable - 1)
            else:
                keep.append((target, future))
        self._waiters = keep


__all__ = ["SessionWriter"]
