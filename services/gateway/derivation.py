"""Where the gateway gets the dispatch-time durable derivation of a session: the context-deriver, or the stream.

`DerivationSource.derive(session_id, min_seq)` answers with the derived messages, the folded header and the open
step of the durable log once it holds at least seq `min_seq` (the last seq the caller says it flushed, inclusive).

- `StreamSource` reads the event stream itself, through the projection runtime's `SessionCache`: it keeps a live
  `Session` per recently used session and reads only the records after the last one it applied, so a long session
  is validated once, not once per request. The invariant is about the durable log at dispatch time, not about what
  the caller claims: a request that does not name the seq it flushed always reads the tail (one direct-get round
  trip when nothing is new). One that names it is answered without a read when the session is watched
  (`tails.TailWatch`) and known to hold that seq with nothing newer announced; announced records are read ahead
  in the background, so an agent's next request usually finds them held. It waits for `min_seq` by the cache's
  one rule (bounded by `wait_s`).
- `ContextDeriverClient` asks the context-deriver (`sessionlog.context.derive`, request and reply declared in
  `sessionlog.contracts`) and falls back to a `StreamSource` when no deriver answers in time.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, Protocol

import msgspec
from nats.aio.client import Client

from sessionlog.contracts import DERIVE, DeriveReply, DeriveRequest
from sessionlog.errors import (
    CorruptLog,
    DerivationDiverges,
    LogUnavailable,
    SessionNotFound,
)
from sessionlog.events import Message, RequestHeader, canonical_json
from sessionlog.log import SessionLog
from sessionlog.lru import LRU
from sessionlog.micro import UnreadableReply, ask
from sessionlog.session import DerivedMessage, DerivedMessages, FoldedHeader, Session
from sessionlog.sessioncache import NotReached, Projection, SessionCache, SessionLogState
from sessionlog.wire import PHRASE

from .tails import TailWatch

log = logging.getLogger("sessionlog.gateway")

DERIVE_SUBJECT: Final = DERIVE.subject
# How long to derive from the stream after a deriver reply that does not match the contract (another version).
_SKIP_S: Final = 60.0


# Where a derivation came from: the stream read now, a watched session held with nothing newer announced (no
# read), the context-deriver, or record mode's own writer.
SourceName = Literal["stream", "watched", "context-deriver", "record"]


@dataclass(frozen=True, slots=True)
class Derivation:
    """The durable log's model-visible state at dispatch time."""

    session_id: str
    seq: int  # the last seq of the log this derivation is of (-1: empty)
    messages: Sequence[DerivedMessage]
    header: FoldedHeader | None
    open_step: tuple[int, int] | None  # (turn, step), None when no step is open
    generation: int
    source: SourceName


class DerivationSource(Protocol):
    async def derive(self, session_id: str, min_seq: int | None) -> Derivation: ...

    async def close(self) -> None: ...


def _not_reached(session_id: str, min_seq: int, last: int, waited: float) -> DerivationDiverges:
    return DerivationDiverges(
        f"request {PHRASE}: the caller says it flushed seq {min_seq} of session {session_id}, but the durable log "
        f"ends at seq {last} after waiting {waited:.2f}s; flush the writer before the request",
        seq=min_seq,
    )


class _Logs(Projection[SessionLogState]):
    """The gateway's sessions: their validated logs, nothing more."""

    name: ClassVar[str] = "gateway-stream"

    def __init__(self, forgotten: Callable[[str], None]) -> None:
        self._forgotten = forgotten

    def new_state(self, session_id: str) -> SessionLogState:
        return SessionLogState(session_id)

    def on_forget(self, session_id: str) -> None:
        self._forgotten(session_id)


