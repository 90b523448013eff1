"""The ui-replayer's pages as pure functions of their views (transcript, model's view, audit, raw exchanges, fleet),
and the static CSS and script.

Everything a session holds is escaped on the way into HTML (`html.escape`, quotes included); nothing from a log
is ever placed in a script, a style or an attribute other than escaped `data-*`, `id`, `class` tokens and link
targets built from validated session ids. The script (served from `/static/app.js`, so the Content-Security-Policy
can forbid inline scripts altogether) builds new entries with `textContent` only, mirroring `render_entry`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import Any, Final
from urllib.parse import quote, urlencode

from sessionlog.jsonl import SessionHeader
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

from .charts import bar_chart, line_chart, timeline_strip
from .views import Request

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

PAGE_ENTRIES: Final = 400  # transcript entries on one page of the timeline
STEPS_SHOWN: Final = 300  # rows of the audit's step table (the JSON has them all)
REQUESTS_SHOWN: Final = 60  # requests listed around the one the model's view shows
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


def _page(title: str, body: str, *, body_attrs: str = "", wide: bool = False) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)} · sessionlog</title>"
        '<link rel="stylesheet" href="/static/app.css"><script src="/static/app.js" defer></script>'
        f'</head><body{body_attrs}><div class="bar"><a class="brand" href="/">sessionlog</a>'
        '<a href="/">fleet</a><a href="/api/health">health JSON</a></div>'
        f'<div class="wrap{" wide" if wide else ""}">{body}</div></body></html>'
    )


def _state_badge(open_turn: int | None, error: str | None = None) -> str:
    if error:  # a session that does not read: its code, the message on hover
        return f'<span class="badge corrupt" title="{_e(error)}">{_e(error.split(":", 1)[0])}</span>'
    if open_turn:
        return f'<span class="badge open-turn">turn {open_turn} open</span>'
    return '<span class="badge closed">closed</span>'


def _num(value: int | float | None) -> str:
    if value is None:
        return '<span class="muted">—</span>'
    if isinstance(value, float):  # money: enough digits that a small session's cost is not 0.0000
        return f"{value:,.2f}" if value >= 1 else f"{value:.6f}".rstrip("0").rstrip(".") or "0"
    return f"{value:,}"


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _lineage(ctx: SessionContext) -> str:
    if not ctx.ancestors and not ctx.children:
        return ""
    inner = f'<li class="self"><code>{_e(ctx.session_id)}</code> <span class="muted">this session</span>'
    if ctx.children:
        kids = "".join(
            f'<li><a class="child" href="{session_href(c)}">{_e(c)}</a> <span class="muted">fork</span></li>'
            for c in ctx.children[:50]
        )
        more = f'<li class="muted">and {len(ctx.children) - 50} more</li>' if len(ctx.children) > 50 else ""
        inner += f"<ul>{kids}{more}</ul>"
    inner += "</li>"
    for ancestor in reversed(ctx.ancestors):
        inner = f'<li><a class="ancestor" href="{session_href(ancestor)}">{_e(ancestor)}</a><ul>{inner}</ul></li>'
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
        f'<div class="timeline-legend"><span><i class="dot"></i>{_plural(len(ctx.requests), "request")}</span>'
        f'<span><i class="cbar"></i>{_plural(len(ctx.compactions), "compaction")}</span>'
        f'<span><i class="hdr"></i>{_plural(len(ctx.header_seqs), "request header")}</span>'
        f'<span class="muted">seq 0 … {max(0, ctx.events - 1)}</span></div>'
    )
    return (
        '<section class="timeline-box">'
        + timeline_strip(ctx.events, reqs, marks, headers=headers, current=current)
        + legend
        + "</section>"
    )


def _session_top(ctx: SessionContext, *, fork_banner: str = "") -> str:
    sid = ctx.session_id
    title = ctx.title or sid
    holder = (
        f'<span class="badge lease">writer: {_e(ctx.lease_holder)}</span>'
        if ctx.lease_holder
        else '<span class="badge closed">no writer</span>'
    )
    cwd = ctx.header.cwd if isinstance(ctx.header.cwd, str) else None
    facts = [
        f'<code class="session-id">{_e(sid)}</code>',
        f"{ctx.events:,} events",
        _state_badge(ctx.open_turn),
        holder,
    ]
    if cwd:
        facts.append(f'<span class="cwd" title="working directory">{_e(cwd)}</span>')
    if ctx.last_activity:
        facts.append(f'<span class="muted">last activity {_e(_when(ctx.last_activity))}</span>')
    base = session_href(sid)
    tabs = "".join(
        f'<a class="tab{" active" if ctx.tab == key else ""}" href="{base}{path}">{_e(label)}</a>'
        for key, label, path in TABS
    )
    tabs += (
        f'<a class="tab{" active" if ctx.tab == "raw" else ""}" href="{base}/raw">Raw exchanges</a>'
        f'<span class="tab-json"><a href="/api/sessions/{quote(sid, safe="")}/{_JSON_OF.get(ctx.tab, "transcript")}">'
        "JSON</a></span>"
    )
    return (
        f'<header class="top"><h1>{_e(title)}</h1><div class="sub">{" · ".join(facts)}'
        f'<span id="live-status" class="live-status"></span></div>{fork_banner}</header>'
        f'<div class="layout"><div class="content"><nav class="tabs">{tabs}</nav>{_timeline(ctx)}'
    )


_JSON_OF: Final = {"transcript": "transcript", "context": "context", "audit": "audit", "raw": "raw"}


def _session_bottom(ctx: SessionContext, *, side_panel: bool = True) -> str:
    side = _lineage(ctx) if side_panel else ""
    return f'</div><aside class="side">{side}</aside></div>' if side else "</div></div>"


def render_transcript_page(
    transcript: Transcript, ctx: SessionContext, *, live: bool = True, before: int | None = None
) -> str:
    sid = transcript.session
    title = transcript.title or sid
    fork = ""
    if transcript.fork is not None:
        seed = (
            f" at event {transcript.fork.seed_length - 1} (the first {transcript.fork.seed_length} events are "
            "inherited)"
            if transcript.fork.seed_length
            else ""
        )
        parent = transcript.fork.parent
        fork = (
            f'<div class="banner fork">forked from <a class="parent" href="{session_href(parent)}">{_e(parent)}</a>'
            f"{seed}</div>"
        )
    parts = [_session_top(ctx, fork_banner=fork)]
    if ctx.at is not None:
        parts.append(
            f'<div class="banner replay">replay up to event {ctx.at} · <a href="{session_href(sid)}">latest</a></div>'
        )
    entries = transcript.entries
    if before is not None:
        entries = tuple(e for e in entries if e.seq < before)
    shown = entries[-PAGE_ENTRIES:]
    if len(shown) < len(entries):
        parts.append(
            f'<div class="pager"><a class="earlier" href="{session_href(sid)}?before={shown[0].seq}">'
            f"← earlier ({len(entries) - len(shown):,} entries)</a>"
            f'<span class="muted">showing entries from event {shown[0].seq}</span></div>'
        )
    if before is not None:
        parts.append(f'<div class="pager"><a href="{session_href(sid)}">latest →</a></div>')
    parts.append('<main id="transcript">')
    parts.extend(render_entry(e) for e in shown)
    parts.append("</main>")
    parts.append(_session_bottom(ctx))
    attrs = f' data-session="{_e(sid)}" data-next-seq="{transcript.next_seq}" data-live="{"1" if live else "0"}"'
    return _page(title, "".join(parts), body_attrs=attrs, wide=True)


# ---------------------------------------------------------------------------------------------- the model's view


def _shown(blocks: list[dict[str, Any]]) -> str:
    return "".join(render_block(ShownBlock(**b)) for b in blocks)


def _message_card(item: dict[str, Any], *, added: bool, cls: str = "") -> str:
    role = item["role"]
    who = "tool" if item["type"] == "tool/result" else role
    badges = ""
    if added:
        badges += ' <span class="badge new">new since the previous request</span>'
    if item.get("synthetic"):
        text = SYNTHETIC_TEXT.get(item["synthetic"], item["synthetic"])
        badges += f' <span class="badge synthetic">{_e(text)}</span>'
    classes = (
        f"msg role-{_e(role)} {cls}" + (" added" if added else "") + (" synthetic" if item.get("synthetic") else "")
    )
    return (
        f'<article class="{classes}" id="m{item["seq"]}" data-seq="{item["seq"]}">'
        f'<div class="meta"><span class="who">{_e(who)}</span>{badges}<span class="seq">#{item["seq"]}</span></div>'
        f'<div class="blocks">{_shown(item["blocks"])}</div></article>'
    )


def _compaction_card(item: dict[str, Any], *, added: bool) -> str:
    rep = item["replaces"]
    shadowed = "".join(_message_card(s, added=False, cls="shadowed") for s in rep["shadowed"])
    sources = ", ".join(str(s) for s in rep["source_event_seqs"])
    return (
        f'<section class="compaction-view" data-seq="{item["seq"]}">'
        f'<div class="marker">compaction at seq {item["seq"]}: '
        f"replaced the messages of seqs {rep['start']}–{rep['end']} "
        f'<span class="muted">(sourceEventSeqs {_e(sources)})</span></div>'
        '<div class="side-by-side"><div class="col"><h4>what the model gets</h4>'
        f"{_message_card(item, added=added, cls='summary')}</div>"
        f'<div class="col"><h4>what it replaced ({_plural(len(rep["shadowed"]), "message")})</h4>'
        f"{shadowed}</div></div></section>"
    )


def _request_list(ctx: SessionContext, at: int) -> str:
    if not ctx.requests:
        return '<p class="empty">No requests yet: the model has not been asked.</p>'
    index = min(range(len(ctx.requests)), key=lambda i: abs(ctx.requests[i].at - at))
    lo = max(0, index - REQUESTS_SHOWN // 2)
    window = ctx.requests[lo : lo + REQUESTS_SHOWN]
    base = session_href(ctx.session_id)
    rows = []
    for r in window:
        current = " current" if r.at == at else ""
        rows.append(
            f'<tr class="req{current}"><td><a href="{base}/context?at={r.at}">{_e(r.label())}</a></td>'
            f'<td class="num">{r.first_chunk}</td><td class="num">{r.messages}</td>'
            f'<td class="num">{_num(r.input_tokens)}</td></tr>'
        )
    more = (
        f'<div class="muted small">{len(ctx.requests):,} requests in all</div>'
        if len(ctx.requests) > len(window)
        else ""
    )
    return (
        '<table class="grid requests"><thead><tr><th>step</th><th class=num>first chunk</th><th class=num>messages</th>'
        f"<th class=num>input tokens</th></tr></thead><tbody>{''.join(rows)}</tbody></table>{more}"
    )


def _context_pager(view: dict[str, Any], ctx: SessionContext) -> str:
    total, start, shown = view["total"], view["start"], len(view["messages"])
    if shown >= total:
        return ""
    base = f"{session_href(ctx.session_id)}/context?at={view['at']}"
    links = []
    if start > 0:
        links.append(f'<a class="earlier" href="{base}&amp;from={max(0, start - shown)}">← earlier messages</a>')
    links.append(f'<span class="muted">messages {start + 1:,}–{start + shown:,} of {total:,}</span>')
    if start + shown < total:
        links.append(f'<a class="later" href="{base}&amp;from={start + shown}">later messages →</a>')
    jumps = "".join(f'<a href="{base}&amp;from={c["index"]}">summary #{c["seq"]}</a>' for c in view["compactions"][:20])
    if jumps:
        links.append(f'<span class="muted">compactions in this view:</span> {jumps}')
    return f'<div class="pager">{"".join(links)}</div>'


def render_context_page(view: dict[str, Any], ctx: SessionContext) -> str:
    at = view["at"]
    previous = view.get("previous")
    added = set(previous["added"]) if previous else set()
    header = view.get("header")
    request = view.get("request")
    what = (
        f"request {_e(request['label'])} (first chunk at seq {request['first_chunk']})"
        if request
        else f"the log up to seq {at}"
    )
    facts = [f"<b>{view['total']:,}</b> messages"]
    if header:
        facts.append(
            f'model <b class="model">{_e(header["model"])}</b> via {_e(header["provider"])} '
            f"(header at seq {header['seq']}, {_e(header['reason'])})"
        )
    else:
        facts.append('<span class="error-text">no request/header before this point</span>')
    diff = ""
    if previous:
        removed = previous["removed"]
        diff = (
            f'<div class="diff">since request {_e(previous["request"]["label"])}: '
            f'<span class="plus">+{len(previous["added"])} added</span> · '
            f'<span class="minus">−{len(removed)} taken off by compaction</span></div>'
        )
        if removed:
            taken = "".join(
                _message_card(r, added=False, cls="removed")
                + (f'<div class="muted small">replaced by #{r["replaced_by"]}</div>' if r.get("replaced_by") else "")
                for r in removed
            )
            diff += (
                '<details class="removed-list"><summary>show what was taken off '
                f"({_plural(len(removed), 'message')})</summary>"
                f"{taken}</details>"
            )
    pager = _context_pager(view, ctx)
    cards: list[str] = []
    for item in view["messages"]:
        if "replaces" in item:
            cards.append(_compaction_card(item, added=item["seq"] in added))
        else:
            cards.append(_message_card(item, added=item["seq"] in added))
    system = ""
    if header and isinstance(header.get("header"), dict):
        body = header["header"]
        sys_text = body.get("system")
        tools = body.get("tools")
        if sys_text:
            system = (
                '<details class="system"><summary>system prompt</summary>'
                f'<pre class="body">{_e(sys_text)}</pre></details>'
            )
        if isinstance(tools, list) and tools:
            names = ", ".join(str(t.get("name", "?")) if isinstance(t, dict) else "?" for t in tools)
            system += f'<div class="muted small">tools: {_e(names)}</div>'
    body_html = (
        _session_top(ctx)
        + f'<section class="view-head"><h2>What the model saw at {what}</h2><div class="sub">{" · ".join(facts)}</div>'
        + diff
        + system
        + "</section>"
        + '<div class="two">'
        + f'<main id="context" class="messages">{pager}{"".join(cards) or "<p class=empty>No messages.</p>"}'
        + f"{pager}</main>"
        + f'<aside class="picker"><h3>Requests</h3>{_request_list(ctx, at)}{_lineage(ctx)}</aside></div>'
        + _session_bottom(ctx, side_panel=False)
    )
    return _page(f"model's view · {ctx.title or ctx.session_id}", body_html, wide=True)


# ---------------------------------------------------------------------------------------------- the audit


def _finding_list(findings: list[dict[str, Any]]) -> str:
    if not findings:
        return '<p class="ok-text">No findings: the chunks, the messages, the provenance and the raw tee agree.</p>'
    items = "".join(
        f'<li class="finding"><span class="badge error">{_e(f["code"])}</span> '
        f'<span class="where">{_e(_where(f))}</span> <span class="message">{_e(f["message"])}</span></li>'
        for f in findings
    )
    return f'<ul class="findings">{items}</ul>'


def _where(f: dict[str, Any]) -> str:
    parts = []
    if f.get("turn") is not None:
        parts.append(f"step {f['turn']}.{f.get('step')}")
    if f.get("seq") is not None:
        parts.append(f"seq {f['seq']}")
    return ", ".join(parts)


def _steps_note(count: int) -> str:
    return f"the last {STEPS_SHOWN} of {count:,} steps; " if count > STEPS_SHOWN else ""


def render_audit_page(body: dict[str, Any], ctx: SessionContext) -> str:
    total = body["ledger"]["total"]
    cards = [
        ("requests", total["requests"]),
        ("input tokens", total["input_tokens"]),
        ("output tokens", total["output_tokens"]),
        ("cache reads", total["cache_read_tokens"]),
        ("reasoning", total["reasoning_tokens"]),
        ("findings", len(body["findings"])),
    ]
    if body["priced"]:
        cards.append(("cost (USD)", body["total_cost_usd"]))
    tiles = "".join(
        f'<div class="tile{" bad" if name == "findings" and value else ""}"><div class="v">{_num(value)}</div>'
        f'<div class="k">{_e(name)}</div></div>'
        for name, value in cards
    )
    steps = body["steps"]
    labels = [f"{s['turn']}.{s['step']}" for s in steps]
    charts = [
        bar_chart(
            "tokens per step",
            labels,
            [("input", [s["input_tokens"] for s in steps]), ("output", [s["output_tokens"] for s in steps])],
        )
    ]
    points = body["requests"]
    xs = [p["first_chunk"] for p in points]
    marks = [(c["seq"], f"compaction at seq {c['seq']}") for c in body["compactions"]]
    charts.append(
        line_chart(
            "context size per request, in messages (compactions are the drops)",
            xs,
            [("messages", [p["messages"] for p in points])],
            marks=marks,
        )
    )
    if body["priced"]:
        charts.append(
            line_chart("cumulative cost (USD)", xs, [("cost", [p["cumulative_cost_usd"] for p in points])], marks=marks)
        )
    rows = []
    shown_steps = steps[-STEPS_SHOWN:]
    for s in shown_steps:
        bad = " bad" if s["findings"] else ""
        codes = "".join(f'<span class="badge error">{_e(f["code"])}</span> ' for f in s["findings"])
        rows.append(
            f'<tr class="step{bad}"><td>{s["turn"]}.{s["step"]}</td><td class="num">{s["attempts"]}</td>'
            f'<td class="num">{_num(s["first_chunk"])}</td><td>{_e(s["model"] or "")}</td>'
            f'<td class="num">{_num(s["context_messages"])}</td><td class="num">{_num(s["input_tokens"])}</td>'
            f'<td class="num">{_num(s["output_tokens"])}</td><td>{_e(s["finish"] or "")}</td><td>{codes}</td></tr>'
        )
    step_table = (
        '<table class="grid steps"><thead><tr><th>step</th><th class=num>attempts</th>'
        "<th class=num>first chunk</th><th>model</th>"
        "<th class=num>context msgs</th><th class=num>input</th><th class=num>output</th><th>finish</th>"
        "<th>findings</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )
    turn_rows = "".join(
        f'<tr><td>{t["turn"]}</td><td class="num">{t["steps"]}</td><td class="num">{_num(t["input_tokens"])}</td>'
        f'<td class="num">{_num(t["output_tokens"])}</td><td class="num">{t["findings"]}</td></tr>'
        for t in body["turns"]
    )
    turn_table = (
        '<table class="grid turns"><thead><tr><th>turn</th><th class=num>steps</th><th class=num>input</th>'
        "<th class=num>output</th>"
        f"<th class=num>findings</th></tr></thead><tbody>{turn_rows}</tbody></table>"
    )
    by_model = "".join(
        f'<tr><td>{_e(m["provider"])}</td><td class="model">{_e(m["model"])}</td>'
        f'<td class="num">{_num(m["tokens"]["requests"])}</td><td class="num">{_num(m["tokens"]["input_tokens"])}</td>'
        f'<td class="num">{_num(m["tokens"]["output_tokens"])}</td></tr>'
        for m in body["ledger"]["by_model"]
    )
    model_table = (
        '<table class="grid models"><thead><tr><th>provider</th><th>model</th><th class=num>requests</th>'
        "<th class=num>input</th>"
        f"<th class=num>output</th></tr></thead><tbody>{by_model}</tbody></table>"
    )
    raw = f"{body['raw_matched']} of {body['raw_exchanges']} raw exchanges compared with the log"
    html_body = (
        _session_top(ctx)
        + f'<section class="tiles">{tiles}</section>'
        + f'<section><h2>Findings</h2>{_finding_list(body["findings"])}<div class="muted small">{_e(raw)}</div>'
        + "</section>"
        + f'<section class="charts">{"".join(charts)}</section>'
        + f'<section><h2>Per step</h2><div class="muted small">{_steps_note(len(steps))}each chart\'s numbers: '
        + "this table, and "
        + f'<a href="/api/sessions/{quote(ctx.session_id, safe="")}/audit">the audit JSON</a>'
        + f"</div>{step_table}</section>"
        + f'<section class="cols"><div><h2>Per turn</h2>{turn_table}</div><div>'
        + f"<h2>Per model</h2>{model_table}</div></section>"
        + _session_bottom(ctx)
    )
    return _page(f"audit · {ctx.title or ctx.session_id}", html_body, wide=True)


# ---------------------------------------------------------------------------------------------- raw exchanges


def render_raw_page(exchanges: list[dict[str, Any]], ctx: SessionContext) -> str:
    parts = [_session_top(ctx)]
    if not exchanges:
        parts.append(
            '<p class="empty">No raw exchanges: the gateway tee (SESSIONLOG_RAW) holds nothing for this session '
            "(its requests did not go through the gateway).</p>"
        )
    for x in exchanges:
        verdict = x["verdict"]
        cls = {"agrees": "ok", "differs": "error"}.get(verdict, "closed")
        text = {
            "agrees": "the check found no difference",
            "differs": "the check found differences",
        }.get(verdict, verdict)
        derivation = x["derivation"] or "(the log does not reach this seq)"
        header = x["header"] or "(no request/header)"
        parts.append(
            f'<section class="exchange verdict-{_e(verdict)}" data-request="{_e(x["request_id"])}">'
            f'<h3>request <code>{_e(x["request_id"])}</code> <span class="badge {cls}">{_e(text)}</span></h3>'
            f'<div class="sub">checked at seq {x["session_seq"]} · HTTP {x["status"]} · {_e(x["outcome"])}</div>'
            f"{_finding_list(x['findings']) if x['findings'] else ''}"
            '<div class="three">'
            f'<div class="col"><h4>what the provider received</h4><pre class="body">{_e(x["request"])}</pre></div>'
            f'<div class="col"><h4>the log\'s derivation at seq {x["session_seq"]}</h4>'
            f'<pre class="body">{_e(derivation)}</pre><h4>request header</h4><pre class="body">{_e(header)}</pre></div>'
            f'<div class="col"><h4>what the provider returned</h4><pre class="body">{_e(x["response"])}</pre></div>'
            "</div></section>"
        )
    parts.append(_session_bottom(ctx))
    return _page(f"raw · {ctx.title or ctx.session_id}", "".join(parts), wide=True)


# ---------------------------------------------------------------------------------------------- the fleet


def fleet_row(row: dict[str, Any]) -> str:
    sid = row["id"]
    parent = f'<a href="{session_href(row["parent"])}">{_e(row["parent"])}</a>' if row.get("parent") else ""
    holder = _e(row["lease_holder"]) if row.get("lease_holder") else '<span class="muted">—</span>'
    findings = row.get("findings")
    finding_cell = f'<span class="badge error">{findings}</span>' if findings else _num(findings)
    return (
        f'<tr class="{"open" if row.get("open_turn") else "closed"}" data-id="{_e(sid)}">'
        f'<td><a class="session-link" href="{session_href(sid)}">{_e(sid)}</a>'
        f'<div class="title">{_e(row.get("title") or "")}</div></td>'
        f'<td class="state">{_state_badge(row.get("open_turn"), row.get("error"))}</td><td class="holder">{holder}</td>'
        f'<td class="num events">{_num(row.get("events"))}</td>'
        f'<td class="when">{_e(_when(row.get("last_activity") or row.get("created_at")))}</td>'
        f'<td class="num tokens">{_num(row.get("tokens"))}</td><td class="num findings">{finding_cell}</td>'
        f'<td class="parent">{parent}</td><td class="cwd">{_e(row.get("cwd") or "")}</td></tr>'
    )


def _health_panel(health: dict[str, Any]) -> str:
    blocks = []
    for projection in health["projections"]:
        rows = "".join(
            f'<tr class="{"lagging" if p["lag"] else ""}"><td class="num">{p["partition"]}</td>'
            f'<td class="owner">{_e(p["owner"] or "—")}</td><td class="num">{_num(p["applied"])}</td>'
            f'<td class="num lag">{_num(p["lag"])}</td></tr>'
            for p in projection["partitions"]
        )
        blocks.append(
            f'<details class="projection" open><summary>{_e(projection["projection"])}</summary>'
            '<table class="grid compact"><thead><tr><th class=num>p</th><th>owner</th>'
            '<th class=num title="stream seq applied">applied</th><th class=num title="records not yet applied">'
            "lag</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></details>"
        )
    if not blocks:
        blocks.append('<p class="muted small">No projection has checkpointed yet.</p>')
    quarantined = health["quarantined"]
    q_html = (
        '<ul class="quarantine">'
        + "".join(
            f'<li><span class="badge error">{_e(q.get("projection", "?"))}</span> stream seq {_e(q.get("stream_seq"))} '
            f"of <code>{_e(q.get('session', '?'))}</code>: {_e(q.get('reason', ''))}</li>"
            for q in quarantined[:50]
        )
        + "</ul>"
        if quarantined
        else '<p class="ok-text small">No quarantined records.</p>'
    )
    refusals = health["refusals"]
    intervals = refusals["intervals"][-60:]
    codes = refusals["codes"]
    chart = (
        bar_chart(
            f"refusals by code, per {refusals['every_s']:.0f} s",
            [_when(i["time"])[11:19] for i in intervals],
            [(c, [i["by_code"].get(c, 0) for i in intervals]) for c in codes],
            css="small",
        )
        if codes
        else '<p class="ok-text small">No refusals since this process started.</p>'
    )
    totals = "".join(
        f'<tr><td><code>{_e(c)}</code></td><td class="num">{_num(int(v))}</td></tr>'
        for c, v in sorted(refusals["totals"].items())
    )
    total_table = (
        '<table class="grid compact"><thead><tr><th>code</th><th class=num>total</th></tr></thead>'
        f"<tbody>{totals}</tbody></table>"
        if totals
        else ""
    )
    return (
        '<aside class="health"><h2>Health</h2><h3>Projections</h3>'
        + "".join(blocks)
        + '<div class="muted small">lag: records of the partition its consumer has not applied yet</div>'
        + f"<h3>Quarantined records</h3>{q_html}<h3>Refusals</h3>{chart}{total_table}</aside>"
    )


def render_fleet_page(fleet: dict[str, Any], health: dict[str, Any]) -> str:
    query = fleet["query"]
    state = fleet["state"]
    rows = "".join(fleet_row(r) for r in fleet["rows"])
    table = (
        '<table class="sessions grid"><thead><tr><th>session</th><th>state</th><th>writer</th><th class=num>events</th>'
        "<th>last activity</th><th class=num>tokens</th><th>findings</th><th>parent</th><th>cwd</th></tr></thead>"
        f'<tbody id="fleet-rows">{rows}</tbody></table>'
        if rows
        else '<p class="empty">No sessions match.</p>'
        '<table class="sessions grid hidden"><tbody id="fleet-rows"></tbody></table>'
    )
    options = "".join(
        f'<option value="{v}"{" selected" if state == v else ""}>{label}</option>'
        for v, label in (
            ("", "all"),
            ("open", "open turn"),
            ("closed", "closed"),
            ("forks", "forks"),
            ("findings", "with findings"),
        )
    )
    pager = ""
    if fleet["pages"] > 1:

        def link(page: int, text: str) -> str:
            return f'<a href="/?{urlencode({"q": query, "state": state, "page": page})}">{text}</a>'

        prev = link(fleet["page"] - 1, "← newer") if fleet["page"] > 1 else ""
        nxt = link(fleet["page"] + 1, "older →") if fleet["page"] < fleet["pages"] else ""
        pager = f'<div class="pager">{prev}<span>page {fleet["page"]} of {fleet["pages"]}</span>{nxt}</div>'
    body = (
        '<header class="top"><h1>Fleet</h1>'
        f'<div class="sub">{fleet["total"]:,} of {fleet["sessions"]:,} sessions · most recent activity first '
        '<span id="live-status" class="live-status"></span></div>'
        '<form class="search" method="get" action="/">'
        f'<input type="search" name="q" value="{_e(query)}" placeholder="search id, title, parent, cwd" '
        f'aria-label="search sessions"> <select name="state" aria-label="state">{options}</select> '
        '<button type="submit">filter</button></form></header>'
        f'<div class="layout"><main class="content">{table}{pager}</main>{_health_panel(health)}</div>'
    )
    live = "1" if fleet["page"] == 1 and not query and not state else "0"
    return _page("fleet", body, body_attrs=f' data-fleet="1" data-prepend="{live}"', wide=True)


def render_error_page(status: int, message: str) -> str:
    body = f'<header class="top"><h1>{status}</h1></header><main><p class="error-text">{_e(message)}</p></main>'
    return _page(f"{status}", body)


# ---------------------------------------------------------------------------------------------- static

_STATIC: Final = resources.files(__package__) / "static"
APP_CSS: Final = (_STATIC / "app.css").read_text(encoding="utf-8")
APP_JS: Final = (_STATIC / "app.js").read_text(encoding="utf-8")  # builds entries with textContent only
