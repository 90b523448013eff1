"""Checkpoints: the stream seq a feed has applied, kept in KV (`sessionlog-checkpoints`), and the quarantine
entries kept beside them (`QuarantineList`). A write that fails is logged and counted
(`sessionlog_projection_kv_write_failures_total`, by kind), never dropped silently: a failed checkpoint only costs
a longer replay after a restart, since a later write covers it, but an operator must see that it is happening. A
quarantine entry, which no later write covers, is sent again while the log does not answer, for up to `retry_s`
(`SESSIONLOG_PUBLISH_RETRY_S`), in the background."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from .availability import retry_unavailable
from .errors import SessionLogError
from .metrics import KV_WRITE_FAILURES, QUARANTINED
from .quarantine import Quarantined, entries, key
from .tasks import BackgroundWrites

log = logging.getLogger("sessionlog.checkpoints")


class Checkpoints:
    """One projection's entries in the checkpoints bucket."""

    def __init__(
        self, js: JetStreamContext, bucket: str, projection: str, replica_id: str, *, retry_s: float = 30.0
    ) -> None:
        # Built, not looked up (`js.key_value` asks the stream leader for its info, which a cluster without quorum
        # has not): checkpoints are read by direct get, and a start without quorum goes on to answer queries.
        self.kv: Any = KeyValue(name=bucket, stream=f"KV_{bucket}", pre=f"$KV.{bucket}.", js=js, direct=True)
        self.bucket = bucket
        self.projection = projection
        self.replica_id = replica_id
        self.retry_s = retry_s  # how long a quarantine entry is sent again while unanswered
        self._failures = {kind: KV_WRITE_FAILURES.labels(projection, kind) for kind in ("checkpoint", "quarantine")}
        self._writes = BackgroundWrites()

    async def read(self, name: str) -> int:
        """The stream seq checkpointed under `name` (0: none)."""
        try:
            entry = await self.kv.get(name)
            return int(json.loads(entry.value or b"{}").get("stream_seq", 0))
        except (KeyNotFoundError, NotFoundError, ValueError):
            return 0

    async def write(self, name: str, stream_seq: int) -> bool:
        """Checkpoint `stream_seq` under `name`; False (logged and counted) when the write failed."""
        body = json.dumps({"stream_seq": stream_seq, "replica": self.replica_id, "time": time.time()}).encode()
        return await self._put("checkpoint", name, body)

    def quarantine(self, entry: Quarantined) -> None:
        """Keep a quarantine entry, in the background (the partition goes on meanwhile)."""
        name = key(self.projection, entry.stream_seq)
        self._writes.start(self._put("quarantine", name, entry.body(), retry_s=self.retry_s), name=f"keep {name}")

    async def settle(self, timeout_s: float | None = None) -> None:
        """Wait for the quarantine writes in flight, at most `timeout_s`: a write still sent again then (the log
        not answering at shutdown) is given up, logged and counted, so that stopping never waits out its budget."""
        given_up = await self._writes.settle(timeout_s)
        if given_up:
            self._failures["quarantine"].inc(given_up)
            log.warning(
                "%s: %d quarantine writes given up at shutdown (the log did not answer within %ss)",
                self.projection,
                given_up,
                timeout_s,
            )

    async def _put(self, kind: str, name: str, body: bytes, *, retry_s: float = 0.0) -> bool:
        try:
            await retry_unavailable(lambda: self.kv.put(name, body), retry_s)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._failures[kind].inc()
            log.warning("%s: %s write of %s failed: %s", self.projection, kind, name, _text(err))
            return False
        return True


def _text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class QuarantineList:
    """What a projection quarantined: each record listed and counted once (met again on a reload or a replay, it is
    not), kept in KV, and read back from KV at start so health and stats report the same list after a restart.
    Sessions are not poisoned from it: a session touched again meets its bad record again (state is rebuildable)."""

    def __init__(self, nc: Client, checkpoints: Checkpoints, *, timeout: float) -> None:
        self.nc = nc
        self.checkpoints = checkpoints
        self.timeout = timeout
        self.entries: list[Quarantined] = []
        self._seqs: set[int] = set()

    def add(self, entry: Quarantined, *, keep: bool = True) -> None:
        if entry.stream_seq in self._seqs:
            return
        self._seqs.add(entry.stream_seq)
        self.entries.append(entry)
        QUARANTINED.labels(self.checkpoints.projection).inc()
        log.warning(
            "%s: quarantined stream seq %d of session %s: %s",
            self.checkpoints.projection,
            entry.stream_seq,
            entry.session_id,
            entry.reason,
        )
        if keep:
            self.checkpoints.quarantine(entry)

    async def recall(self) -> None:
        projection = self.checkpoints.projection
        try:
            found = await entries(self.nc, self.checkpoints.bucket, projection=projection, timeout=self.timeout)
        except SessionLogError as err:
            log.warning("%s: could not read the quarantine list: %s", projection, err)
            return
        for entry in found:
            if entry.stream_seq not in self._seqs:
                self._seqs.add(entry.stream_seq)
                self.entries.append(entry)
