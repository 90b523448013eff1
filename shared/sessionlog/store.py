"""The record store: the one write path of the log, under `SessionLog` and `SessionWriter`.

`RecordStore` owns how events reach the stream. Each record is published with `Nats-Expected-Last-Subject-Sequence`
= the stream seq of the session's previous record, so two writers can never interleave: the loser is refused
(`WrongLastRecord`, a `CONFLICT`). A timed-out publish is retried with the same `Nats-Msg-Id` for `publish_retry_s`
without an acknowledgement on the connection (`backpressure.py`: writers slow down to what the server acknowledges
instead of failing); a `duplicate` answer, or "wrong last sequence" after a timeout or an interrupted attempt, is
settled by reading the stored record and comparing its digest, so nothing is doubled and nothing is reported written
that was not acknowledged. It also owns the size rule (what one record may carry) and the batching rule (how queued
events are cut into records). `HeaderStore` owns the headers bucket: one write-once header per session, read by
direct get so a cluster without quorum can still be read. `BlobStore` holds large content by digest; `erase` purges
a session from every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from .availability import is_unavailable, retry_unanswered
from .backpressure import PublishWindow
from .errors import (
    JS_STORE_FULL,
    JS_WRONG_LAST_SEQUENCE,
    Conflict,
    EventTooLarge,
    LogFull,
    LogUnavailable,
    PurgeRefused,
    SessionAlreadyExists,
    SessionLogError,
    SessionNotFound,
    js_not_yet,
)
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

IMPORT_EPOCH: Final = 0  # imports and forks write whole logs with no lease of their own


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


class _Retry(Exception):
    """An answer that says "not yet" (503, a duplicate still being replicated): the publish asks again."""


def check_event_size(raw: bytes, seq: int, max_record_bytes: int) -> None:
    """Refuse (`EVENT_TOO_LARGE`) an event that a record of at most `max_record_bytes` payload cannot carry."""
    if len(raw) + 2 > max_record_bytes:
        raise EventTooLarge(
            f"event is {len(raw)} bytes; a record carries at most {max_record_bytes}: move large content to the blob "
            "store (SessionLog.put_blob) and reference it by id",
            seq=seq,
        )


class RecordStore:
    """Records of every session on one connection: published with optimistic concurrency and safe retries,
    cut by the size and batching rules."""

    def __init__(self, nc: Client, settings: Settings, reader: StreamReader) -> None:
        self._nc = nc
        self._settings = settings
        self._reader = reader
        self._window = PublishWindow(nc)  # back-pressure of every writer's records on this connection

    # ---------------------------------------------------------------------------------- size and batching

    @property
    def max_record_bytes(self) -> int:
        """The most payload bytes one record carries (a record with its headers never passes max_payload)."""
        bound = min(self._settings.write_max_bytes, self._nc.max_payload)
        return max(1024, bound - HEADER_ALLOWANCE)

    def check_size(self, raw: bytes, seq: int) -> None:
        """Refuse (`EVENT_TOO_LARGE`) an event no record can carry, before anything is queued or sent."""
        check_event_size(raw, seq, self.max_record_bytes)

    def cut(self, pending: Sequence[bytes], start: int = 0, *, exactly: int = 0) -> tuple[int, int]:
        """How many of `pending` from `start` on the next record carries, and their bytes (each event's, plus one
        per event): as many as the bounds allow, or `exactly` that many (an in-doubt batch, which must be sent again
        byte for byte)."""
        limit_bytes, limit_events = self.max_record_bytes, self._settings.write_max_events
        size = 2
        count = 0
        for index in range(start, len(pending)):
            raw = pending[index]
            if exactly and count == exactly:
                break
            if not exactly and count and (size + len(raw) + 1 > limit_bytes or count >= limit_events):
                break
            size += len(raw) + 1
            count += 1
        return count, size - 2

    # ---------------------------------------------------------------------------------- writing

    async def fence(self, session_id: str, first_seq: int, expected_last: int, open_turn: int, *, epoch: int) -> int:
        """Publish a tenure's fence, an empty record after `expected_last`; its stream seq. Every publish of an
        earlier tenure names an earlier record as the session's last, so JetStream refuses it from now on."""
        return await self.publish(session_id, [], first_seq, expected_last, open_turn, epoch=epoch)

    async def write_all(self, session_id: str, events: Sequence[bytes], *, orphan: Record | None = None) -> None:
        """Write a whole new log in records cut by the batching rule, every event size-checked before anything is
        sent (a refused write leaves nothing). `orphan`, the last record an unfinished earlier write left (records,
        no header), is continued when what it wrote is exactly a prefix of this log, else `SESSION_ALREADY_EXISTS`."""
        start, last_stream_seq = 0, 0
        if orphan is not None:
            existing = await self._reader.events(session_id)
            if existing != list(events[: len(existing)]):
                raise SessionAlreadyExists(
                    f"session {session_id} has {len(existing)} records' worth of other events from an unfinished "
                    "import or fork"
                )
            start, last_stream_seq = len(existing), orphan.stream_seq
        for seq, raw in enumerate(events):
            self.check_size(raw, seq)
        probe = Session(list(events[:start])) if start else Session()
        first = start
        while first < len(events):
            count, _ = self.cut(events, first)
            batch = list(events[first : first + count])
            for raw in batch:
                probe.append(raw)
            last_stream_seq = await self.publish(
                session_id, batch, first, last_stream_seq, probe.open_turn or 0, epoch=IMPORT_EPOCH
            )
            first += count

    async def publish(
        self,
        session_id: str,
        events: list[bytes],
        first_seq: int,
        expected_last: int,
        open_turn: int,
        *,
        epoch: int,
        in_doubt: bool = False,
    ) -> int:
        """Publish one record; return its stream seq. Raises `CONFLICT` (`WrongLastRecord` when another record
        follows `expected_last`), `LOG_UNAVAILABLE` or `LOG_FULL`.

        `in_doubt`: an earlier attempt at this record was interrupted and may have landed, so a "wrong last sequence"
        answer is settled by the stored record's digest, as after a timeout."""
        payload = encode_payload(events)
        headers = record_headers(
            session_id=session_id,
            first_seq=first_seq,
            count=len(events),
            epoch=epoch,
            payload=payload,
            expected_last=expected_last,
            open_turn=open_turn,
        )
        subject = in_subject(session_id)
        return await self._until_stored(
            subject,
            payload,
            headers,
            lambda data, timed_out: self._answered(session_id, data, headers, first_seq, epoch, timed_out=timed_out),
            lambda budget: LogUnavailable(
                f"session {session_id}: no acknowledgement for seqs {first_seq}..{first_seq + len(events) - 1} "
                f"within {budget:g}s of retrying (the cluster may have lost quorum); nothing after seq "
                f"{first_seq - 1} is reported written"
            ),
            timed_out=in_doubt,
        )

    async def publish_raw(
        self, subject: str, data: bytes, headers: dict[str, str], *, budget_s: float, attempt_s: float | None = None
    ) -> int:
        """Publish one message that carries its own `Nats-Msg-Id` (the gateway's raw tee) through the same window
        as the records: sent again until acknowledged, `budget_s` counting from the connection's last
        acknowledgement (`backpressure.py`), each attempt `attempt_s` (default: a record's); its stream seq. Raises
        `LOG_UNAVAILABLE` (unanswered within the budget, or refused) or `LOG_FULL`."""

        async def answered(answer: bytes, timed_out: bool) -> int:
            return self._raw_answered(subject, answer)

        return await self._until_stored(
            subject,
            data,
            headers,
            answered,
            lambda budget: LogUnavailable(
                f"{subject}: no acknowledgement for message {headers.get('Nats-Msg-Id')} within {budget:g}s of retrying"
            ),
            budget_s=budget_s,
            attempt_s=attempt_s,
        )

    async def _until_stored(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str],
        answered: Callable[[bytes, bool], Awaitable[int]],
        gave_up: Callable[[float], SessionLogError],
        *,
        timed_out: bool = False,
        budget_s: float | None = None,
        attempt_s: float | None = None,
    ) -> int:
        """Send one message through the window until `answered` makes its answer a stream seq (or raises);
        `_Retry` from it, or no answer within an attempt, sends it again while the budget lasts. `timed_out`: an
        earlier attempt may already have landed (passed on to `answered`)."""
        settings = self._settings
        # The budget of the whole publish is not one request's timeout: it must outlast a leader election. Each
        # attempt waits a third of a request timeout, so a publish lost in the election is sent again soon; the
        # same message id makes every repeat harmless.
        budget = settings.publish_retry_s if budget_s is None else budget_s
        started = time.monotonic()
        window = self._window  # the budget counts from the connection's last acknowledgement
        cap = window.cap(budget, settings.duplicate_window_s)
        attempt_timeout = max(0.05, settings.request_timeout_s / 3) if attempt_s is None else attempt_s
        delay = 0.02
        while True:
            remaining = window.remaining(started, budget, cap)
            if remaining <= 0:
                raise gave_up(budget)
            try:
                reply = await window.request(
                    subject, payload, headers, attempt_s=attempt_timeout, started=started, budget_s=budget, cap_s=cap
                )
            except (
                nats.errors.TimeoutError,
                nats.errors.NoRespondersError,
                nats.errors.OutboundBufferLimitError,
                nats.errors.ConnectionReconnectingError,
            ):
                reply = None
            if reply is not None:
                try:
                    return await answered(reply.data, timed_out)
                except _Retry:
                    pass
            timed_out = True
            await asyncio.sleep(min(delay, max(0.0, window.remaining(started, budget, cap))))
            delay = min(delay * 2, 0.5)

    def _raw_answered(self, subject: str, data: bytes) -> int:
        """A raw message's answer: its stream seq (a duplicate is the same message stored by an earlier attempt),
        a refusal raised, or `_Retry`."""
        try:
            ack = _pub_ack.decode(data)
        except msgspec.DecodeError as exc:
            raise LogUnavailable(
                f"{subject}: publish answered with something that is not a JetStream ack ({exc})"
            ) from None
        error = ack.error
        if error is None:
            return ack.seq
        if error.get("err_code") in JS_STORE_FULL:
            raise LogFull(f"{subject}: the stream is full and refuses new messages ({error.get('description')})")
        if js_not_yet(error):
            raise _Retry
        raise LogUnavailable(f"{subject}: publish refused: {error}")

    async def _answered(
        self, session_id: str, data: bytes, headers: dict[str, str], first_seq: int, epoch: int, *, timed_out: bool
    ) -> int:
        """What a publish's answer means: the record's stream seq, a refusal raised, or `_Retry`."""
        try:
            ack = _pub_ack.decode(data)
        except msgspec.DecodeError as exc:
            raise LogUnavailable(
                f"session {session_id}: publish answered with something that is not a JetStream ack ({exc}); nothing "
                f"after seq {first_seq - 1} is reported written",
                seq=first_seq,
            ) from None
        error = ack.error
        if error is None:
            if ack.duplicate:
                return await self._settle_duplicate(session_id, ack.seq, headers, first_seq)
            return ack.seq
        code = error.get("err_code")
        if code in JS_WRONG_LAST_SEQUENCE:
            if timed_out:
                landed = await self._landed(session_id, headers, first_seq, epoch)
                if landed is not None:
                    return landed
            raise WrongLastRecord(
                f"session {session_id}: another writer appended first (expected last stream seq "
                f"{headers['Nats-Expected-Last-Subject-Sequence']}: {error.get('description')}); reload and retry",
                seq=first_seq,
                last_stream_seq=_last_sequence_of(error.get("description")),
            )
        if code in JS_STORE_FULL:
            raise LogFull(
                f"stream {self._settings.stream} is full and refuses new records ({error.get('description')})",
                seq=first_seq,
            )
        if js_not_yet(error):
            raise _Retry
        raise LogUnavailable(f"session {session_id}: publish refused: {error}", seq=first_seq)

    async def _landed(self, session_id: str, headers: dict[str, str], first_seq: int, epoch: int) -> int | None:
        """After a timeout: the stream seq of our record if an earlier attempt stored it, else None. The epoch is
        compared too: every fence has the same (empty) payload. A read that is not answered is one more attempt (the
        record is sent again within the budget, and its answer settled again), not the end of the publish."""
        try:
            last = await self._reader.last_record(session_id)
        except LogUnavailable:
            raise _Retry from None
        if (
            last is not None
            and last.first_seq == first_seq
            and last.epoch == epoch
            and last.digest == headers[H_DIGEST]
        ):
            return last.stream_seq
        return None

    async def _settle_duplicate(self, session_id: str, stream_seq: int, headers: dict[str, str], first_seq: int) -> int:
        try:
            raw = await self._reader.leader_get(seq=stream_seq)
        except LogUnavailable:  # as in `_landed`: settled on a later attempt
            raise _Retry from None
        if raw is not None and raw.headers.get(H_DIGEST) == headers[H_DIGEST]:
            return stream_seq
        raise Conflict(
            f"session {session_id}: the stream holds a different record under message id "
            f"{headers['Nats-Msg-Id']}; reload and retry",
            seq=first_seq,
        )


