"""The session log on NATS JetStream: the client API agents use (`SessionLog`, `SessionWriter`).

A writer validates every event with the session library before it is queued, so a bad event never reaches
the stream. Queued events are published as records (one JetStream message = a contiguous run of events) when
the write-behind window closes, when the batch reaches its size bound, or on `flush()`, which returns only
when JetStream has acknowledged everything queued: it is the durability checkpoint.

Each record is published with `Nats-Expected-Last-Subject-Sequence` = the stream seq of the session's previous
record, so two writers can never interleave: the loser gets `CONFLICT` and is fenced. A timed-out publish is
retried with the same `Nats-Msg-Id`; a `duplicate` answer, or "wrong last sequence" after a timeout, is settled
by reading the stored record and comparing its digest, so nothing is doubled and nothing is reported written
that was not acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from msgspec import UNSET
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from .availability import is_unavailable, retry_unanswered, translates_unavailable, unavailable_as_typed
from .backpressure import PublishWindow
from .connection import connect as nats_connect
from .errors import (
    JS_DUPLICATE_IN_PROCESS,
    JS_STORE_FULL,
    JS_WRONG_LAST_SEQUENCE,
    Conflict,
    EventTooLarge,
    InvalidEvent,
    LeaseLost,
    LogFull,
    LogUnavailable,
    OpenTurn,
    PurgeRefused,
    SessionAlreadyExists,
    SessionLogError,
    SessionNotFound,
)
from .events import Event, Message, Source, TextBlock, encode_new_event
from .fork import plan_fork, resume_events
from .ids import check_session_id
from .jsonl import JsonlLog, SessionHeader, decode_header, read_jsonl, write_jsonl
from .leases import Lease, Leases
from .provision import provision
from .reader import StreamReader
from .record import (
    H_DIGEST,
    HEADER_ALLOWANCE,
    Record,
    encode_payload,
    events_filter,
    in_subject,
    raw_subject,
    record_headers,
)
from .session import Session
from .settings import Settings
from .surface import ReplaceOp
from .tasks import cancel_and_wait

log = logging.getLogger("sessionlog.writer")

_FENCE_ATTEMPTS: Final = 5  # a stale holder lands at most a few records before the fence does


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


def now_ms() -> int:
    return int(time.time() * 1000)


class SessionLog:
    """A connection to the log: creates, opens, forks, resumes, imports and exports sessions."""

    def __init__(self, nc: Client, settings: Settings) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=settings.request_timeout_s)
        self.settings = settings
        self.reader = StreamReader(nc, settings.stream, timeout=settings.request_timeout_s)
        self.leases = Leases(self.js, settings.kv_leases, timeout=settings.request_timeout_s)
        self._headers_reader = StreamReader(nc, f"KV_{settings.kv_sessions}", timeout=settings.request_timeout_s)
        self.publish_window = PublishWindow(nc)  # back-pressure of every writer's records on this connection
        # Built, not looked up (`js.key_value` asks the stream leader for its info): headers are read by direct
        # get, which any replica answers, so a cluster without quorum can still be read.
        self._kv_sessions = KeyValue(
            name=settings.kv_sessions,
            stream=f"KV_{settings.kv_sessions}",
            pre=f"$KV.{settings.kv_sessions}.",
            js=self.js,
            direct=True,
        )

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
        bound = min(self.settings.write_max_bytes, self.nc.max_payload)
        return max(1024, bound - HEADER_ALLOWANCE)

    # ---------------------------------------------------------------------------------- headers

    @translates_unavailable("read the header of session {session_id}")
    async def header(self, session_id: str) -> bytes | None:
        """The session header (its JSONL header line) or None while the session is not visible."""
        check_session_id(session_id)
        try:
            entry = await retry_unanswered(lambda: self._kv_sessions.get(session_id), self.settings.request_timeout_s)
        except (KeyNotFoundError, NotFoundError):
            return await self._header_from_leader(session_id)
        value: bytes | None = entry.value
        return value or None

    async def _header_from_leader(self, session_id: str) -> bytes | None:
        """A header a direct get did not find, asked of the bucket's leader: a follower that has not yet replicated
        a header just written (a fork, then reading the child) answers "not found" (seen on a 3-node cluster).
        Without a leader (no quorum) the follower's answer stands. A key holds one message (write-once headers)."""
        try:
            raw = await self._headers_reader.leader_get(
                seq=1, next_by_subj=f"$KV.{self.settings.kv_sessions}.{session_id}"
            )
        except LogUnavailable:
            return None
        if raw is None or raw.headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return raw.data or None

    async def _session_ids(self) -> list[str]:
        """The id of every session with a header, read by direct gets (which any replica answers), so sessions can
        be listed without quorum."""
        prefix = f"$KV.{self.settings.kv_sessions}."
        headers = await self._headers_reader.latest_values(f"{prefix}>")
        return [subject[len(prefix) :] for subject, data in headers.items() if data]

    async def _publish_header(self, session_id: str, header_raw: bytes) -> None:
        try:
            await self._kv_sessions.create(session_id, header_raw)
        except KeyWrongLastSequenceError:
            raise SessionAlreadyExists(f"session {session_id} already exists") from None

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
        keys = await self._session_ids()
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
        if origin is not None and origin != "subagent":
            raise InvalidEvent(f'session header origin must be "subagent" or absent, got {origin!r}')
        if await self._require_absent(session_id) is not None:
            raise SessionAlreadyExists(f"session {session_id} has records from an unfinished import or fork")
        header: dict[str, Any] = {
            "type": "session",
            "version": 0,
            "id": session_id,
            "createdAt": created_at or now_ms(),
        }
        if cwd is not None:
            header["cwd"] = cwd
        if origin is not None:
            header["origin"] = origin
        header["delegationDepth"] = delegation_depth
        if tenant is not None:
            header["tenant"] = tenant
        lease = await self._acquire(session_id)
        try:
            await self._publish_header(session_id, msgspec.json.encode(header))
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
            publisher = RecordPublisher(self, session_id, epoch=lease.epoch)
            min_stream_seq = 0
            for _ in range(_FENCE_ATTEMPTS):
                _, session, last = await self.load(session_id, min_stream_seq=min_stream_seq)
                if not (resuming or continue_open_turn) and session.open_turn is not None:
                    raise OpenTurn(
                        f"session {session_id} has turn {session.open_turn} open; resume it to close the turn first"
                    )
                try:
                    fence = await publisher.fence(len(session), last.stream_seq if last else 0, session.open_turn or 0)
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
        header = plan.child_header(child_id=new_id, parent=msgspec.json.decode(parent_raw), created_at=created)
        header_raw = msgspec.json.encode(header)
        await self._write_all(new_id, list(plan.events), orphan)
        await self._publish_header(new_id, header_raw)
        return header_raw

    @translates_unavailable("import a session log")
    async def import_log(self, log_file: JsonlLog, session_id: str | None = None) -> tuple[str, int]:
        """Copy a JSONL log into the stream as it is (no closers: a lossless copy). The session becomes visible
        only when every record is written. Returns the id and the number of events."""
        header_raw = log_file.header_raw
        if session_id is not None and session_id != log_file.header.id:
            header_obj = msgspec.json.decode(header_raw)
            header_obj["id"] = session_id
            header_raw = msgspec.json.encode(header_obj)
        sid = check_session_id(session_id or log_file.header.id)
        Session(log_file.events)  # validate everything before anything is sent
        orphan = await self._require_absent(sid)
        await self._write_all(sid, log_file.events, orphan)
        await self._publish_header(sid, header_raw)
        return sid, len(log_file.events)

    async def import_file(self, path: Path, session_id: str | None = None) -> tuple[str, int]:
        return await self.import_log(read_jsonl(path), session_id)

    @translates_unavailable("export session {session_id}")
    async def export_file(self, session_id: str, path: Path) -> int:
        header, session, _ = await self.load(session_id)
        write_jsonl(path, header, [e.raw for e in session])
        return len(session)

    async def _write_all(self, session_id: str, events: list[bytes], orphan: Record | None) -> None:
        """Write a whole log with optimistic concurrency, continuing an unfinished earlier attempt when the
        records it left are exactly a prefix of this log."""
        start, last_stream_seq = 0, 0
        if orphan is not None:
            existing = await self.reader.events(session_id)
            if existing != events[: len(existing)]:
                raise SessionAlreadyExists(
                    f"session {session_id} has {len(existing)} records' worth of other events from an unfinished "
                    "import or fork"
                )
            start, last_stream_seq = len(existing), orphan.stream_seq
        limit_bytes = self.max_record_bytes
        for seq, raw in enumerate(events):  # refuse before anything is sent: a refused write leaves nothing
            if len(raw) + 2 > limit_bytes:
                raise EventTooLarge(
                    f"event is {len(raw)} bytes; a record carries at most {limit_bytes}: move its content to the "
                    "blob store",
                    seq=seq,
                )
        publisher = RecordPublisher(self, session_id, epoch=0)
        batch: list[bytes] = []
        size = 2
        first = start
        limit_bytes, limit_events = self.max_record_bytes, self.settings.write_max_events
        probe = Session(events[:start]) if start else Session()
        for seq in range(start, len(events)):
            raw = events[seq]
            if batch and (size + len(raw) + 1 > limit_bytes or len(batch) >= limit_events):
                last_stream_seq = await publisher.publish(batch, first, last_stream_seq, probe.open_turn or 0)
                first, batch, size = seq, [], 2
            probe.append(raw)
            batch.append(raw)
            size += len(raw) + 1
        if batch:
            await publisher.publish(batch, first, last_stream_seq, probe.open_turn or 0)

    # ---------------------------------------------------------------------------------- erasure

    @translates_unavailable("purge session {session_id}")
    async def purge(self, session_id: str) -> None:
        """Erase one session (a privacy request): its records, its raw gateway bytes, its header; every
        projection is told to forget it. Admin only; the streams must have been created with
        `SESSIONLOG_ALLOW_PURGE=true` (JetStream never lifts `deny_purge`)."""
        check_session_id(session_id)
        if await self.header(session_id) is None and await self.reader.last_record(session_id) is None:
            raise SessionNotFound(f"session {session_id} not found")
        bucket = self.settings.kv_sessions
        # The headers bucket refuses purge markers (a writer could send one too): its stream is purged, last.
        for stream, subject in (
            (self.settings.stream, events_filter(session_id)),
            (self.settings.raw_stream, raw_subject(session_id)),
            (f"KV_{bucket}", f"$KV.{bucket}.{session_id}"),
        ):
            try:
                await self.js.purge_stream(stream, subject=subject)
            except NotFoundError:
                continue
            except nats.js.errors.APIError as err:
                if is_unavailable(err):  # a stream without a leader answers 503: not a refusal
                    raise
                raise PurgeRefused(
                    f"stream {stream} refuses purges ({err.description}); erasure needs streams created with "
                    "SESSIONLOG_ALLOW_PURGE=true"
                ) from None
        await self.nc.publish(f"{PURGED_PREFIX}{session_id}", b"")
        await self.nc.flush()

    # ---------------------------------------------------------------------------------- leases

    async def _acquire(self, session_id: str) -> _LeaseKeeper:
        check_session_id(session_id)
        holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        sent = time.monotonic()
        lease = await self.leases.acquire(session_id, holder, self.settings.lease_ttl_s)
        return _LeaseKeeper(self.leases, lease, self.settings.effective_lease_refresh_s, acquired_at=sent)

    # ---------------------------------------------------------------------------------- blobs

    @translates_unavailable("store a blob")
    async def put_blob(self, data: bytes, *, media_type: str = "application/octet-stream") -> dict[str, Any]:
        """Store large content in the object store; the returned attachment dict is what events reference."""
        import hashlib

        name = "sha256:" + hashlib.sha256(data).hexdigest()
        store = await self.js.object_store(self.settings.object_store)
        with contextlib.suppress(Exception):
            info = await store.get_info(name)
            if info is not None and info.size == len(data):
                return {"attachmentId": name, "mediaType": media_type, "bytes": len(data)}
        await store.put(name, data)
        return {"attachmentId": name, "mediaType": media_type, "bytes": len(data)}

    @translates_unavailable("read blob {attachment_id}")
    async def get_blob(self, attachment_id: str) -> bytes:
        store = await self.js.object_store(self.settings.object_store)
        try:
            result = await store.get(attachment_id)
        except NotFoundError:
            raise SessionNotFound(f"no blob {attachment_id}") from None
        data: bytes = result.data or b""
        return data


