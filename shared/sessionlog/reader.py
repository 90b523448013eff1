"""Reading the log from JetStream: one session fast, a prefix, a seq's record, and live subscriptions.

One session is read with batch direct gets built by hand (nats-py has no helper): a request to
`$JS.API.DIRECT.GET.<stream>` with `{"seq", "batch", "next_by_subj", "max_bytes"}` on an inbox, replies until
the `204` end-of-batch message, paging on. Direct gets may be answered by a follower that is behind; when the
caller knows a stream sequence it must see (`min_stream_seq`), a batch that ends short of it is re-read from
the leader (`$JS.API.STREAM.MSG.GET`), which is never stale.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api

from .audit import RawAssembler, RawExchange
from .availability import retry_unanswered, translates_unavailable, unavailable_as_typed
from .errors import CorruptLog, LogUnavailable
from .provision import stored_subject
from .record import ALL_EVENTS, Record, decode_record, events_filter, partition_filter, raw_subject

log = logging.getLogger("sessionlog.reader")

BATCH: Final = 256
BATCH_MAX_BYTES: Final = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RawMessage:
    stream_seq: int
    subject: str
    headers: dict[str, str]
    data: bytes


class StreamReader:
    """Reads records of the event stream for any session, partition or the whole stream."""

    def __init__(self, nc: Client, stream: str, *, timeout: float = 5.0) -> None:
        self._nc = nc
        self._stream = stream
        self._timeout = timeout
        # The stream's partition count, once known for sure (`SessionLog` sets it when connecting verified the
        # stream): then one session is read by its literal stored subject, else by the wildcard over partitions.
        self.partition_count: int | None = None

    def session_subject(self, session_id: str) -> str:
        """The subject filter one session is read by. A literal subject is what the server finds fastest: among
        thousands of interleaved sessions, a wildcard is matched against every record between two of this
        session's: on a 100,000-record stream of 10,000 sessions a read took 7.7x as long (bench_log,
        `read_interleaved`)."""
        if self.partition_count is None:
            return events_filter(session_id)
        return stored_subject(session_id, self.partition_count)

    # ---------------------------------------------------------------------------------- low level

    @translates_unavailable("direct get of {subject_filter} on stream {self._stream}")
    async def direct_batch(
        self, subject_filter: str, start_seq: int, *, batch: int = BATCH, max_bytes: int = BATCH_MAX_BYTES
    ) -> tuple[list[RawMessage], int]:
        """One batch of messages matching `subject_filter` from stream seq `start_seq` on.

        Returns the messages and the number still pending after them (0 at the end of the stream).
        """
        return await retry_unanswered(
            lambda: self._direct_batch(subject_filter, start_seq, batch=batch, max_bytes=max_bytes), self._timeout
        )

    async def _direct_batch(
        self, subject_filter: str, start_seq: int, *, batch: int, max_bytes: int
    ) -> tuple[list[RawMessage], int]:
        # The replies are taken by the subscription's callback: nats-py's `next_msg` makes two tasks and a timer
        # for every message, which cost more than the rest of reading a session of a hundred records.
        loop = asyncio.get_running_loop()
        out: list[RawMessage] = []
        ended: asyncio.Future[dict[str, str]] = loop.create_future()
        heard = loop.time()

        async def on_msg(msg: Msg) -> None:
            nonlocal heard
            heard = loop.time()
            headers = msg.headers
            if headers is None or "Status" not in headers:
                out.append(_raw_of(msg))
            elif not ended.done():
                ended.set_result(headers)

        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox, cb=on_msg)
        try:
            request = {"seq": start_seq, "batch": batch, "next_by_subj": subject_filter, "max_bytes": max_bytes}
            await self._nc.publish(f"$JS.API.DIRECT.GET.{self._stream}", json.dumps(request).encode(), reply=inbox)
            while not ended.done():  # a batch may take long as a whole: what times out is a wait that hears nothing
                await asyncio.wait((ended,), timeout=max(0.0, heard + self._timeout - loop.time()))
                if not ended.done() and loop.time() - heard >= self._timeout:
                    if self._nc.is_closed:
                        raise nats.errors.ConnectionClosedError
                    raise nats.errors.TimeoutError
        finally:
            await sub.unsubscribe()
        headers = ended.result()
        status = headers["Status"]
        if status == "204":  # end of batch
            return out, int(headers.get("Nats-Num-Pending", "0"))
        if status == "404":  # nothing (more) matches
            return out, 0
        if status == "503" and not out:  # no responders: nobody serves direct gets right now
            raise nats.errors.NoRespondersError
        raise LogUnavailable(f"direct get on {self._stream} answered {status}: {headers}")

    async def scan(self, subject_filter: str, start_seq: int = 1) -> AsyncGenerator[RawMessage, None]:
        """Every message matching the filter from stream seq `start_seq` to the end, in order, a batch direct get
        at a time (the caller may stop early)."""
        while True:
            batch, pending = await self.direct_batch(subject_filter, start_seq)
            for msg in batch:
                yield msg
            if not batch or pending == 0:
                return
            start_seq = batch[-1].stream_seq + 1

    async def latest_values(self, subject_filter: str) -> dict[str, bytes]:
        """The last message of each subject matching the filter (the current entries of a KV bucket, read on its
        stream), by batch direct gets: no consumer to create, and any replica answers, so it reads without quorum.
        A subject whose last message is a delete or purge marker is left out."""
        latest: dict[str, bytes] = {}
        async for msg in self.scan(subject_filter):
            if msg.headers.get("KV-Operation") in ("DEL", "PURGE"):
                latest.pop(msg.subject, None)
            else:
                latest[msg.subject] = msg.data
        return latest

    @translates_unavailable("read stream {self._stream} from its leader")
    async def leader_get(self, *, seq: int | None = None, next_by_subj: str | None = None) -> RawMessage | None:
        """One message from the stream leader (never stale), or None when nothing matches."""
        request: dict[str, Any] = {}
        if seq is not None:
            request["seq"] = seq
        if next_by_subj is not None:
            request["next_by_subj"] = next_by_subj
        subject, payload = f"$JS.API.STREAM.MSG.GET.{self._stream}", json.dumps(request).encode()
        reply = await retry_unanswered(lambda: self._nc.request(subject, payload, timeout=self._timeout), self._timeout)
        body = json.loads(reply.data)
        if "error" in body:
            if body["error"].get("code") == 404:
                return None
            raise LogUnavailable(f"stream msg get on {self._stream} failed: {body['error']}")
        message = body["message"]
        headers = _parse_header_block(base64.b64decode(message["hdrs"])) if message.get("hdrs") else {}
        data = base64.b64decode(message.get("data", ""))
        return RawMessage(stream_seq=message["seq"], subject=message["subject"], headers=headers, data=data)

    @translates_unavailable("direct get of the last {subject_filter} on stream {self._stream}")
    async def last_of(self, subject_filter: str) -> RawMessage | None:
        """The newest message matching the filter (direct get `last_by_subj`)."""
        subject, request = f"$JS.API.DIRECT.GET.{self._stream}", json.dumps({"last_by_subj": subject_filter}).encode()
        reply = await retry_unanswered(lambda: self._nc.request(subject, request, timeout=self._timeout), self._timeout)
        headers = reply.headers or {}
        if headers.get("Status") == "404":
            return None
        if headers.get("Status") is not None:
            raise LogUnavailable(f"direct get on {self._stream} answered {headers.get('Status')}")
        return _raw_of(reply)

    # ---------------------------------------------------------------------------------- sessions

    @translates_unavailable("read session {session_id}")
    async def records(
        self, session_id: str, *, from_stream_seq: int = 1, min_stream_seq: int = 0, up_to_seq: int | None = None
    ) -> list[Record]:
        """Every record of one session in order, from `from_stream_seq`, stopping once `up_to_seq` (a session
        seq, inclusive) is covered. `min_stream_seq` is a stream sequence the answer must reach."""
        subject = self.session_subject(session_id)
        out: list[Record] = []
        start = from_stream_seq
        while True:
            batch, pending = await self.direct_batch(subject, start)
            for raw in batch:
                out.append(decode_record(raw.stream_seq, raw.subject, raw.headers, raw.data))
                if up_to_seq is not None and out[-1].next_seq > up_to_seq:
                    return out
            if batch:
                start = batch[-1].stream_seq + 1
            if not batch or pending == 0:
                break
        if min_stream_seq and (not out or out[-1].stream_seq < min_stream_seq):
            out.extend(await self._records_from_leader(subject, start if out else from_stream_seq, min_stream_seq))
        _check_contiguous(session_id, out, from_start=from_stream_seq <= 1)
        return out

    async def _records_from_leader(self, subject: str, start: int, min_stream_seq: int) -> list[Record]:
        """The tail a stale follower did not have, read from the leader one record at a time."""
        out: list[Record] = []
        while True:
            raw = await self.leader_get(seq=start, next_by_subj=subject)
            if raw is None:
                break
            out.append(decode_record(raw.stream_seq, raw.subject, raw.headers, raw.data))
            start = raw.stream_seq + 1
        if not out or out[-1].stream_seq < min_stream_seq:
            raise LogUnavailable(f"the log does not reach stream seq {min_stream_seq} for {subject} even on the leader")
        return out

    @translates_unavailable("read session {session_id}")
    async def events(self, session_id: str, *, up_to_seq: int | None = None, min_stream_seq: int = 0) -> list[bytes]:
        """The session's event bytes in order; the prefix ending at `up_to_seq` (inclusive) when given."""
        records = await self.records(session_id, up_to_seq=up_to_seq, min_stream_seq=min_stream_seq)
        events = [e for r in records for e in r.events]
        if up_to_seq is not None:
            del events[up_to_seq + 1 :]
        return events

    @translates_unavailable("read the last record of session {session_id}")
    async def last_record(self, session_id: str) -> Record | None:
        raw = await self.last_of(self.session_subject(session_id))
        return None if raw is None else decode_record(raw.stream_seq, raw.subject, raw.headers, raw.data)

    @translates_unavailable("find seq {seq} of session {session_id}")
    async def record_of(self, session_id: str, seq: int) -> Record | None:
        """The record holding session seq `seq`, found by binary search over stream sequences: each probe is one
        direct get of the session's next record at or after a stream seq, so the cost is O(log n) gets."""
        last = await self.last_record(session_id)
        if last is None or seq >= last.next_seq or seq < 0:
            return None
        if seq >= last.first_seq:
            return last
        lo, hi = 1, last.stream_seq
        found: Record | None = None
        subject = self.session_subject(session_id)
        while lo <= hi:
            mid = (lo + hi) // 2
            batch, _ = await self.direct_batch(subject, mid, batch=1)
            if not batch:
                hi = mid - 1
                continue
            record = decode_record(batch[0].stream_seq, batch[0].subject, batch[0].headers, batch[0].data)
            if record.first_seq > seq:
                hi = mid - 1
            elif record.next_seq <= seq:
                lo = record.stream_seq + 1
            else:
                found = record
                break
        return found

    # ---------------------------------------------------------------------------------- live

    async def subscribe(
        self,
        *,
        session_id: str | None = None,
        partition: int | None = None,
        from_stream_seq: int = 1,
        queue_size: int = 1024,
    ) -> AsyncIterator[Record]:
        """Records of one session, one partition or the whole stream, from a stream sequence on, live.

        An ordered push consumer: the client re-creates it from the last seen sequence after a gap, so records
        arrive once and in order. Stop by closing the iterator.
        """
        if session_id is not None:
            subject = self.session_subject(session_id)
        elif partition is not None:
            subject = partition_filter(partition)
        else:
            subject = ALL_EVENTS
        js = self._nc.jetstream()
        with unavailable_as_typed(f"follow {subject} on stream {self._stream}"):
            sub = await js.subscribe(
                subject,
                stream=self._stream,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                config=api.ConsumerConfig(opt_start_seq=max(1, from_stream_seq)),
                pending_msgs_limit=queue_size,
            )
        try:
            async for msg in sub.messages:
                meta = msg.metadata
                yield decode_record(meta.sequence.stream, msg.subject, msg.headers, msg.data)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


