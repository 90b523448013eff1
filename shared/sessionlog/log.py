"""The session log on NATS JetStream: the application API agents and services use (`SessionLog`).

`SessionLog` creates, opens, resumes, forks, imports, exports, lists, purges and repairs sessions; every record it
writes goes through the record store (`store.py`: publishing with optimistic concurrency, digest settling,
batching, the size rule) and every header through `header.SessionHeader` into the headers bucket. A session's
writes between open and close belong to its `SessionWriter` (`writer.py`), which holds the session's lease.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from nats.aio.client import Client
from nats.js.client import JetStreamContext

from .availability import translates_unavailable, unavailable_as_typed
from .connection import connect as nats_connect
from .errors import (
    Conflict,
    LogFull,
    LogUnavailable,
    OpenTurn,
    SessionAlreadyExists,
    SessionLogError,
    SessionNotFound,
)
from .fork import plan_fork, resume_events
from .header import SessionHeader, decode_header, with_id
from .ids import check_session_id
from .jsonl import JsonlLog, read_jsonl, write_jsonl
from .leases import LeaseKeeper, Leases
from .provision import provision
from .reader import StreamReader
from .record import Record
from .repair import interrupted_turn_closers
from .session import Session
from .settings import Settings
from .store import BlobStore, HeaderStore, RecordStore, WrongLastRecord, erase
from .writer import SessionWriter, now_ms

log = logging.getLogger("sessionlog.writer")

_FENCE_ATTEMPTS: Final = 5  # a stale holder lands at most a few records before the fence does
_CLOSE_ATTEMPTS: Final = 3  # closing a turn reads the log again when someone appended meanwhile
REPAIR_EPOCH: Final = 0  # every repairer publishes the same closers under the same message id


PURGED_PREFIX: Final = "sessionlog.admin.purged."


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """One line of `sessionlog sessions`. `error` (`CODE: message`) marks a session whose last record or header
    does not read; its other fields then say only what the header does."""

    id: str
    events: int
    open_turn: int | None
    parent: str | None
    created_at: int
    error: str | None = None


class SessionLog:
    """A connection to the log: creates, opens, forks, resumes, imports and exports sessions."""

    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=settings.request_timeout_s)
        self.settings = settings
        self.reader = StreamReader(nc, settings.stream, timeout=settings.request_timeout_s)
        self.leases = Leases(self.js, settings.kv_leases, timeout=settings.request_timeout_s)
        self.store = RecordStore(nc, settings, self.reader)
        self.header_store = HeaderStore(nc, self.js, settings)
        self.blobs = BlobStore(self.js, settings)

    @classmethod
    @translates_unavailable("connect to the log")
    async def connect(cls, settings: Settings | None = None, *, provision_stores: bool = True) -> SessionLog:
        """Connect (starting the embedded server when no URL is set) and make sure the stream and stores exist."""
        settings = settings or Settings()
        nc = await nats_connect(settings)
        self = cls(nc, settings)
        try:
            if provision_stores:
                await self._provision()
        except BaseException:
            await nc.close()
            raise
        return self

    async def _provision(self) -> None:
        """Create or verify the streams. Without a meta leader or stream leaders (a cluster without quorum) that
        cannot be done, but reading can (direct gets from a surviving replica): the connection is kept and writes
        will say `LOG_UNAVAILABLE` themselves. A real refusal (a mismatching stream) still fails the connect."""
        try:
            with unavailable_as_typed("provision the log's streams"):
                await provision(self.js, self.settings)
            # The stream exists with the settings' partition count (else provisioning refused): the reader can
            # read one session by its stored subject.
            self.reader.partition_count = self.settings.partition_count
        except LogUnavailable as err:
            log.warning("connected without verifying the streams (reads may still work): %s", err)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.drain()

    async def __aenter__(self) -> SessionLog:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def max_record_bytes(self) -> int:
        return self.store.max_record_bytes

    # ---------------------------------------------------------------------------------- headers

    @translates_unavailable("read the header of session {session_id}")
    async def header(self, session_id: str) -> bytes | None:
        """The session header (its JSONL header line) or None while the session is not visible."""
        check_session_id(session_id)
        return await self.header_store.get(session_id)

    async def _require_absent(self, session_id: str) -> Record | None:
        """Refuse an id that is taken; return the last record of an unfinished write (records, no header)."""
        check_session_id(session_id)
        if await self.header(session_id) is not None:
            raise SessionAlreadyExists(f"session {session_id} already exists")
        return await self.reader.last_record(session_id)

    # ---------------------------------------------------------------------------------- reading

    @translates_unavailable("load session {session_id}")
    async def load(
        self, session_id: str, *, up_to_seq: int | None = None, min_stream_seq: int = 0
    ) -> tuple[bytes, Session, Record | None]:
        """The session header, the validated log (its prefix up to `up_to_seq`, inclusive), and the last record
        read; `min_stream_seq` is a stream sequence the answer must reach. Raises `SESSION_NOT_FOUND` for a
        session that is not visible."""
        header = await self.header(session_id)
        if header is None:
            raise SessionNotFound(f"session {session_id} not found")
        records = await self.reader.records(session_id, up_to_seq=up_to_seq, min_stream_seq=min_stream_seq)
        events = [e for r in records for e in r.events]
        if up_to_seq is not None:
            del events[up_to_seq + 1 :]
        return header, Session(events), records[-1] if records else None

    @translates_unavailable("list sessions")
    async def sessions(self) -> list[SessionInfo]:
        """Every visible session, newest first."""
        keys = await self.header_store.session_ids()
        out: list[SessionInfo] = []
        for key in keys:
            info = await self._session_info(key)
            if info is not None:
                out.append(info)
        out.sort(key=lambda s: (s.created_at, s.id), reverse=True)
        return out

    async def _session_info(self, session_id: str) -> SessionInfo | None:
        """One session's line; a session that does not read (a record anyone could publish to its subject) is
        listed with its error instead of failing the whole listing. `LOG_UNAVAILABLE` is not a finding."""
        try:
            header = await self.header(session_id)
        except LogUnavailable:
            raise
        except SessionLogError as err:
            return SessionInfo(session_id, 0, None, None, 0, error=f"{err.code}: {err.message}")
        if header is None:
            return None
        parent: str | None = None
        created_at = 0
        try:
            parsed = decode_header(header)
            parent = parsed.parent_session if isinstance(parsed.parent_session, str) else None
            created_at = parsed.created_at
            last = await self.reader.last_record(session_id)
        except LogUnavailable:
            raise
        except SessionLogError as err:
            return SessionInfo(session_id, 0, None, parent, created_at, error=f"{err.code}: {err.message}")
        return SessionInfo(
            id=session_id,
            events=last.next_seq if last else 0,
            open_turn=(last.open_turn or None) if last else None,
            parent=parent,
            created_at=created_at,
        )

    # ---------------------------------------------------------------------------------- writing

    @translates_unavailable("create session {session_id}")
    async def create(
        self,
        session_id: str,
        *,
        cwd: str | None = None,
        origin: str | None = None,
        delegation_depth: int = 0,
        created_at: int | None = None,
        tenant: str | None = None,
    ) -> SessionWriter:
        """A new, empty session, visible at once, held by the returned writer. `origin` is absent or "subagent",
        the only value dsh reads (any other makes dsh refuse the whole file). `tenant` (the gateway's record mode) is
        kept in the header: the session belongs to it."""
        header = SessionHeader.new(
            session_id,
            created_at=created_at or now_ms(),
            cwd=cwd,
            origin=origin,
            delegation_depth=delegation_depth,
            tenant=tenant,
        )
        if await self._require_absent(session_id) is not None:
            raise SessionAlreadyExists(f"session {session_id} has records from an unfinished import or fork")
        lease = await self._acquire(session_id)
        try:
            await self.header_store.create(session_id, header.encode())
        except BaseException:
            await lease.release()
            raise
        return SessionWriter(self, session_id, Session(), last_stream_seq=0, lease=lease)

    @translates_unavailable("open session {session_id}")
    async def open(self, session_id: str, *, continue_open_turn: bool = False) -> SessionWriter:
        """Continue a session whose last turn is closed; one a crash left open needs `resume`.

        `continue_open_turn` takes over an open turn as it is (the gateway's record mode, whose turns stay open
        between requests: the lease, now ours, says its last holder is gone or let it go)."""
        return await self._take_over(session_id, resuming=False, continue_open_turn=continue_open_turn)

    @translates_unavailable("resume session {session_id}")
    async def resume(self, session_id: str) -> SessionWriter:
        """Load, close a turn a crash left open (SPEC section 7), mark the seed end, durably; refused while a live
        writer holds the session."""
        return await self._take_over(session_id, resuming=True)

    async def _take_over(self, session_id: str, *, resuming: bool, continue_open_turn: bool = False) -> SessionWriter:
        """Take the lease, load the log and fence it: an empty record of the new epoch after the last one loaded.

        The fence is what JetStream enforces: a writer of an earlier tenure (paused past its TTL, then woken) names
        an earlier record as the session's last in its next publish and is refused by the server, whatever it
        believes about its lease. A record it landed before the fence is in the log this tenure loaded."""
        lease = await self._acquire(session_id)
        writer: SessionWriter | None = None
        try:
            min_stream_seq = 0
            for _ in range(_FENCE_ATTEMPTS):
                _, session, last = await self.load(session_id, min_stream_seq=min_stream_seq)
                if not (resuming or continue_open_turn) and session.open_turn is not None:
                    raise OpenTurn(
                        f"session {session_id} has turn {session.open_turn} open; resume it to close the turn first"
                    )
                try:
                    fence = await self.store.fence(
                        session_id,
                        len(session),
                        last.stream_seq if last else 0,
                        session.open_turn or 0,
                        epoch=lease.epoch,
                    )
                except WrongLastRecord as moved:  # the previous holder landed a record after our load
                    min_stream_seq = moved.last_stream_seq or 0
                    continue
                writer = SessionWriter(self, session_id, session, last_stream_seq=fence, lease=lease)
                if resuming:
                    for raw in resume_events(session, now_ms=now_ms()):
                        await writer.append(raw)
                    await writer.flush()
                return writer
            raise Conflict(f"session {session_id}: the log kept changing while taking it over; try again")
        except BaseException:
            if writer is not None:
                await writer.abandon()
            await lease.release()
            raise

    @translates_unavailable("fork session {source_id} as {new_id}")
    async def fork(self, source_id: str, new_id: str, *, at: int | None = None) -> bytes:
        """Copy the prefix up to `at` (inclusive; default the whole log) into a new session with a seed marker and
        the header lineage. The parent is never touched. Returns the child's header."""
        check_session_id(new_id)
        parent_raw, session, _ = await self.load(source_id)
        orphan = await self._require_absent(new_id)
        created = now_ms()
        plan = plan_fork(session, at, now_ms=created)
        header_raw = plan.child_header(child_id=new_id, parent=decode_header(parent_raw), created_at=created).encode()
        await self.store.write_all(new_id, plan.events, orphan=orphan)
        await self.header_store.create(new_id, header_raw)
        return header_raw

    @translates_unavailable("import a session log")
    async def import_log(self, log_file: JsonlLog, session_id: str | None = None) -> tuple[str, int]:
        """Copy a JSONL log into the stream as it is (no closers: a lossless copy). The session becomes visible
        only when every record is written. Returns the id and the number of events."""
        header_raw = log_file.header_raw
        if session_id is not None and session_id != log_file.header.id:
            header_raw = with_id(header_raw, session_id)
        sid = check_session_id(session_id or log_file.header.id)
        Session(log_file.events)  # validate everything before anything is sent
        orphan = await self._require_absent(sid)
        await self.store.write_all(sid, log_file.events, orphan=orphan)
        await self.header_store.create(sid, header_raw)
        return sid, len(log_file.events)

    async def import_file(self, path: Path, session_id: str | None = None) -> tuple[str, int]:
        return await self.import_log(read_jsonl(path), session_id)

    @translates_unavailable("export session {session_id}")
    async def export_file(self, session_id: str, path: Path) -> int:
        header, session, _ = await self.load(session_id)
        write_jsonl(path, header, [e.raw for e in session])
        return len(session)

    @translates_unavailable("close the open turn of session {session_id}")
    async def close_turn(self, session_id: str) -> tuple[bytes, ...]:
        """Close a turn whose writer is gone with the SPEC section 7 closers; the closers written, () when no turn
        is open. The caller holds the session's lease (the repairer). The closers are one record of epoch 0: they
        are deterministic, so two repairers publish the same record under the same message id and one copy lands;
        a writer that comes back finds its next record refused. `CONFLICT` when the log kept changing."""
        check_session_id(session_id)
        for _ in range(_CLOSE_ATTEMPTS):
            records = await self.reader.records(session_id)
            session = Session([e for r in records for e in r.events])
            closers = interrupted_turn_closers(session)
            if not closers:
                return ()
            session.copy().extend(closers)  # our own closers pass the same gate as any event
            last = records[-1].stream_seq if records else 0
            try:
                await self.store.publish(session_id, list(closers), len(session), last, 0, epoch=REPAIR_EPOCH)
            except Conflict:
                continue  # someone appended meanwhile: look again
            return closers
        raise Conflict(f"session {session_id}: the log kept changing while closing its turn")

    # ---------------------------------------------------------------------------------- erasure

    @translates_unavailable("purge session {session_id}")
    async def purge(self, session_id: str) -> None:
        """Erase one session (a privacy request): its records, its raw gateway bytes, its header; every
        projection is told to forget it. Admin only; the streams must have been created with
        `SESSIONLOG_ALLOW_PURGE=true` (JetStream never lifts `deny_purge`)."""
        check_session_id(session_id)
        if await self.header(session_id) is None and await self.reader.last_record(session_id) is None:
            raise SessionNotFound(f"session {session_id} not found")
        await erase(self.js, self.settings, session_id)
        await self.nc.publish(f"{PURGED_PREFIX}{session_id}", b"")
        await self.nc.flush()

    # ---------------------------------------------------------------------------------- leases

    async def _acquire(self, session_id: str) -> LeaseKeeper:
        check_session_id(session_id)
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        sent = time.monotonic()
        lease = await self.leases.acquire(session_id, holder, self.settings.lease_ttl_s)
        return LeaseKeeper(self.leases, lease, self.settings.effective_lease_refresh_s, acquired_at=sent)

    # ---------------------------------------------------------------------------------- blobs

    @translates_unavailable("store a blob")
    async def put_blob(self, data: bytes, *, media_type: str = "application/octet-stream") -> dict[str, Any]:
        """Store large content in the object store; the returned attachment dict is what events reference."""
        return await self.blobs.put(data, media_type=media_type)

    @translates_unavailable("read blob {attachment_id}")
    async def get_blob(self, attachment_id: str) -> bytes:
        return await self.blobs.get(attachment_id)


__all__ = ["LogFull", "SessionHeader", "SessionInfo", "SessionLog", "SessionWriter"]
