"""What every page shares: the security headers, escaping, the HTML document around a page, and the frame of a
session's tabs (identity, state, tabs, the timeline strip, lineage) as `SessionContext` describes it."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from html import escape
from typing import Any, Final
from urllib.parse import quote

from sessionlog.jsonl import SessionHeader

from ..charts import timeline_strip
from ..views import Request

CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS: Final = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}

SYNTHETIC_TEXT: Final = {
    "TOOL_OUTCOME_UNKNOWN": "synthetic result: the turn was interrupted after the call was recorded; its outcome is "
    "unknown",
    "TOOL_NOT_STARTED": "synthetic result: the turn was interrupted before the tool started",
}


def esc(text: object) -> str:
    return escape(str(text), quote=True)


def when(ms: int | None) -> str:
    if ms is None:
        return ""
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def session_href(session_id: str) -> str:
    return "/sessions/" + quote(session_id, safe="")


# ---------------------------------------------------------------------------------------------- a session's tabs

TABS: Final = (("transcript", "Transcript", ""), ("context", "Model's view", "/context"), ("audit", "Audit", "/audit"))


@dataclass(frozen=True)
class SessionContext:
    """What every tab of a session page shows around its view: identity, state, lineage and the timeline."""

    session_id: str
    title: str | None
    header: SessionHeader
    events: int
    open_turn: int | None
    lease_holder: str | None
    last_activity: int | None
    children: list[str]
    ancestors: list[str]
    requests: list[Request]
    compactions: list[dict[str, Any]]
    tab: str
    at: int | None = None
    header_seqs: tuple[int, ...] = ()


def html_page(title: str, body: str, *, body_attrs: str = "", wide: bool = False) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · sessionlog</title>"
        '<link rel="stylesheet" href="/static/app.css"><script src="/static/app.js" defer></script>'
        f'</head><body{body_attrs}><div class="bar"><a class="brand" href="/">sessionlog</a>'
        '<a href="/">fleet</a><a href="/api/health">health JSON</a></div>'
        f'<div class="wrap{" wide" if wide else ""}">{body}</div></body></html>'
    )


def state_badge(open_turn: int | None, error: str | None = None) -> str:
    if error:  # a session that does not read: its code, the message on hover
        return f'<span class="badge corrupt" title="{esc(error)}">{esc(error.split(":", 1)[0])}</span>'
    if open_turn:
        return f'<span class="badge open-turn">turn {open_turn} open</span>'
    return '<span class="badge closed">closed</span>'


def num(value: int | float | None) -> str:
    if value is None:
        return '<span class="muted">—</span>'
    if isinstance(value, float):  # money: enough digits that a small session's cost is not 0.0000
        return f"{value:,.2f}" if value >= 1 else f"{value:.6f}".rstrip("0").rstrip(".") or "0"
    return f"{value:,}"


def plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def lineage(ctx: SessionContext) -> str:
    if not ctx.ancestors and not ctx.children:
        return ""
    inner = f'<li class="self"><code>{esc(ctx.session_id)}</code> <span class="muted">this session</span>'
    if ctx.children:
        kids = "".join(
            f'<li><a class="child" href="{session_href(c)}">{esc(c)}</a> <span class="muted">fork</span></li>'
            for c in ctx.children[:50]
        )
        more = f'<li class="muted">and {len(ctx.children) - 50} more</li>' if len(ctx.children) > 50 else ""
        inner += f"<ul>{kids}{more}</ul>"
    inner += "</li>"
    for ancestor in reversed(ctx.ancestors):
        inner = f'<li><a class="ancestor" href="{session_href(ancestor)}">{esc(ancestor)}</a><ul>{inner}</ul></li>'
    seed = ctx.header.seed_length if isinstance(ctx.header.seed_length, int) else None
    note = f'<div class="muted small">the first {seed} events are inherited from the parent</div>' if seed else ""
    return f'<section class="lineage"><h3>Lineage</h3><ul class="tree">{inner}</ul>{note}</section>'


def _timeline(ctx: SessionContext) -> str:
    base = session_href(ctx.session_id)
    reqs = [
        (r.at, f"request {r.label()} · {r.messages} messages · seq {r.first_chunk}", f"{base}/context?at={r.at}")
        for r in ctx.requests
    ]
    marks = [(c["seq"], f"compaction at seq {c['seq']}: replaced {c['start']}-{c['end']}") for c in ctx.compactions]
    current = ctx.at if ctx.tab == "context" else None
    headers = [(seq, f"request/header at seq {seq}", f"{base}/context?at={seq}") for seq in ctx.header_seqs]
    legend = (
        f'<div class="timeline-legend"><span><i class="dot"></i>{plural(len(ctx.requests), "request")}</span>'
        f'<span><i class="cbar"></i>{plural(len(ctx.compactions), "compaction")}</span>'
        f'<span><i class="hdr"></i>{plural(len(ctx.header_seqs), "request header")}</span>'
        f'<span class="muted">seq 0 … {max(0, ctx.events - 1)}</span></div>'
    )
    return (
        '<section class="timeline-box">'
        + timeline_strip(ctx.events, reqs, marks, headers=headers, current=current)
        + legend
        + "</section>"
    )


def session_top(ctx: SessionContext, *, fork_banner: str = "") -> str:
    sid = ctx.session_id
    title = ctx.title or sid
    holder = (
        f'<span class="badge lease">writer: {esc(ctx.lease_holder)}</span>'
        if ctx.lease_holder
        else '<span class="badge closed">no writer</span>'
    )
    cwd = ctx.header.cwd if isinstance(ctx.header.cwd, str) else None
    facts = [
        f'<code class="session-id">{esc(sid)}</code>',
        f"{ctx.events:,} events",
        state_badge(ctx.open_turn),
        holder,
    ]
    if cwd:
        facts.append(f'<span class="cwd" title="working directory">{esc(cwd)}</span>')
    if ctx.last_activity:
        facts.append(f'<span class="muted">last activity {esc(when(ctx.last_activity))}</span>')
    base = session_href(sid)
    tabs = "".join(
        f'<a class="tab{" active" if ctx.tab == key else ""}" href="{base}{path}">{esc(label)}</a>'
        for key, label, path in TABS
    )
    tabs += (
        f'<a class="tab{" active" if ctx.tab == "raw" else ""}" href="{base}/raw">Raw exchanges</a>'
        f'<span class="tab-json"><a href="/api/sessions/{quote(sid, safe="")}/{_JSON_OF.get(ctx.tab, "transcript")}">'
        "JSON</a></span>"
    )
    return (
        f'<header class="top"><h1>{esc(title)}</h1><div class="sub">{" · ".join(facts)}'
        f'<span id="live-status" class="live-status"></span></div>{fork_banner}</header>'
        f'<div class="layout"><div class="content"><nav class="tabs">{tabs}</nav>{_timeline(ctx)}'
    )


_JSON_OF: Final = {"transcript": "transcript", "context": "context", "audit": "audit", "raw": "raw"}


def session_bottom(ctx: SessionContext, *, side_panel: bool = True) -> str:
    side = lineage(ctx) if side_panel else ""
    return f'</div><aside class="side">{side}</aside></div>' if side else "</div></div>"


def render_error_page(status: int, message: str) -> str:
    body = f'<header class="top"><h1>{status}</h1></header><main><p class="error-text">{esc(message)}</p></main>'
    return html_page(f"{status}", body)