def _raw_of(msg: Msg) -> RawMessage:
    headers = dict(msg.headers or {})
    return RawMessage(
        stream_seq=int(headers.get("Nats-Sequence", "0")),
        subject=headers.get("Nats-Subject", msg.subject),
        headers=headers,
        data=msg.data,
    )


def _parse_header_block(block: bytes) -> dict[str, str]:
    """`NATS/1.0\\r\\nKey: Value\\r\\n...` as returned base64-encoded by the stream msg get API."""
    headers: dict[str, str] = {}
    for line in block.decode().split("\r\n")[1:]:
        if ":" in line:
            key, _, value = line.partition(":")
            headers[key.strip()] = value.strip()
    return headers


def _check_contiguous(session_id: str, records: list[Record], *, from_start: bool) -> None:
    """Records of one session must continue each other exactly; from the stream's start they begin at seq 0."""
    expected = 0 if from_start else (records[0].first_seq if records else 0)
    for record in records:
        if record.first_seq != expected:
            raise CorruptLog(
                f"session {session_id}: record at stream seq {record.stream_seq} starts at seq {record.first_seq}, "
                f"expected {expected}",
                seq=expected,
            )
        expected = record.next_seq


async def read_raw_exchanges(
    nc: Client, raw_stream: str, session_id: str, *, timeout: float = 5.0
) -> list[RawExchange]:
    """Every complete exchange the gateway tee recorded for one session, read from the raw stream (direct gets)."""
    reader = StreamReader(nc, raw_stream, timeout=timeout)
    assembler = RawAssembler()
    out: list[RawExchange] = []
    end = 1
    subject = raw_subject(session_id)
    async for message in reader.scan(subject):
        out += assembler.take(message.headers, message.data)
        end = message.stream_seq + 1
    out += await read_raw_bases(reader, assembler, subject, until_seq=end)
    return out


