"""ui-replayer: the operator's web UI. Every view is a projection of the one log, served as pages, JSON and live
updates.

It keeps, per session, the validated log, its transcript (`sessionlog.transcript`) and its audit
(`sessionlog.audit.SessionAuditor`: requests, usage, findings) through the shared projection runner, plus an index of
every session (`fleet.FleetIndex`), and serves (Starlette on uvicorn, `SESSIONLOG_UI_HOST`:`SESSIONLOG_UI_PORT`):

- `/` the fleet: sessions by last activity with state, writer lease holder, tokens, findings, parent, cwd; search
  (`?q=`), `?state=open|closed|forks|findings`, `?page=N`; the deployment's health beside it; `/events` its live
  rows (SSE); `/api/fleet`, `/api/sessions` (the rows) and `/api/health` as JSON;
- `/sessions/{id}` the transcript (`?at=SEQ` replays a prefix, `?before=SEQ` pages back), live over
  `/sessions/{id}/events` (SSE: `entry`, `delta` and `sync` events whose `id` is the seq seen so far, so a reconnect
  resumes exactly);
- `/sessions/{id}/context?at=SEQ` the model's view at a request (`views.context_view`: one `Session.derive_at`),
  `/sessions/{id}/audit` the ledger with its charts, `/sessions/{id}/raw` the gateway's raw exchanges against the
  log's derivation; each tab shows the timeline (requests, compactions) and the fork lineage;
- `/api/sessions/{id}/{transcript,context,audit,raw,requests,lineage}` every view as JSON.

Every page sets a Content-Security-Policy that allows only the app's own script and style; everything from the log
is escaped on the server, and the script builds live content with `textContent` only.
"""

from __future__ import annotations

from .service import UIReplayer, UIReplayerService, UIState

__all__ = ["UIReplayer", "UIReplayerService", "UIState"]
