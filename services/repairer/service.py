"""The repairer projection, its watch loop and its micro endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar, Final

import msgspec

from sessionlog import contracts
from sessionlog.contracts import CloseReply, SessionRequest
from sessionlog.errors import LeaseHeld, LeaseLost, SessionLogError, SessionNotFound
from sessionlog.ids import check_session_id
from sessionlog.leases import Leases
from sessionlog.log import SessionLog
from sessionlog.record import Record
from sessionlog.runner import Projection, ProjectionRunner, SessionLogState
from sessionlog.services import ProjectionService
from sessionlog.tasks import cancel_and_wait

SERVICE: Final = contracts.REPAIR.name
RETRY_FIRST_S: Final = 1.0  # a session whose repair failed is tried again after this, doubling up to RETRY_MAX_S
RETRY_MAX_S: Final = 300.0

log = logging.getLogger("sessionlog.repairer")


class Repairer(Projection[SessionLogState]):
    name: ClassVar[str] = "repairer"

    def __init__(self) -> None:
        self.open_turns: dict[str, int] = {}  # session -> open turn

    def new_state(self, session_id: str) -> SessionLogState:
        return SessionLogState(session_id)

    def on_applied(self, state: SessionLogState, record: Record) -> None:
        if state.session.open_turn is None:
            self.open_turns.pop(state.session_id, None)
        else:
            self.open_turns[state.session_id] = state.session.open_turn


class RepairerService(ProjectionService[SessionLogState]):
    def __init__(self, log_: SessionLog, **runner_options: Any) -> None:
        self.projection = Repairer()
        super().__init__(log_, ProjectionRunner(log_, self.projection, **runner_options))
        self.leases = Leases(log_.js, self.settings.kv_leases, timeout=self.settings.request_timeout_s)
        self.repaired: list[tuple[str, int]] = []  # (session, closers) this replica landed
        self._free_since: dict[str, float] = {}
        # Sessions whose last repair failed: (error, attempts, monotonic time of the next try). A corrupt log
        # fails the same way every time; trying it every period would take its lease over and over for nothing.
        self.unrepairable: dict[str, tuple[str, int, float]] = {}
        self.corrupt: dict[str, str] = {}  # sessions the start-up listing could not read, with their error
        self._watch: asyncio.Task[None] | None = None
        self.learned = False  # the first listing of every session's open turn is done (until then: not ready)

    async def _start(self) -> None:
        # The listing of every session's last record (`_learn_open_turns`) grows with the fleet: it is the watch
        # loop's first step, so the endpoints, the health report and the partitions' claims do not wait for it
        # (a replica added to a fleet of 10,000 sessions at a load of 17 was invisible for more than 20 s).
        await super()._start()
        await self._serve_endpoints(contracts.REPAIR, {contracts.CLOSE: self._close})
        self._watch = asyncio.create_task(self._watch_loop(), name="repairer-watch")

    async def _learn_open_turns(self) -> None:
        """Every session whose last record says a turn is open: turns that no record of ours will ever show (a
        writer that died before this replica started, or before it took over the session's partition)."""
        for info in await self.log.sessions():
            if info.error is not None:
                if info.id not in self.corrupt:
                    log.warning("session %s does not read, skipped: %s", info.id, info.error)
                self.corrupt[info.id] = info.error
                continue
            self.corrupt.pop(info.id, None)
            if info.open_turn:
                self.projection.open_turns.setdefault(info.id, info.open_turn)

    async def stop(self) -> None:
        await cancel_and_wait(self._watch)
        await super().stop()

    async def abort(self) -> None:
        await cancel_and_wait(self._watch)
        self._watch = None
        await super().abort()

    def health(self) -> dict[str, Any]:
        health = super().health()
        now = time.monotonic()
        health["unrepairable"] = {
            sid: {"error": error, "attempts": attempts, "retry_in_s": round(max(0.0, at - now), 1)}
            for sid, (error, attempts, at) in sorted(self.unrepairable.items())
        }
        health["corrupt"] = dict(sorted(self.corrupt.items()))
        health["open_turns_learned"] = self.learned
        health["ready"] = health.get("ready", True) and self.learned
        return health

    def _failed(self, session_id: str, err: Exception) -> None:
        """Back off on a session whose repair failed: the next try waits twice as long as the last."""
        _, attempts, _ = self.unrepairable.get(session_id, ("", 0, 0.0))
        attempts += 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (attempts - 1))
        error = f"{err.code}: {err.message}" if isinstance(err, SessionLogError) else f"{type(err).__name__}: {err}"
        self.unrepairable[session_id] = (error, attempts, time.monotonic() + delay)
        log.warning("repair of %s failed (attempt %d, next in %.0fs): %s", session_id, attempts, delay, error)

    async def _close(self, request: SessionRequest) -> CloseReply:
        closers = await self.close(request.session)
        return CloseReply(request.session, [msgspec.Raw(c) for c in closers])

    async def close(self, session_id: str) -> tuple[bytes, ...]:
        """Close the session's open turn now; refused (`LEASE_HELD`) while a live writer holds it."""
        check_session_id(session_id)
        if await self.log.header(session_id) is None:
            raise SessionNotFound(f"session {session_id} not found")
        lease = await self.leases.acquire(session_id, f"repairer:{self.runner.replica_id}", self.settings.lease_ttl_s)
        try:
            closers = await self.log.close_turn(session_id)
            self.projection.open_turns.pop(session_id, None)
            if closers:
                self.repaired.append((session_id, len(closers)))
                log.info("repaired session %s: %d closers", session_id, len(closers))
            return closers
        finally:
            with contextlib.suppress(LeaseLost, Exception):
                await self.leases.release(lease)

    async def _watch_loop(self) -> None:
        grace = self.settings.repair_grace_s
        period = max(0.1, min(grace, self.settings.lease_ttl_s) / 2)
        owned: list[int] | None = None  # the partitions whose open turns were learned (None: not yet)
        warned = False
        while True:
            if owned != self.runner.owned:  # at start, and when partitions moved to us: learn their open turns
                target = self.runner.owned
                try:
                    await self._learn_open_turns()
                except Exception as err:  # the log did not answer: the next round lists again
                    if not warned:
                        log.warning("repairer: listing the sessions failed, trying again: %s", err)
                        warned = True
                else:
                    owned = target
                    self.learned = True
            await asyncio.sleep(period)
            now = time.monotonic()
            for session_id in list(self.projection.open_turns):
                if not self.runner.owns(session_id):
                    continue
                retry = self.unrepairable.get(session_id)
                if retry is not None and now < retry[2]:
                    continue
                try:
                    held = await self.leases.current(session_id)
                except Exception as err:  # the next round looks again
                    log.warning("lease lookup for %s failed: %s", session_id, err)
                    continue
                if held is not None:
                    self._free_since.pop(session_id, None)
                    continue
                since = self._free_since.setdefault(session_id, now)
                if now - since < grace:
                    continue
                self._free_since.pop(session_id, None)
                try:
                    await self.close(session_id)
                except LeaseHeld:
                    continue  # a writer (or another repairer) took it meanwhile
                except Exception as err:
                    self._failed(session_id, err)
                else:
                    self.unrepairable.pop(session_id, None)