class _LeaseKeeper:
    """Holds a writer lease: refreshes it in the background, knows when it may have lapsed, reports its loss.

    A refresh that fails for want of an answer is retried at once (with a short backoff), not a refresh interval
    later: a lease outlives `ttl - interval` seconds without one, and that margin is what covers a leader
    election. `confirmed_at` is when the last write that landed was sent, so the server's expiry is no earlier
    than `confirmed_at + ttl`: a lease is *overdue* past that, and the writer confirms it before publishing.
    """

    def __init__(self, leases: Leases, lease: Lease, interval_s: float, *, acquired_at: float | None = None) -> None:
        self._leases = leases
        self.lease = lease
        self._interval = interval_s
        self._callbacks: list[Any] = []
        self._stopping = False
        self._lock = asyncio.Lock()  # one refresh at a time: the loop's and a writer's `confirm()`
        self.confirmed_at = time.monotonic() if acquired_at is None else acquired_at  # when the acquire was sent
        self._task: asyncio.Task[None] | None = asyncio.create_task(self._run(), name=f"lease-{lease.key}")

    @property
    def epoch(self) -> int:
        return self.lease.epoch

    @property
    def overdue(self) -> bool:
        """Whether the lease may have expired on the server (it was not refreshed within its TTL)."""
        return time.monotonic() - self.confirmed_at >= self.lease.ttl_s

    def on_lost(self, callback: Any) -> None:
        self._callbacks.append(callback)

    async def _run(self) -> None:
        # The flag, not only the cancel, ends the loop: a cancel that lands with a refresh reply can be swallowed.
        delay = 0.0
        while True:
            await asyncio.sleep(delay or max(0.0, self.confirmed_at + self._interval - time.monotonic()))
            if self._stopping:
                return
            try:
                await self.confirm()
                delay = 0.0
            except LeaseLost as err:
                for callback in self._callbacks:
                    callback(err.message)
                return
            except Exception as err:  # no answer: try again soon; the TTL decides whether it is lost
                log.warning("lease refresh for %s failed: %s", self.lease.key, err)
                delay = min(max(0.1, delay * 2), 1.0)

    async def confirm(self) -> None:
        """Refresh the lease now; `LeaseLost` naming the cause when it expired or was taken over."""
        async with self._lock:
            sent = time.monotonic()
            unrefreshed = sent - self.confirmed_at
            try:
                self.lease = await self._leases.refresh(self.lease)
            except LeaseLost as err:
                # A refresh whose ack was lost may still have landed: then the lease is ours at a newer revision.
                current = await self._still_ours()
                if current is None:
                    raise LeaseLost(self._cause(err, unrefreshed)) from None
                self.lease = current
            self.confirmed_at = sent

    def _cause(self, err: LeaseLost, unrefreshed: float) -> str:
        if unrefreshed < self.lease.ttl_s:
            return err.message
        return (
            f"{err.message}: it was not refreshed for {unrefreshed:.1f}s, past its {self.lease.ttl_s:g}s TTL (the "
            "event loop was blocked, for example by a synchronous call, the process was paused, or the log did "
            "not answer)"
        )

    async def lost(self) -> str | None:
        """Why the lease is no longer this holder's, asking the server; None while it still is (or no answer)."""
        try:
            await self.confirm()
        except LeaseLost as err:
            return err.message
        except Exception:
            return None
        return None

    async def _still_ours(self) -> Lease | None:
        """The lease as it stands now if it is still this holder's tenure (a write whose answer was lost may have
        landed at a newer revision), else None."""
        try:
            current = await self._leases.current(self.lease.key)
        except Exception:
            return None
        if current is None or current.holder != self.lease.holder or current.epoch != self.lease.epoch:
            return None
        return current

    async def stop(self) -> None:
        self._stopping = True
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def release(self) -> None:
        await self.stop()
        try:
            await self._leases.release(self.lease)
        except LeaseLost:
            # A refresh cancelled in flight may have landed after all: the lease is then ours at its newer revision.
            current = await self._still_ours()
            if current is not None:
                with contextlib.suppress(LeaseLost):
                    await self._leases.release(current)


