"""The context-deriver projection and its micro endpoints."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, ClassVar, Final

import msgspec

from sessionlog import contracts
from sessionlog.contracts import (
    DeriveReply,
    DeriveRequest,
    PlanReplaceReply,
    PlanReplaceRequest,
    StatsReply,
    StatsRequest,
)
from sessionlog.errors import EventTooLarge, InvalidBoundary, LogUnavailable, SessionLogError, SessionNotFound
from sessionlog.ids import check_session_id
from sessionlog.log import SessionLog
from sessionlog.runner import NotReached, Projection, ProjectionRunner, SessionLogState
from sessionlog.services import ProjectionService
from sessionlog.session import DerivedMessage, Session

SERVICE: Final = contracts.CONTEXT.name
PAGE_FRACTION: Final = 0.8  # of the server's max payload, leaving room for the envelope


class DeriverState(SessionLogState):
    """One session's validated log; the surface and derived messages live in its `Session`."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self._digest_key: tuple[int, int] | None = None
        self._digest: tuple[bytes, str] = (b"[]", hashlib.sha256(b"[]").hexdigest())

    def canonical(self) -> tuple[bytes, str]:
        """The canonical messages array and its SHA-256, cached until the session changes."""
        key = (len(self.session), self.session.generation)
        if key != self._digest_key:
            self._digest = canonical_messages(self.session)
            self._digest_key = key
        return self._digest


def canonical_messages(session: Session) -> tuple[bytes, str]:
    body = b"[" + b",".join(m.canonical for m in session.derive_messages()) + b"]"
    return body, hashlib.sha256(body).hexdigest()


class ContextDeriver(Projection[DeriverState]):
    name: ClassVar[str] = "context-deriver"

    def new_state(self, session_id: str) -> DeriverState:
        return DeriverState(session_id)


