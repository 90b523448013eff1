"""context-deriver: keeps each session's surface and derived messages, and answers `sessionlog.context.*`.

Endpoints (NATS micro service `sessionlog-context`, queue group, any replica answers):
- `derive` `{"session", "min_seq"?, "at_seq"?, "timeout_ms"?, "page"?}` ->
  `{"session", "seq", "generation", "messages", "header", "sha256", "open_step", "next_page"?}`; with `min_seq` it waits
  (bounded) until it has applied that seq, so a writer that has just flushed reads its own writes. `messages`
  are canonical JSON; `sha256` is over the canonical JSON of the whole array, whatever page is asked for.
- `plan_replace` `{"session", "event"}` -> `{"accepted", "shadowed", "error"?}`: a dry run of a compaction.
- `stats` `{}` -> sessions held, memory, lag, partitions owned.

A replica that owns the session's partition answers from memory; any other answers from the stream.
"""

from __future__ import annotations

from .service import ContextDeriver, ContextDeriverService, DeriverState

__all__ = ["ContextDeriver", "ContextDeriverService", "DeriverState"]
