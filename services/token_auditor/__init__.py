"""token-auditor: per step the raw chunk stream and what it assembles to, per session and model a token ledger, and
findings wherever the log disagrees with itself or with the provider's raw bytes (`sessionlog.audit`).

It follows the event stream through the shared projection runner, and the gateway's raw tee (stream
`SESSIONLOG_RAW`, `sessionlog.raw.<session>`) with an ordered consumer of its own, checkpointed in KV
(`token-auditor.raw`). Findings and token counts are exported as Prometheus metrics, each once per session even when
a session is reloaded.

Endpoint (NATS micro service `sessionlog-audit`, queue group, any replica answers):
`sessionlog.audit.report` `{"session", "min_seq"?, "timeout_ms"?}` ->
`{"session", "seq", "events", "chunks", "steps", "ledger", "findings", "raw_exchanges", "raw_matched"}`. The report
reads the session's raw tee again, so it holds every exchange the tee has even when the feed is behind. A replica
that does not own the session's partition answers from the stream.
"""

from __future__ import annotations

from sessionlog.reader import read_raw_exchanges

from .service import AuditState, TokenAuditor, TokenAuditorService

__all__ = ["AuditState", "TokenAuditor", "TokenAuditorService", "read_raw_exchanges"]
