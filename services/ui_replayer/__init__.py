"""ui-replayer: the transcript as the user saw it, as web pages, JSON and a live tail.

It keeps, per session, the validated log and its transcript (`sessionlog.transcript`: append-origin messages,
turn outcomes, streamed text, forks, compaction markers) through the shared projection runner, and serves
(Starlette on uvicorn, `SESSIONLOG_UI_HOST`:`SESSIONLOG_UI_PORT`):

- `/` the sessions, newest first, with search (`?q=`) and open turns flagged; `/api/sessions` the same as JSON;
- `/sessions/{id}` the transcript page (`?at=SEQ` replays the prefix ending at SEQ);
- `/sessions/{id}/events?from_seq=N` the live tail as Server-Sent Events: `entry` events (a new or changed entry,
  JSON, replacing any entry with the same key), `delta` events (text appended to a streaming block) and a `sync`
  event after the catch-up; every event's `id` is the seq the page has seen everything before, so a reconnect
  (`Last-Event-ID`) resumes exactly;
- `/api/sessions/{id}/transcript?from_seq=N&at=SEQ` the transcript as JSON.

Every page sets a Content-Security-Policy that allows only the app's own script and style; the script builds new
entries with `textContent`, so a message holding HTML or a script shows as text.
"""

from __future__ import annotations

from typing import Any

from sessionlog.log import SessionLog

from .service import UIReplayer, UIReplayerService, UIState

__all__ = ["UIReplayer", "UIReplayerService", "UIState", "serve"]


async def serve(log: SessionLog, **options: Any) -> UIReplayerService:
    service = UIReplayerService(log, **options)
    await service.start()
    return service