class _PubAck(msgspec.Struct):
    """JetStream's answer to a publish: an ack or an error object (decoded once, in C, on the hot path)."""

    seq: int = 0
    duplicate: bool = False
    error: dict[str, Any] | None = None


_pub_ack: Final = msgspec.json.Decoder(_PubAck)


class WrongLastRecord(Conflict):
    """A publish expected a record that is no longer the session's last; `last_stream_seq` is the one that is,
    as the server named it (None when it did not)."""

    def __init__(self, message: str, *, seq: int | None = None, last_stream_seq: int | None = None) -> None:
        super().__init__(message, seq=seq)
        self.last_stream_seq = last_stream_seq


def _last_sequence_of(description: object) -> int | None:
    """JetStream's "wrong last sequence: N" names the subject's actual last sequence."""
    tail = str(description).rsplit(":", 1)[-1].strip()
    return int(tail) if tail.isdigit() else None


class RecordPublisher:
    """Publishes records of one session with optimistic concurrency and safe retries."""

    def __init__(self, log: SessionLog, session_id: str, *, epoch: int) -> None:
        self._log = log
        self._session_id = session_id
        self._epoch = epoch
        self._subject = in_subject(session_id)

    async def fence(self, first_seq: int, expected_last: int, open_turn: int) -> int:
        """Publish this tenure's fence, an empty record after `expected_last`; its stream seq. Every publish of an
        earlier tenure names an earlier record as the session's last, so JetStream refuses it from now on."""
        return await self.publish([], first_seq, expected_last, open_turn)

    async def publish(
        self, events: list[bytes], first_seq: int, expected_last: int, open_turn: int, *, in_doubt: bool = False
    ) -> int:
        """Publish one record; return its stream seq. Raises `CONFLICT`, `LOG_UNAVAILABLE` or `LOG_FULL`.

        `in_doubt`: an earlier attempt at this record was interrupted and may have landed, so a "wrong last sequence"
        answer is settled by the stored record's digest, as after a timeout."""
        payload = encode_payload(events)
        headers = record_headers(
            session_id=self._session_id,
            first_seq=first_seq,
            count=len(events),
            epoch=self._epoch,
            payload=payload,
            expected_last=expected_last,
            open_turn=open_turn,
        )
        settings = self._log.settings
        # The budget of the whole publish is not one request's timeout: it must outlast a leader election. Each
        # attempt waits a third of a request timeout, so a publish lost in the election is sent again soon; the
        # same message id makes every repeat harmless.
        budget = settings.publish_retry_s
        started = time.monotonic()
        window = self._log.publish_window  # the budget counts from the connection's last acknowledgement
        cap = window.cap(budget, settings.duplicate_window_s)
        attempt_timeout = max(0.05, settings.request_timeout_s / 3)
        timed_out = in_doubt
        delay = 0.02
        while True:
            remaining = window.remaining(started, budget, cap)
            if remaining <= 0:
                raise LogUnavailable(
                    f"session {self._session_id}: no acknowledgement for seqs "
                    f"{first_seq}..{first_seq + len(events) - 1} "
                    f"within {budget:g}s of retrying (the cluster may have lost quorum); nothing after seq "
                    f"{first_seq - 1} is reported written"
                )
            try:
                reply = await window.request(
                    self._subject, payload, headers, attempt_s=attempt_timeout, started=started, budget_s=budget,
                    cap_s=cap,
                )  # fmt: skip
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.errors.OutboundBufferLimitError,
                nats.errors.ConnectionReconnectingError,
            ):
                timed_out = True
                await asyncio.sleep(min(delay, max(0.0, window.remaining(started, budget, cap))))
                delay = min(delay * 2, 0.5)
                continue
            try:
                ack = _pub_ack.decode(reply.data)
            except msgspec.DecodeError as exc:
                raise LogUnavailable(
                    f"session {self._session_id}: publish answered with something that is not a JetStream ack "
                    f"({exc}); nothing after seq {first_seq - 1} is reported written",
                    seq=first_seq,
                ) from None
            error = ack.error
            if error is None:
                if ack.duplicate:
                    return await self._settle_duplicate(ack.seq, headers, first_seq)
                return ack.seq
            code = error.get("err_code")
            if code in JS_WRONG_LAST_SEQUENCE:
                if timed_out:
                    landed = await self._landed(headers, first_seq)
                    if landed is not None:
                        return landed
                raise WrongLastRecord(
                    f"session {self._session_id}: another writer appended first (expected last stream seq "
                    f"{expected_last}: {error.get('description')}); reload and retry",
                    seq=first_seq,
                    last_stream_seq=_last_sequence_of(error.get("description")),
                )
            if code in JS_STORE_FULL:
                raise LogFull(
                    f"stream {self._log.settings.stream} is full and refuses new records ({error.get('description')})",
                    seq=first_seq,
                )
            if error.get("code") == 503 or code == JS_DUPLICATE_IN_PROCESS:
                timed_out = True
                await asyncio.sleep(min(delay, max(0.0, window.remaining(started, budget, cap))))
                delay = min(delay * 2, 0.5)
                continue
            raise LogUnavailable(f"session {self._session_id}: publish refused: {error}", seq=first_seq)

    async def _landed(self, headers: dict[str, str], first_seq: int) -> int | None:
        """After a timeout: the stream seq of our record if an earlier attempt stored it, else None. The epoch is
        compared too: every fence has the same (empty) payload."""
        last = await self._log.reader.last_record(self._session_id)
        if (
            last is not None
            and last.first_seq == first_seq
            and last.epoch == self._epoch
            and last.digest == headers[H_DIGEST]
        ):
            return last.stream_seq
        return None

    async def _settle_duplicate(self, stream_seq: int, headers: dict[str, str], first_seq: int) -> int:
        raw = await self._log.reader.leader_get(seq=stream_seq)
        if raw is not None and raw.headers.get(H_DIGEST) == headers[H_DIGEST]:
            return stream_seq
        raise Conflict(
            f"session {self._session_id}: the stream holds a different record under message id "
            f"{headers['Nats-Msg-Id']}; reload and retry",
            seq=first_seq,
        )