class ContextDeriverService(ProjectionService[DeriverState]):
    """The projection runner plus the micro endpoints."""

    def __init__(self, log: SessionLog, runner: ProjectionRunner[DeriverState] | None = None, **runner_options: Any):
        super().__init__(log, runner or ProjectionRunner(log, ContextDeriver(), **runner_options))

    async def _start(self) -> None:
        await super()._start()
        await self._serve_endpoints(
            contracts.CONTEXT,
            {contracts.DERIVE: self.derive, contracts.PLAN_REPLACE: self.plan_replace, contracts.STATS: self.stats},
            immediate={contracts.DERIVE: self._derive_is_immediate},
        )

    def _derive_is_immediate(self, request: DeriveRequest) -> bool:
        """A derive of the latest state of a session held here that has applied `min_seq` waits for nothing
        (no stream read, no wait), so it is answered without a task of its own."""
        if request.at_seq is not None:
            return False
        state = self.runner.states.get(request.session)
        if state is None or not self.runner.owns(state.session_id):
            return False
        return request.min_seq is None or state.next_seq > request.min_seq

    # ---------------------------------------------------------------------------------- sessions

    async def session(self, session_id: str, *, min_seq: int | None, timeout: float) -> Session:
        """The session as this replica can vouch for it, reflecting at least `min_seq` when given."""
        check_session_id(session_id)
        unknown = session_id not in self.runner.states and await self.log.header(session_id) is None
        if unknown and await self.log.reader.last_record(session_id) is None:  # every replica answers the same
            raise SessionNotFound(f"session {session_id} not found")
        try:
            state = await self.runner.session_at(session_id, min_seq, timeout)
        except NotReached as exc:
            raise LogUnavailable(str(exc)) from None
        if state is not None:
            return state.session
        if await self.log.header(session_id) is None:
            raise SessionNotFound(f"session {session_id} not found")
        return Session()  # a header and no events yet

    # ---------------------------------------------------------------------------------- endpoints

    async def derive(self, request: DeriveRequest) -> DeriveReply:
        session_id, at_seq, page = request.session, request.at_seq, request.page or 0
        timeout = (request.timeout_ms or int(self.log.settings.request_timeout_s * 1000)) / 1000
        targets = [s for s in (request.min_seq, at_seq) if s is not None]
        session = await self.session(session_id, min_seq=max(targets) if targets else None, timeout=timeout)
        if at_seq is not None:
            if at_seq >= len(session):
                raise InvalidBoundary(f"at_seq {at_seq} is past the end of session {session_id} ({len(session)})")
            session = session.prefix(at_seq)
            messages_body, digest = canonical_messages(session)
        else:
            state = self.runner.states.get(session_id)
            if state is not None and state.session is session:
                messages_body, digest = state.canonical()
            else:
                messages_body, digest = canonical_messages(session)
        header = session.fold_request_header()
        # A refusal names the seq it concerns (SPEC section 10): the header's here, each message's in `seqs`.
        reply = DeriveReply(
            session=session_id,
            seq=len(session) - 1,
            generation=session.generation,
            header=msgspec.Raw(msgspec.json.encode(header.to_builtins()) if header is not None else b"null"),
            sha256=digest,
            # The gateway's invariant needs an open step: [turn, step], or null between steps.
            open_step=(session.open_turn or 0, session.open_step.number) if session.open_step is not None else None,
            seqs=[],
            messages=msgspec.Raw(b"[]"),
            header_seq=header.seq if header is not None else None,
            header_reason=header.reason if header is not None else None,
        )
        limit = int(self.log.nc.max_payload * PAGE_FRACTION)
        derived = session.derive_messages()
        known = request.known_count
        increment = at_seq is None and page == 0 and request.known_generation == session.generation
        if increment and known is not None and known <= len(derived):
            # The caller holds the first `known_count` messages of this generation: a generation's messages only
            # grow, so those are this derivation's first ones too (`sha256`, of the whole list, lets it check).
            added = derived[known:]
            partial = msgspec.structs.replace(
                reply, messages_from=known, seqs=[m.seq for m in added], messages=_array(added)
            )
            if _size(partial) <= limit:
                return partial
            # too many to send at once: the whole list, paged
        whole = msgspec.structs.replace(reply, seqs=[m.seq for m in derived], messages=msgspec.Raw(messages_body))
        if page == 0 and _size(whole) <= limit:
            return whole
        head = _size(reply)  # every page carries the header and the envelope
        if head + 1024 > limit:
            raise EventTooLarge(
                f"session {session_id}: the folded header alone is {head} bytes, over a reply's {limit}"
            )
        # A message costs its bytes, a comma, and its seq in `seqs` (at most 20 digits and a comma).
        pages = _pages([m.canonical for m in derived], limit - head - 64, per_item=22)
        if page >= len(pages):
            raise InvalidBoundary(f"page {page} does not exist; the derivation has {len(pages)} pages")
        first = sum(len(p) for p in pages[:page])
        return msgspec.structs.replace(
            reply,
            next_page=page + 1 if page + 1 < len(pages) else None,
            seqs=[m.seq for m in derived[first : first + len(pages[page])]],
            messages=msgspec.Raw(b"[" + b",".join(pages[page]) + b"]"),
        )

    async def plan_replace(self, request: PlanReplaceRequest) -> PlanReplaceReply:
        seq = request.event.get("seq")
        # A dry run right after a flush must see that flush: wait for the seq before the event's own.
        min_seq = seq - 1 if type(seq) is int and seq > 0 else None
        session = await self.session(request.session, min_seq=min_seq, timeout=self.log.settings.request_timeout_s)
        try:
            _, plan = session.plan(msgspec.json.encode(request.event))
        except SessionLogError as err:
            return PlanReplaceReply(False, [], contracts.ErrorBody(err.code, err.message, err.seq))
        return PlanReplaceReply(True, list(plan.shadowed) if plan is not None else [])

    async def stats(self, request: StatsRequest) -> StatsReply:
        health = self.runner.health()
        return StatsReply(
            sessions=health["sessions"],
            memory_bytes=sum(sum(len(e.raw) for e in s.session) for s in self.runner.states.values()),
            lag_events=health["lag_events"],
            partitions=health["partitions"],
            quarantined=health["quarantined"],
            quarantine=health["quarantine"],
            stalled=health["stalled"],
            replica=health["replica"],
        )


def _array(messages: Sequence[DerivedMessage]) -> msgspec.Raw:
    return msgspec.Raw(b"[" + b",".join(m.canonical for m in messages) + b"]")


def _size(reply: DeriveReply) -> int:
    """The encoded reply's bytes, plus room for the micro envelope."""
    return len(msgspec.json.encode(reply)) + 64


def _pages(items: list[bytes], limit: int, *, per_item: int = 0) -> list[list[bytes]]:
    """`items` cut into pages of at most `limit` bytes, each item costing its length, a comma and `per_item`."""
    pages: list[list[bytes]] = [[]]
    size = 0
    for item in items:
        cost = len(item) + 1 + per_item
        if pages[-1] and size + cost > limit:
            pages.append([])
            size = 0
        pages[-1].append(item)
        size += cost
    return pages
