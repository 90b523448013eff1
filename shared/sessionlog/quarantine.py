"""Quarantined records: what the projections set aside, and why one session does not read.

A projection that cannot apply a record keeps an entry for it in the checkpoints bucket:
`<projection>.quarantine.<stream seq>` = `{"stream_seq", "session", "reason"}`. `entries()` lists them, for an
operator (`sessionlog quarantine list`) and for a runner that restarts and must report what it had set aside.
`check_session()` reads one session's records straight from the stream and names the first that does not decode
or validate: the cause, whatever projection met it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from .availability import translates_unavailable
from .errors import CorruptLog, SessionLogError
from .reader import StreamReader
from .record import Record, decode_record, events_filter
from .session import Session


@dataclass(slots=True)
class Quarantined:
    """One record a projection did not apply, and why."""

    stream_seq: int
    session_id: str
    reason: str
    projection: str = ""

    def body(self) -> bytes:
        """The bucket entry's value (the projection is in its key)."""
        return json.dumps({"stream_seq": self.stream_seq, "session": self.session_id, "reason": self.reason}).encode()

    def to_dict(self) -> dict[str, Any]:
        return {
            "projection": self.projection,
            "stream_seq": self.stream_seq,
            "session": self.session_id,
            "reason": self.reason,
        }


def key(projection: str, stream_seq: int) -> str:
    return f"{projection}.quarantine.{stream_seq}"


@translates_unavailable("list quarantined records in bucket {bucket}")
async def entries(nc: Client, bucket: str, *, projection: str | None = None, timeout: float = 5.0) -> list[Quarantined]:
    """Every quarantined record in the bucket (of one projection, or of all), by projection then stream seq.

    Read by batch direct gets on the bucket's stream: no consumer to create (a projection's NATS user may not),
    and any replica answers, so the list reads without quorum too."""
    prefix = f"$KV.{bucket}."
    found = await StreamReader(nc, f"KV_{bucket}", timeout=timeout).latest_values(
        f"{prefix}{projection or '*'}.quarantine.*"
    )
    latest = {subject[len(prefix) :]: value for subject, value in found.items()}
    out: list[Quarantined] = []
    for name, value in latest.items():
        owner, _, _ = name.partition(".quarantine.")
        try:
            body = json.loads(value or b"{}")
            out.append(Quarantined(int(body["stream_seq"]), str(body["session"]), str(body["reason"]), owner))
        except (ValueError, KeyError, TypeError):
            continue  # not an entry this build wrote
    out.sort(key=lambda q: (q.projection, q.stream_seq))
    return out


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What reading one session from the stream found: how far it reads, and the first record that does not."""

    session_id: str
    records: int  # records that read
    events: int  # events that validated
    stream_seq: int | None = None  # the first record that does not read
    subject: str | None = None
    error: SessionLogError | None = None

    @property
    def readable(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "session": self.session_id,
            "readable": self.readable,
            "records": self.records,
            "events": self.events,
        }
        if self.error is not None:
            out.update(stream_seq=self.stream_seq, subject=self.subject, error=self.error.to_dict())
        return out


async def check_session(reader: Any, session_id: str) -> Diagnosis:
    """Read the session record by record (a `StreamReader`), validating every event; stop at the first failure.

    Takes any session id the stream holds, including one the API would refuse. `LOG_UNAVAILABLE` is raised,
    never reported as a finding."""
    session = Session()
    records = 0
    start = 1
    subject_filter = events_filter(session_id)
    while True:
        batch, pending = await reader.direct_batch(subject_filter, start)
        for raw in batch:
            try:
                record: Record = decode_record(raw.stream_seq, raw.subject, raw.headers, raw.data)
                if record.first_seq != len(session):
                    raise CorruptLog(
                        f"record at stream seq {record.stream_seq} starts at seq {record.first_seq}, expected "
                        f"{len(session)}",
                        seq=len(session),
                    )
                for event in record.events:
                    session.append(event)
            except SessionLogError as err:
                return Diagnosis(session_id, records, len(session), raw.stream_seq, raw.subject, err)
            records += 1
        if not batch or pending == 0:
            return Diagnosis(session_id, records, len(session))
        start = batch[-1].stream_seq + 1