class StreamSource:
    """Derives from the event stream directly, keeping recently used sessions live (`max_sessions`) in the
    runtime's session cache: its `session_at` catches a session up from the stream and waits for `min_seq`.

    With `watch` (the default), the sessions held are watched (`tails.TailWatch`): a request that names the seq
    it flushed is answered without reading the tail (source "watched") when the session is known to hold that seq
    and nothing newer was announced; announced records are read ahead, in the background."""

    def __init__(self, log: SessionLog, *, wait_s: float = 5.0, max_sessions: int = 1024, watch: bool = True) -> None:
        self._log = log
        self._wait_s = wait_s
        self._sessions = SessionCache(log, _Logs(self._forgotten), max_sessions=max_sessions)
        self.tails = TailWatch(log.nc, self._read, self._sessions.purge) if watch else None

    async def derive(self, session_id: str, min_seq: int | None) -> Derivation:
        state = self._sessions.states.get(session_id)
        if state is not None and self._fresh(state, min_seq):
            self._sessions.states.touch(session_id)
            assert self.tails is not None
            self.tails.served(session_id)
            return _derivation(session_id, state.session, "watched")
        if state is None and await self._log.header(session_id) is None:
            raise SessionNotFound(f"session {session_id} not found")
        started = time.monotonic()
        try:
            state = await self._sessions.session_at(session_id, min_seq, self._wait_s)
        except NotReached as exc:
            raise _not_reached(session_id, exc.min_seq, exc.have, time.monotonic() - started) from None
        if self.tails is not None and state is not None:
            self.tails.read_to(session_id, state.next_seq)
            await self.tails.watch(session_id)
        return _derivation(session_id, state.session if state is not None else Session(), "stream")

    def _fresh(self, state: SessionLogState, min_seq: int | None) -> bool:
        if self.tails is None or min_seq is None:
            return False
        return self.tails.fresh(state.session_id, state.next_seq, min_seq)

    async def _read(self, session_id: str) -> int:
        state = await self._sessions.refresh(session_id)
        return state.next_seq if state is not None else 0

    def _forgotten(self, session_id: str) -> None:
        if self.tails is not None:
            self.tails.forget(session_id)

    async def close(self) -> None:
        if self.tails is not None:
            await self.tails.close()


def _derivation(session_id: str, session: Session, source: SourceName) -> Derivation:
    step = session.open_step
    return Derivation(
        session_id=session_id,
        seq=len(session) - 1,
        messages=session.derive_messages(),
        header=session.fold_request_header(),
        open_step=(session.open_turn or 0, step.number) if step is not None else None,
        generation=session.generation,
        source=source,
    )


# ---------------------------------------------------------------------------------------------- deriver client


_message_decoder: Final = msgspec.json.Decoder(Message)
_header_decoder: Final = msgspec.json.Decoder(RequestHeader)
_messages_decoder: Final = msgspec.json.Decoder(list[msgspec.Raw])


def _folded_header(reply: DeriveReply) -> FoldedHeader | None:
    """The reply's header object with the seq and reason it was logged with (-1, "initial" when it has none)."""
    raw = bytes(reply.header)
    if raw.strip() == b"null":
        return None
    seq = reply.header_seq if reply.header_seq is not None else -1
    return FoldedHeader(seq=seq, reason=reply.header_reason or "initial", header=_header_decoder.decode(raw), raw=raw)


class _Known:
    """What this gateway last received of one session's derivation: one generation's messages, which only grow,
    and the SHA-256 state of `[m0,m1,...` so a longer list is checked by hashing only what was added."""

    __slots__ = ("generation", "hasher", "items")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.items: list[DerivedMessage] = []
        self.hasher = hashlib.sha256(b"[")

    def extend(self, raws: list[bytes], seqs: Sequence[int], expected_sha256: str | None = None) -> bool:
        """Add messages in order (`seqs` gives their seqs when the deriver sent them, else -1). With
        `expected_sha256` (of the whole list), nothing is added unless the list with them hashes to it."""
        hasher = self.hasher.copy()
        for i, raw in enumerate(raws):
            hasher.update(b"," + raw if self.items or i else raw)
        if expected_sha256 is not None and _closed(hasher) != expected_sha256:
            return False
        self.hasher = hasher
        for i, raw in enumerate(raws):
            self.items.append(DerivedMessage(seqs[i] if i < len(seqs) else -1, raw, _message_decoder.decode(raw)))
        return True

    def sha256(self) -> str:
        return _closed(self.hasher)

    def view(self) -> DerivedMessages:
        return DerivedMessages(self.items, len(self.items))


def _closed(hasher: Any) -> str:
    """The digest of the array whose opening and elements `hasher` has seen, once its `]` is added."""
    final = hasher.copy()
    final.update(b"]")
    digest: str = final.hexdigest()
    return digest


