"""Records: one JetStream message carries a contiguous run of one session's events (ARCHITECTURE.md).

The payload is a JSON array of the events' original bytes, so a record is atomic by construction: a batch
lands whole or not at all. Headers say what the payload holds; `Sessionlog-Digest` (SHA-256 of the payload)
lets a writer tell, after a timeout, whether a stored record is its own. A record may carry no events: a new
tenure's fence (log.py), which readers pass over like any record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from .errors import CorruptLog, EventTooDeep
from .events import MAX_EVENT_DEPTH

FORMAT: Final = "1"
H_FORMAT: Final = "Sessionlog-Format"
H_FIRST_SEQ: Final = "Sessionlog-First-Seq"
H_COUNT: Final = "Sessionlog-Count"
H_WRITER: Final = "Sessionlog-Writer"
H_DIGEST: Final = "Sessionlog-Digest"
H_OPEN_TURN: Final = "Sessionlog-Open-Turn"
H_MSG_ID: Final = "Nats-Msg-Id"
H_EXPECTED_LAST_SUBJECT_SEQ: Final = "Nats-Expected-Last-Subject-Sequence"

# Bytes a record's headers and framing may take beyond its payload; a record never passes max_payload.
HEADER_ALLOWANCE: Final = 1024

_events_decoder: Final = msgspec.json.Decoder(list[msgspec.Raw])


def in_subject(session_id: str) -> str:
    """Where writers publish; the stream's subject transform files it under its partition."""
    return f"sessionlog.in.{session_id}"


def events_filter(session_id: str) -> str:
    """The stored subjects of one session, whatever its partition."""
    return f"sessionlog.events.*.{session_id}"


def partition_filter(partition: int) -> str:
    return f"sessionlog.events.{partition}.>"


ALL_EVENTS: Final = "sessionlog.events.>"


# The raw tee's headers (the gateway writes them, the token-auditor reads them): every forwarded request is two
# entries on `sessionlog.raw.<session>`, kind `request` then kind `response`, each possibly split into parts.
H_RAW_REQUEST_ID: Final = "Sessionlog-Request-Id"
H_RAW_KIND: Final = "Sessionlog-Kind"
H_RAW_PART: Final = "Sessionlog-Part"
H_RAW_PARTS: Final = "Sessionlog-Parts"
H_RAW_SESSION_SEQ: Final = "Sessionlog-Session-Seq"
H_RAW_STATUS: Final = "Sessionlog-Upstream-Status"
H_RAW_OUTCOME: Final = "Sessionlog-Outcome"
# A request entry may be stored as a delta of the session's previous one (an agent's next request repeats its
# context): its data is then only what follows the first `Sessionlog-Base-Prefix` bytes of the body of request
# `Sessionlog-Base`, the whole body is `Sessionlog-Size` bytes, and the chain of deltas it ends starts with a whole
# entry at stream seq `Sessionlog-Root-Seq` (where a reader that lacks the base reads the session's subject from).
H_RAW_BASE: Final = "Sessionlog-Base"
H_RAW_BASE_PREFIX: Final = "Sessionlog-Base-Prefix"
H_RAW_SIZE: Final = "Sessionlog-Size"
H_RAW_ROOT_SEQ: Final = "Sessionlog-Root-Seq"


def raw_subject(session_id: str) -> str:
    """The raw audit stream's subject of one session: the gateway's exact request and response bytes."""
    return f"sessionlog.raw.{session_id}"


def session_of_subject(subject: str) -> str:
    """`sessionlog.events.<p>.<id>` -> `<id>`."""
    return subject.rsplit(".", 1)[-1]


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def encode_payload(events: Sequence[bytes]) -> bytes:
    return b"[" + b",".join(events) + b"]"


def msg_id(session_id: str, first_seq: int, count: int, epoch: int) -> str:
    """Names exactly one record: epoch-qualified so a fenced writer reusing `<session>:<seq>` is never told
    `duplicate` for a record it never wrote (a cluster runs the duplicate check before the sequence check), and
    count-qualified so a tenure's fence (an empty record, see log.py) and its first record differ."""
    return f"{session_id}:{first_seq}+{count}:{epoch}"


def record_headers(
    *, session_id: str, first_seq: int, count: int, epoch: int, payload: bytes, expected_last: int, open_turn: int
) -> dict[str, str]:
    return {
        H_FORMAT: FORMAT,
        H_FIRST_SEQ: str(first_seq),
        H_COUNT: str(count),
        H_WRITER: str(epoch),
        H_DIGEST: digest(payload),
        H_OPEN_TURN: str(open_turn),
        H_MSG_ID: msg_id(session_id, first_seq, count, epoch),
        H_EXPECTED_LAST_SUBJECT_SEQ: str(expected_last),
    }


class Record(msgspec.Struct, frozen=True):
    """One stored record: where it sits in the stream and the session events it carries."""

    stream_seq: int
    subject: str
    first_seq: int
    events: tuple[bytes, ...]
    epoch: int
    digest: str
    open_turn: int
    payload_size: int

    @property
    def session_id(self) -> str:
        return session_of_subject(self.subject)

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)


def decode_record(stream_seq: int, subject: str, headers: Mapping[str, str] | None, payload: bytes) -> Record:
    """Check a stored message's headers and payload and cut it into event bytes; `CORRUPT_LOG` if it is not a
    record this build reads or does not match its own headers."""
    where = f"stream seq {stream_seq} ({subject})"
    if not headers or headers.get(H_FORMAT) != FORMAT:
        raise CorruptLog(f"{where}: not a sessionlog record (missing or unknown {H_FORMAT})")
    try:
        first_seq = int(headers[H_FIRST_SEQ])
        count = int(headers[H_COUNT])
        epoch = int(headers.get(H_WRITER, "0"))
        open_turn = int(headers.get(H_OPEN_TURN, "0"))
        expected_digest = headers[H_DIGEST]
    except (KeyError, ValueError) as exc:
        raise CorruptLog(f"{where}: bad record header {exc}") from None
    actual = digest(payload)
    if actual != expected_digest:
        raise CorruptLog(f"{where}: payload digest {actual[:12]}... does not match header {expected_digest[:12]}...")
    try:
        events = tuple(bytes(raw) for raw in _events_decoder.decode(payload))
    except msgspec.DecodeError as exc:
        raise CorruptLog(f"{where}: payload is not a JSON array of events: {exc}") from None
    except RecursionError:
        # Splitting recurses into each event; one far past the limit meets Python's own first. Events within
        # reach are checked one by one when decoded (events.check_depth), so no record pays for a scan here.
        raise EventTooDeep(
            f"{where}: an event nests more than {MAX_EVENT_DEPTH} levels of JSON objects and arrays"
        ) from None
    if len(events) != count:
        raise CorruptLog(f"{where}: header says {count} events, payload holds {len(events)}")
    return Record(
        stream_seq=stream_seq,
        subject=subject,
        first_seq=first_seq,
        events=events,
        epoch=epoch,
        digest=actual,
        open_turn=open_turn,
        payload_size=len(payload),
    )
