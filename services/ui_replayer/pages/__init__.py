"""The ui-replayer's pages as pure functions of their views (transcript, model's view, audit, raw exchanges, fleet).

Everything a session holds is escaped on the way into HTML (`html.escape`, quotes included); nothing from a log
is ever placed in a script, a style or an attribute other than escaped `data-*`, `id`, `class` tokens and link
targets built from validated session ids. The script (`static/app.js`, served from `/static/app.js`, so the
Content-Security-Policy can forbid inline scripts altogether) builds new entries with `textContent` only, mirroring
`transcript.render_entry`.
"""

from __future__ import annotations

from .audit import render_audit_page, render_raw_page
from .context import render_context_page
from .fleet import render_fleet_page
from .frame import SECURITY_HEADERS, SessionContext, render_error_page
from .transcript import render_transcript_page

__all__ = [
    "SECURITY_HEADERS",
    "SessionContext",
    "render_audit_page",
    "render_context_page",
    "render_error_page",
    "render_fleet_page",
    "render_raw_page",
    "render_transcript_page",
]
