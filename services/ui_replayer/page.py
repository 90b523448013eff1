"""The ui-replayer's pages as pure functions of the transcript model, and the static CSS and script.

Everything a session holds is escaped on the way into HTML (`html.escape`, quotes included); nothing from a log
is ever placed in a script, a style or an attribute other than escaped `data-*`, `id`, `class` tokens and link
targets built from validated session ids. The script (served from `/static/app.js`, so the Content-Security-Policy
can forbid inline scripts altogether) builds new entries with `textContent` only, mirroring `render_entry`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from html import escape
from importlib import resources
from typing import Final
from urllib.parse import quote

from sessionlog.log import SessionInfo
from sessionlog.transcript import (
    CompactionEntry,
    Entry,
    MessageEntry,
    NoteEntry,
    SeedEntry,
    ShownBlock,
    StreamEntry,
    Transcript,
    TurnEndEntry,
    TurnStartEntry,
)

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
STREAM_STATE_TEXT: Final = {
    "streaming": "streaming…",
    "finished": "response complete",
    "failed": "response failed",
    "retried": "response failed, retried",
    "cut": "response cut off (no message was written)",
}
OUTCOME_TEXT: Final = {
    "completed": "completed",
    "aborted": "aborted",
    "blocked": "blocked",
    "error": "ended with an error",
    "max-tokens": "stopped at the token limit",
    "interrupted": "interrupted by a crash",
}


def _e(text: object) -> str:
    return escape(str(text), quote=True)


def _when(ms: int | None) -> str:
    if ms is None:
        return ""
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def session_href(session_id: str) -> str:
    return "/sessions/" + quote(session_id, safe="")


# ---------------------------------------------------------------------------------------------- entries


def render_block(block: ShownBlock, index: int | None = None) -> str:
    at = f' data-index="{index}"' if index is not None else ""
    kind = block.type
    if kind == "text":
        return f'<div class="block text"{at}><div class="body">{_e(block.text)}</div></div>'
    if kind == "reasoning":
        return (
            f'<details class="block reasoning"{at}><summary>thinking</summary>'
            f'<div class="body">{_e(block.text)}</div></details>'
        )
    if kind == "tool-call":
        return (
            f'<div class="block tool-call"{at}><div class="tool-head">tool call '
            f'<b class="tool-name">{_e(block.name or "")}</b> <code class="call-id">{_e(block.id or "")}</code></div>'
            f'<pre class="body args">{_e(block.text)}</pre></div>'
        )
    if kind == "tool-result":
        error = " error" if block.is_error else ""
        flag = ' <span class="badge error">error</span>' if block.is_error else ""
        return (
            f'<div class="block tool-result{error}"{at}><div class="tool-head">result of '
            f'<code class="call-id">{_e(block.tool_call_id or "")}</code>{flag}</div>'
            f'<pre class="body">{_e(block.text)}</pre></div>'
        )
    if kind == "image":
        return f'<div class="block image"{at}><div class="body">[image {_e(block.attachment or "?")}]</div></div>'
    return f'<div class="block other"{at}><div class="body">{_e(block.text)}</div></div>'


def _blocks(blocks: Sequence[ShownBlock], *, indexed: bool = False) -> str:
    return "".join(render_block(b, i if indexed else None) for i, b in enumerate(blocks))


def _open(entry: Entry, classes: str, tag: str = "div") -> str:
    return f'<{tag} class="entry {classes}" id="{_e(entry.key)}" data-key="{_e(entry.key)}" data-seq="{entry.seq}">'


def _who(entry: MessageEntry) -> str:
    if entry.event_type == "tool/result":
        return "tool"
    if entry.source == "plugin":
        return f"context from {entry.plugin or 'a plugin'}"
    if entry.role == "assistant" and entry.model:
        return f"assistant · {entry.model}"
    return entry.role


def render_entry(entry: Entry) -> str:
    if isinstance(entry, TurnStartEntry):
        return _open(entry, "turn-start") + f"Turn {entry.turn}</div>"
    if isinstance(entry, TurnEndEntry):
        detail = f' <span class="detail">— {_e(entry.detail)}</span>' if entry.detail else ""
        outcome = OUTCOME_TEXT.get(entry.outcome, entry.outcome)
        return _open(entry, f"turn-end outcome-{_e(entry.outcome)}") + f"Turn {entry.turn} {_e(outcome)}{detail}</div>"
    if isinstance(entry, SeedEntry):
        return _open(entry, "seed") + f"inherited history ends here (events 0-{entry.seq - 1} came from before)</div>"
    if isinstance(entry, NoteEntry):
        return _open(entry, "note") + f"{_e(entry.text)}</div>"
    if isinstance(entry, CompactionEntry):
        return (
            _open(entry, "compaction")
            + f'<span class="marker">summarised for the model: events {entry.first}-{entry.through}</span>'
            + '<details class="summary"><summary>what the model sees instead</summary>'
            + f"{_blocks(entry.summary)}</details>"
            + "</div>"
        )
    if isinstance(entry, StreamEntry):
        state = STREAM_STATE_TEXT.get(entry.state, entry.state)
        error = f' <span class="error-text">{_e(entry.error)}</span>' if entry.error else ""
        return (
            _open(entry, f"msg role-assistant stream state-{_e(entry.state)}", "article")
            + f'<div class="meta"><span class="who">assistant</span> <span class="state">{_e(state)}</span>{error}'
            + f'<span class="seq">#{entry.seq}</span></div>'
            + f'<div class="blocks">{_blocks(entry.blocks, indexed=True)}</div></article>'
        )
    badges = ""
    if entry.interrupted:
        badges += ' <span class="badge interrupted">interrupted: partial response</span>'
    if entry.synthetic:
        badges += f' <span class="badge synthetic">{_e(SYNTHETIC_TEXT.get(entry.synthetic, entry.synthetic))}</span>'
    elif entry.error:
        badges += f' <span class="badge error">{_e(entry.error)}</span>'
    classes = f"msg role-{_e(entry.role)} src-{_e(entry.source)}" + (" synthetic" if entry.synthetic else "")
    seq = f'<span class="seq">#{entry.seq}</span>'
    meta = f'<div class="meta"><span class="who">{_e(_who(entry))}</span>{badges}{seq}</div>'
    body = f'<div class="blocks">{_blocks(entry.blocks)}</div>'
    if entry.source == "plugin":
        body = f"<details><summary>show</summary>{body}</details>"
    return _open(entry, classes, "article") + meta + body + "</article>"


# ---------------------------------------------------------------------------------------------- pages


def _page(title: str, body: str, *, body_attrs: str = "") -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)} · sessionlog</title>"
        '<link rel="stylesheet" href="/static/app.css"><script src="/static/app.js" defer></script>'
        f"</head><body{body_attrs}>{body}</body></html>"
    )


def render_transcript_page(transcript: Transcript, *, live: bool = True, at: int | None = None) -> str:
    sid = transcript.session
    title = transcript.title or sid
    state = (
        f'<span class="badge open-turn">turn {transcript.open_turn} open</span>'
        if transcript.open_turn is not None
        else '<span class="badge closed">no open turn</span>'
    )
    parts = [
        '<header class="top"><nav><a href="/">sessions</a></nav>',
        f'<h1>{_e(title)}</h1><div class="sub"><code class="session-id">{_e(sid)}</code> · '
        f'{transcript.next_seq} events · {state} <span id="live-status" class="live-status"></span></div>',
    ]
    if at is not None:
        parts.append(
            f'<div class="banner replay">replay up to event {at} · <a href="{session_href(sid)}">latest</a></div>'
        )
    if transcript.fork is not None:
        seed = (
            f" at event {transcript.fork.seed_length - 1} (the first {transcript.fork.seed_length} events are "
            "inherited)"
            if transcript.fork.seed_length
            else ""
        )
        parent = transcript.fork.parent
        parts.append(
            f'<div class="banner fork">forked from <a class="parent" href="{session_href(parent)}">{_e(parent)}</a>'
            f"{seed}</div>"
        )
    parts.append("</header>")
    parts.append('<main id="transcript">')
    parts.extend(render_entry(e) for e in transcript.entries)
    parts.append("</main>")
    attrs = f' data-session="{_e(sid)}" data-next-seq="{transcript.next_seq}" data-live="{"1" if live else "0"}"'
    return _page(title, "".join(parts), body_attrs=attrs)


def render_session_list(sessions: Iterable[SessionInfo], *, titles: dict[str, str], query: str = "") -> str:
    rows = []
    for info in sessions:
        if info.error:
            code = info.error.split(":", 1)[0]
            flag = f'<span class="badge corrupt" title="{_e(info.error)}">{_e(code)}</span>'
        elif info.open_turn:
            flag = f'<span class="badge open-turn">turn {info.open_turn} open</span>'
        else:
            flag = '<span class="badge closed">closed</span>'

        parent = f'<a href="{session_href(info.parent)}">{_e(info.parent)}</a>' if info.parent else ""
        title = titles.get(info.id, "")
        rows.append(
            f'<tr class="{"open" if info.open_turn else "closed"}">'
            f'<td><a class="session-link" href="{session_href(info.id)}">{_e(info.id)}</a></td>'
            f'<td>{_e(title)}</td><td class="num">{info.events}</td><td>{flag}</td><td>{parent}</td>'
            f"<td>{_e(_when(info.created_at))}</td></tr>"
        )
    table = (
        '<table class="sessions"><thead><tr><th>session</th><th>title</th><th>events</th><th>state</th>'
        "<th>parent</th><th>created</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
        if rows
        else '<p class="empty">No sessions match.</p>'
    )
    body = (
        '<header class="top"><h1>Sessions</h1>'
        '<form class="search" method="get" action="/">'
        f'<input type="search" name="q" value="{_e(query)}" placeholder="search id, title, parent" '
        'aria-label="search sessions"> <button type="submit">search</button></form></header>'
        f"<main>{table}</main>"
    )
    return _page("sessions", body)


def render_error_page(status: int, message: str) -> str:
    body = (
        f'<header class="top"><nav><a href="/">sessions</a></nav><h1>{status}</h1></header>'
        f'<main><p class="error-text">{_e(message)}</p></main>'
    )
    return _page(f"{status}", body)


# ---------------------------------------------------------------------------------------------- static

_STATIC: Final = resources.files(__package__) / "static"
APP_CSS: Final = (_STATIC / "app.css").read_text(encoding="utf-8")
APP_JS: Final = (_STATIC / "app.js").read_text(encoding="utf-8")  # builds entries with textContent only
