"""The session cache of the projection runtime: per-session states, loaded on demand, bounded, and the one way to
ask for a session as of a seq (`session_at`).

- a `SessionState` is a projection's state for one session, a pure function of the session's records, which it
  gets in order, once each: it remembers the stream seq of the last record it applied and anything at or below it
  is skipped, so a redelivery or an overlap with a load is never applied twice;
- a session this replica owns (its partition is consumed here) is fed by the consumer; any other is a *view*: read
  from the stream, kept in the same cache, and caught up from the stream (the records after its last one, one
  round trip when nothing is new) each time it is asked for;
- `session_at(session_id, min_seq, timeout)`: the state once it holds at least session seq `min_seq` (the latest
  when None). One waiting rule: check, then wait for the consumer to apply the seq or for a delay that starts
  at `WAIT_FIRST_S` and doubles up to `WAIT_MAX_S`, and check again (a view catching up from the stream), until
  `timeout`; `NotReached` then;
- states are bounded by count (least recently used evicted first) and by idleness; a record that does not continue
  its session's state triggers a reload of the session, never a guess; loads of one session are shared;
- a record the session refuses, or whose applying raises anything at all, poisons its session: it is handed to
  `quarantine` (the runtime lists it) and the session reads `CORRUPT_LOG` until it is purged. Without a
  `quarantine` (a plain reader such as the gateway's) the error is raised to the caller instead.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, ClassVar, Final, Generic, TypeVar

from .errors import CorruptLog, LogUnavailable, SessionLogError
from .events import Event
from .log import SessionLog
from .lru import LRU
from .metrics import APPLIED
from .quarantine import Quarantined
from .record import Record
from .session import Session

log = logging.getLogger("sessionlog.sessions")

WAIT_FIRST_S: Final = 0.005  # a wait checks again after this, doubling up to WAIT_MAX_S
WAIT_MAX_S: Final = 0.1
LOAD_CONCURRENCY: Final = 16  # sessions of one burst loaded from the stream at the same time


class SessionState(ABC):
    """A projection's state for one session; `apply` gets the session's records in order, once each."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.last_stream_seq = 0  # stream seq of the last record applied
        self.next_seq = 0  # the session seq the next record must start at
        self.owned = False  # fed by this replica's consumer (else a view read from the stream)

    @abstractmethod
    def apply(self, record: Record) -> None:
        """Apply one record; raise a SessionLogError to have it quarantined."""


class SessionLogState(SessionState):
    """The validated log of a session (`session`); a subclass adds what it keeps per event in `took`."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session = Session()

    def apply(self, record: Record) -> None:
        append = self.session.append
        for raw in record.events:
            self.took(append(raw))

    def took(self, event: Event) -> None:
        """Called with each event once the session has taken it."""


S = TypeVar("S", bound=SessionState)


class Projection(ABC, Generic[S]):
    """What a service keeps: a state per session, plus hooks for the service."""

    name: ClassVar[str]

    @abstractmethod
    def new_state(self, session_id: str) -> S: ...

    def on_applied(self, state: S, record: Record) -> None:
        """Called after a record was applied (live, while loading, or to a view; `state.owned` tells which)."""

    def on_forget(self, session_id: str) -> None:
        """Called once when a session's state is dropped (eviction, lost partition, poison, purge)."""


class NotReached(TimeoutError):
    """`session_at` gave up: the session did not reach `min_seq` within the timeout (`have`: its last seq)."""

    def __init__(self, session_id: str, min_seq: int, have: int, waited: float) -> None:
        super().__init__(f"session {session_id}: seq {min_seq} not applied within {waited}s (have {have})")
        self.session_id, self.min_seq, self.have, self.waited = session_id, min_seq, have, waited


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


Waiter = tuple[int, int, asyncio.Future[None]]