class ContextDeriverClient:
    """Asks the context-deriver for the derivation; falls back to `fallback` on timeout or no responders.

    It remembers the messages it last received per session (LRU, `max_sessions`) and tells the deriver
    (`known_generation`, `known_count`): within a generation the messages only grow, so the deriver sends only
    the ones added (`messages_from`), and the whole list's `sha256` is checked against the remembered ones plus the
    new. A list that does not check out is fetched again whole.

    Requests and replies are `contracts.DERIVE`'s: the reply says whether a step is open (`open_step`), which the
    invariant needs, each message's seq (`seqs`) and the header's (`header_seq`), which a refusal names. A reply
    that does not match the contract is answered from the stream instead (and the stream is used for a minute after).
    """

    def __init__(
        self,
        nc: Client,
        fallback: DerivationSource,
        *,
        timeout_s: float = 2.0,
        subject: str = DERIVE_SUBJECT,
        max_sessions: int = 1024,
    ) -> None:
        self._nc = nc
        self._fallback = fallback
        self._timeout = timeout_s
        self._subject = subject
        self.fallbacks = 0
        self.incremental = 0  # replies that carried only the added messages
        self._skip_until = 0.0
        self._known: LRU[str, _Known] = LRU(max_sessions)

    async def close(self) -> None:
        await self._fallback.close()

    async def _request(self, request: DeriveRequest) -> DeriveReply:
        return await ask(self._nc, DERIVE, request, timeout=self._timeout, subject=self._subject)

    async def derive(self, session_id: str, min_seq: int | None) -> Derivation:
        # the deriver gives up a little before this client does, so its answer still arrives
        request = DeriveRequest(session=session_id, min_seq=min_seq, timeout_ms=int(self._timeout * 800))
        if time.monotonic() < self._skip_until:
            self.fallbacks += 1
            return await self._fallback.derive(session_id, min_seq)
        known = self._known.get(session_id)
        try:
            if known is not None:
                first = await self._request(
                    msgspec.structs.replace(request, known_generation=known.generation, known_count=len(known.items))
                )
                if first.messages_from is not None:
                    if self._extend(known, first):
                        self.incremental += 1
                        self._known.touch(session_id)
                        return self._derivation(session_id, first, known, min_seq)
                    self._known.pop(session_id)  # it does not check out: fetch the whole list
                    first = await self._request(request)
            else:
                first = await self._request(request)
            replies = [first]
            while replies[-1].next_page is not None:
                replies.append(await self._request(msgspec.structs.replace(request, page=replies[-1].next_page)))
        except UnreadableReply as err:
            log.warning("%s; deriving from the stream for the next %.0fs", err.message, _SKIP_S)
            self._skip_until = time.monotonic() + _SKIP_S
            self.fallbacks += 1
            return await self._fallback.derive(session_id, min_seq)
        except LogUnavailable:
            # no deriver answered in time, or it did not reach min_seq in time: the stream is the authority
            self.fallbacks += 1
            return await self._fallback.derive(session_id, min_seq)
        raws = [bytes(m) for r in replies for m in _messages_decoder.decode(r.messages)]
        seqs = [s for r in replies for s in r.seqs]
        fresh = _Known(first.generation)
        fresh.extend(raws, seqs)
        if fresh.sha256() != first.sha256:
            fresh = _Known(first.generation)
            fresh.extend([canonical_json(m) for m in raws], seqs)
            if fresh.sha256() != first.sha256:
                raise CorruptLog(f"context-deriver reply for {session_id}: messages do not match their sha256")
        self._known.put(session_id, fresh)
        return self._derivation(session_id, first, fresh, min_seq)

    def _extend(self, known: _Known, reply: DeriveReply) -> bool:
        """Add an incremental reply's messages to what is known; False (and nothing changed) unless the reply
        continues exactly what this client holds and the whole list's sha256 checks out."""
        if reply.generation != known.generation or reply.messages_from != len(known.items):
            return False
        return known.extend([bytes(m) for m in _messages_decoder.decode(reply.messages)], reply.seqs, reply.sha256)

    def _derivation(self, session_id: str, first: DeriveReply, known: _Known, min_seq: int | None) -> Derivation:
        if min_seq is not None and first.seq < min_seq:
            raise _not_reached(session_id, min_seq, first.seq, self._timeout)
        return Derivation(
            session_id=session_id,
            seq=first.seq,
            messages=known.view(),
            header=_folded_header(first),
            open_step=first.open_step,
            generation=first.generation,
            source="context-deriver",
        )