class HeaderStore:
    """The headers bucket (KV): one write-once header per session; a session is visible once its header is."""

    def __init__(self, nc: Client, js: JetStreamContext, settings: Settings) -> None:
        self._bucket = settings.kv_sessions
        self._timeout = settings.request_timeout_s
        self._reader = StreamReader(nc, f"KV_{self._bucket}", timeout=settings.request_timeout_s)
        # Built, not looked up (`js.key_value` asks the stream leader for its info): headers are read by direct
        # get, which any replica answers, so a cluster without quorum can still be read.
        self._kv = KeyValue(
            name=self._bucket, stream=f"KV_{self._bucket}", pre=f"$KV.{self._bucket}.", js=js, direct=True
        )

    async def get(self, session_id: str) -> bytes | None:
        """The header's bytes, or None while the session is not visible."""
        try:
            entry = await retry_unanswered(lambda: self._kv.get(session_id), self._timeout)
        except (KeyNotFoundError, NotFoundError):
            return await self._from_leader(session_id)
        value: bytes | None = entry.value
        return value or None

    async def _from_leader(self, session_id: str) -> bytes | None:
        """A header a direct get did not find, asked of the bucket's leader: a follower that has not yet replicated
        a header just written (a fork, then reading the child) answers "not found" (seen on a 3-node cluster).
        Without a leader (no quorum) the follower's answer stands. A key holds one message (write-once headers)."""
        try:
            raw = await self._reader.leader_get(seq=1, next_by_subj=f"$KV.{self._bucket}.{session_id}")
        except LogUnavailable:
            return None
        if raw is None or raw.headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return raw.data or None

    async def create(self, session_id: str, header_raw: bytes) -> None:
        """Make the session visible; `SESSION_ALREADY_EXISTS` when it already is (headers are write-once)."""
        try:
            await self._kv.create(session_id, header_raw)
        except KeyWrongLastSequenceError:
            raise SessionAlreadyExists(f"session {session_id} already exists") from None

    async def session_ids(self) -> list[str]:
        """The id of every session with a header, read by direct gets (which any replica answers), so sessions can
        be listed without quorum."""
        prefix = f"$KV.{self._bucket}."
        headers = await self._reader.latest_values(f"{prefix}>")
        return [subject[len(prefix) :] for subject, data in headers.items() if data]