async def read_raw_bases(
    reader: StreamReader, assembler: RawAssembler, subject: str, *, until_seq: int
) -> list[RawExchange]:
    """Read a session's raw subject again, from where `assembler.wanted()` says up to before `until_seq`, for the
    bases of the deltas it could not rebuild; what still lacks a base then ends without request bytes (its root is
    gone from the stream). The exchanges this completes."""
    out: list[RawExchange] = []
    start = assembler.wanted()
    if start is not None and start < until_seq:
        async with contextlib.aclosing(reader.scan(subject, start)) as messages:
            async for message in messages:
                if message.stream_seq >= until_seq or assembler.wanted() is None:
                    break
                out += assembler.take_base(message.headers, message.data)
    if assembler.wanted() is not None:
        log.warning("raw tee of %s: a request stored as a delta lacks its base on the stream; read without its bytes",
                    subject)  # fmt: skip
        out += assembler.give_up()
    return out


class RawFeed:
    """The raw tee's exchanges from its messages taken in stream order, starting anywhere (a feed resuming from its
    checkpoint): a delta whose base came before the first message taken is rebuilt by reading its session's subject
    again from the chain's root (`read_raw_bases`)."""

    def __init__(self, reader: StreamReader) -> None:
        self.assembler = RawAssembler()
        self._reader = reader

    async def take(self, subject: str, stream_seq: int, headers: dict[str, str], data: bytes) -> list[RawExchange]:
        """The exchanges one message (at `stream_seq` on `subject`) completes."""
        exchanges = self.assembler.take(headers, data)
        if self.assembler.wanted() is not None:
            exchanges += await read_raw_bases(self._reader, self.assembler, subject, until_seq=stream_seq)
        return exchanges