class SessionCache(Generic[S]):
    """States of sessions, from memory when fed here, else from the stream; see the module docstring."""

    def __init__(
        self,
        log_: SessionLog,
        projection: Projection[S],
        *,
        max_sessions: int,
        owns: Callable[[str], bool] = lambda _: False,
        quarantine: Callable[[Quarantined], None] | None = None,
    ) -> None:
        self.log = log_
        self.projection = projection
        self.owns = owns
        self._quarantine = quarantine
        self.states: LRU[str, S] = LRU(max_sessions, on_evict=lambda sid, _: projection.on_forget(sid))
        self.poisoned: dict[str, Quarantined] = {}
        self._loading: dict[str, asyncio.Task[S | None]] = {}
        # Per session, a heap of (seq, tiebreak, future): applying a record pops only the waiters it satisfies.
        self._waiters: dict[str, list[Waiter]] = {}
        self._tiebreak = itertools.count()
        self._applied_events = APPLIED.labels(projection.name)

    # ---------------------------------------------------------------------------------- asking

    async def session_at(self, session_id: str, min_seq: int | None = None, timeout: float = 0.0) -> S | None:
        """The session's state once it holds session seq `min_seq` (the latest when None; None when the session
        has no records); `NotReached` after `timeout`, `CorruptLog` for a quarantined session."""
        deadline = time.monotonic() + timeout
        delay = WAIT_FIRST_S
        loop = asyncio.get_running_loop()
        while True:
            state = await self._current(session_id)
            if min_seq is None or (state is not None and state.next_seq > min_seq):
                return state
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NotReached(session_id, min_seq, -1 if state is None else state.next_seq - 1, timeout)
            future: asyncio.Future[None] = loop.create_future()
            entry = (min_seq, next(self._tiebreak), future)
            heapq.heappush(self._waiters.setdefault(session_id, []), entry)
            timer = loop.call_later(min(remaining, delay), _settle, future)
            try:
                await future
            finally:
                timer.cancel()
                self._drop_waiter(session_id, entry)
            delay = min(delay * 2, WAIT_MAX_S)

    async def refresh(self, session_id: str) -> S | None:
        """The session caught up by a read that starts now: one already in flight, which may have begun before
        something the caller knows of, is waited for first and not taken as the answer."""
        task = self._loading.get(session_id)
        if task is not None:
            await asyncio.wait([task])
            if self._loading.get(session_id) is task:  # its own clean-up has not run yet: not a read to share
                del self._loading[session_id]
        return await self._current(session_id)

    def has_waiters(self, session_id: str) -> bool:
        return session_id in self._waiters

    async def _current(self, session_id: str) -> S | None:
        if session_id in self.poisoned:
            raise CorruptLog(f"session {session_id} is quarantined: {self.poisoned[session_id].reason}")
        state = self.states.get(session_id)
        if state is not None and state.owned != self.owns(session_id):
            self.forget(session_id)  # a partition claimed or lost since: the state is fed here no more, or now
            state = None
        if state is not None and state.owned:
            self.states.touch(session_id)
            return state
        state = await self._shared(session_id, self._catch_up if state is not None else self._load_now)
        if state is None and session_id in self.poisoned:  # the read met a record it could not apply
            raise CorruptLog(f"session {session_id} is quarantined: {self.poisoned[session_id].reason}")
        return state

    # ---------------------------------------------------------------------------------- loading

    async def load(self, session_id: str) -> S | None:
        """The session read from the stream (shared with a read already in flight)."""
        return await self._shared(session_id, self._load_now)

    async def prefetch(self, session_ids: Iterable[str]) -> None:
        """Load the sessions not held, `LOAD_CONCURRENCY` at a time. Best effort: whatever fails here is met again
        (and handled) when its record is applied."""
        wanted = [s for s in dict.fromkeys(session_ids) if s not in self.states and s not in self.poisoned]
        if len(wanted) < 2:
            return
        gate = asyncio.Semaphore(LOAD_CONCURRENCY)

        async def one(session_id: str) -> None:
            async with gate:
                await self.load(session_id)

        started = time.monotonic()
        results = await asyncio.gather(*(one(s) for s in wanted[: self.states.max_size]), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning(
                "%s: %d of %d sessions of a burst did not load in %.1fs (they load again as their records apply): %s",
                self.projection.name, len(failed), len(results), time.monotonic() - started, reason(failed[0]),
            )  # fmt: skip

    async def _shared(self, session_id: str, read: Callable[[str], Coroutine[Any, Any, S | None]]) -> S | None:
        task = self._loading.get(session_id)
        if task is None:
            task = asyncio.create_task(read(session_id))
            self._loading[session_id] = task
            task.add_done_callback(lambda _: self._loading.pop(session_id, None))
        return await asyncio.shield(task)

    async def read(self, session_id: str) -> S:
        """A state of the caller's own: read from the stream now, not kept, no hooks; a refusal is raised."""
        state = self.projection.new_state(session_id)
        for record in await self.log.reader.records(session_id):
            state.apply(record)
            state.last_stream_seq, state.next_seq = record.stream_seq, record.next_seq
        return state

    async def _load_now(self, session_id: str) -> S | None:
        records = await self.log.reader.records(session_id)
        if not records:
            return None
        state = self.projection.new_state(session_id)
        state.owned = self.owns(session_id)
        for record in records:
            if not self._apply_to(state, record):
                return None
        existing = self.states.get(session_id)
        if existing is not None and existing.last_stream_seq >= state.last_stream_seq:
            return existing  # a consumer got further meanwhile
        self.states.put(session_id, state)
        self._resolve(state)
        return state

    async def _catch_up(self, session_id: str) -> S | None:
        """A view: the records after the last one it applied; a reload when the log no longer continues it."""
        state = self.states.get(session_id)
        if state is None or state.owned:
            return await self._load_now(session_id)
        records = await self.log.reader.records(session_id, from_stream_seq=state.last_stream_seq + 1)
        if records and records[0].first_seq != state.next_seq:
            log.warning("session %s: the log does not continue the one held; reloading", session_id)
            self.forget(session_id)
            return await self._load_now(session_id)
        for record in records:
            if not self._apply_to(state, record):
                return None
        self.states.touch(session_id)
        self._resolve(state)
        return state

    # ---------------------------------------------------------------------------------- applying

    def _apply_to(self, state: S, record: Record) -> bool:
        """Apply one record to a state; quarantine and poison the session when it is refused, or when applying it
        raises anything at all (applying is pure: the same record would fail the same way on every replay)."""
        try:
            state.apply(record)
            state.last_stream_seq = record.stream_seq
            state.next_seq = record.next_seq
            self._applied_events.inc(len(record.events))
            self.projection.on_applied(state, record)
        except Exception as err:
            if self._quarantine is None:
                self.forget(state.session_id)  # never keep a half-applied record
                raise
            self.poison(record.stream_seq, state.session_id, reason(err))
            return False
        return True

    def apply_live(self, record: Record) -> bool:
        """Apply a delivered record without I/O when the session allows it; False when it must be loaded first."""
        session_id = record.session_id
        if session_id in self.poisoned:
            since = self.poisoned[session_id].stream_seq
            self.poison(record.stream_seq, session_id, f"session quarantined since stream seq {since}")
            return True
        state = self.states.get(session_id)
        if state is not None and not state.owned:
            self.forget(session_id)  # a view read before the partition was claimed: load it as fed
            return False
        if state is not None:
            if record.stream_seq <= state.last_stream_seq:
                return True  # already applied (a redelivery, or the load that got here first)
            if record.first_seq != state.next_seq:
                return False
            if self._apply_to(state, record):
                self.states.touch(session_id)
                self._resolve(state)
            return True
        if record.first_seq == 0 and session_id not in self._loading:
            state = self.projection.new_state(session_id)
            state.owned = True
            if self._apply_to(state, record):
                self.states.put(session_id, state)
                self._resolve(state)
            return True
        return False

    async def apply_loading(self, record: Record) -> None:
        """A delivered record `apply_live` could not apply: its session is (re)loaded from the stream first."""
        session_id = record.session_id
        # No state, or one that does not continue into this record: rebuild it from the stream, which holds this
        # record too. A load already in flight may have read the stream before this record landed, so after it
        # the record is applied (or the session reloaded) if the state still does not cover it.
        self.forget(session_id)
        try:
            state = await self.load(session_id)
            if state is not None and state.last_stream_seq < record.stream_seq:
                if record.first_seq == state.next_seq:
                    if self._apply_to(state, record):
                        self._resolve(state)
                else:
                    self.forget(session_id)
                    await self.load(session_id)
        except LogUnavailable:
            raise  # transient: the partition stops here and consumes this record again once the log answers
        except Exception as err:
            self.poison(record.stream_seq, session_id, f"reloading the session failed: {reason(err)}")

    def _resolve(self, state: S) -> None:
        waiters = self._waiters.get(state.session_id)
        if not waiters:
            return
        applied = state.next_seq
        while waiters and waiters[0][0] < applied:
            _settle(heapq.heappop(waiters)[2])
        if not waiters:
            del self._waiters[state.session_id]

    def _drop_waiter(self, session_id: str, entry: Waiter) -> None:
        waiters = self._waiters.get(session_id)
        if waiters is None or entry not in waiters:
            return  # resolved: `_resolve` has popped it already
        waiters.remove(entry)
        heapq.heapify(waiters)
        if not waiters:
            del self._waiters[session_id]

    # ---------------------------------------------------------------------------------- forgetting

    def poison(self, stream_seq: int, session_id: str, why: str) -> None:
        entry = Quarantined(stream_seq=stream_seq, session_id=session_id, reason=why, projection=self.projection.name)
        self.poisoned.setdefault(session_id, entry)
        self.forget(session_id)
        if self._quarantine is not None:
            self._quarantine(entry)

    def forget(self, session_id: str) -> None:
        """Drop the session's state (the projection hears of it once, when there was one)."""
        if self.states.pop(session_id) is not None:
            self.projection.on_forget(session_id)

    def purge(self, session_id: str) -> None:
        """An admin erased the session: drop everything about it; the projection hears of it exactly once."""
        self.states.pop(session_id)
        self.poisoned.pop(session_id, None)
        self.projection.on_forget(session_id)

    def forget_where(self, belongs: Callable[[str], bool]) -> None:
        for session_id in [s for s in self.states if belongs(s)]:
            self.forget(session_id)

    async def evict_idle(self, idle_s: float) -> None:
        """Forever: drop states not asked for nor applied to for `idle_s` (a session someone waits on stays)."""
        while True:
            await asyncio.sleep(max(0.05, idle_s / 4))
            for session_id in self.states.idle_since(time.monotonic() - idle_s):
                if session_id not in self._waiters:
                    self.forget(session_id)


def reason(err: BaseException) -> str:
    """A quarantine reason: the code and message of a typed refusal, else the exception's type and text."""
    if isinstance(err, SessionLogError):
        return f"{err.code}: {err.message}"
    return f"{type(err).__name__}: {err}"