class BlobStore:
    """Large content in the object store, named by its digest; events reference it by that id."""

    def __init__(self, js: JetStreamContext, settings: Settings) -> None:
        self._js = js
        self._bucket = settings.object_store

    async def put(self, data: bytes, *, media_type: str) -> dict[str, Any]:
        """Store `data` (once: an equal blob already there is kept); the attachment dict events reference."""
        name = "sha256:" + hashlib.sha256(data).hexdigest()
        store = await self._js.object_store(self._bucket)
        with contextlib.suppress(Exception):
            info = await store.get_info(name)
            if info is not None and info.size == len(data):
                return {"attachmentId": name, "mediaType": media_type, "bytes": len(data)}
        await store.put(name, data)
        return {"attachmentId": name, "mediaType": media_type, "bytes": len(data)}

    async def get(self, attachment_id: str) -> bytes:
        store = await self._js.object_store(self._bucket)
        try:
            result = await store.get(attachment_id)
        except NotFoundError:
            raise SessionNotFound(f"no blob {attachment_id}") from None
        data: bytes = result.data or b""
        return data


async def erase(js: JetStreamContext, settings: Settings, session_id: str) -> None:
    """Purge one session's records, raw gateway bytes and header (`PURGE_REFUSED` from streams created with
    `deny_purge`). The headers bucket refuses purge markers (a writer could send one too): its stream is purged,
    last, so a session half erased is still listed."""
    bucket = settings.kv_sessions
    for stream, subject in (
        (settings.stream, events_filter(session_id)),
        (settings.raw_stream, raw_subject(session_id)),
        (f"KV_{bucket}", f"$KV.{bucket}.{session_id}"),
    ):
        try:
            await js.purge_stream(stream, subject=subject)
        except NotFoundError:
            continue
        except nats.js.errors.APIError as err:
            if is_unavailable(err):  # a stream without a leader answers 503: not a refusal
                raise
            raise PurgeRefused(
                f"stream {stream} refuses purges ({err.description}); erasure needs streams created with "
                "SESSIONLOG_ALLOW_PURGE=true"
            ) from None