class SessionWriter:
    """The one writer of a session: validates, queues, batches, publishes, and holds the lease."""

    def __init__(
        self, log: SessionLog, session_id: str, session: Session, *, last_stream_seq: int, lease: _LeaseKeeper
    ) -> None:
        self.log = log
        self.session_id = session_id
        self._session = session
        self._lease = lease
        self._publisher = RecordPublisher(log, session_id, epoch=lease.epoch)
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
        self._max_bytes = log.max_record_bytes
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

    # ---------------------------------------------------------------------------------- appending

    async def append(self, raw: bytes) -> Event:
        """Validate one event and queue it; raises the SPEC error and queues nothing when it is refused."""
        self._raise_if_failed()
        if len(raw) + 2 > self._max_bytes:
            raise EventTooLarge(
                f"event is {len(raw)} bytes; a record carries at most {self._max_bytes}: move large content to the "
                "blob store (SessionLog.put_blob) and reference it by id",
                seq=len(self._session),
            )
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

    async def close(self) -> None:
        """Flush what is queued, stop, and release the lease."""
        if self._closed:
            return
        try:
            if self._failed is None:
                await self.flush()
        finally:
            self._closed = True
            await cancel_and_wait(self._task)
            await self._lease.release()

    async def abandon(self) -> None:
        """Stop without flushing or releasing the lease (a crash, as far as the log can tell)."""
        self._closed = True
        await cancel_and_wait(self._task)
        await self._lease.stop()

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
                batch, size = self._take_batch(self._in_doubt)
                first = self._pending_first
                try:
                    if self._lease.overdue:
                        await self._confirm_lease(first)
                    stream_seq = await self._publisher.publish(
                        batch,
                        first,
                        self._last_stream_seq,
                        self._pending_turns[len(batch) - 1],
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

    def _take_batch(self, exactly: int = 0) -> tuple[list[bytes], int]:
        """The next record's events: as many queued as the bounds allow, or `exactly` that many (an in-doubt
        batch, which must be sent again byte for byte)."""
        size = 2
        count = 0
        for raw in self._pending:
            if exactly and count == exactly:
                break
            if not exactly and count and (size + len(raw) + 1 > self._max_bytes or count >= self._max_events):
                break
            size += len(raw) + 1
            count += 1
        return self._pending[:count], size - 2

    async def _confirm_lease(self, first: int) -> None:
        """Before publishing on a lease that was not refreshed within its TTL (the loop was blocked, the process
        paused): refresh it now, so a lapsed lease is `LEASE_LOST` naming why and not a record written without
        it. A refresh without an answer lets the publish go on: the fence decides then (see `_take_over`)."""
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


__all__ = ["LogFull", "SessionHeader", "SessionInfo", "SessionLog", "SessionWriter"]
