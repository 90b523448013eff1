"""The model's-view tab: the messages the model got at a request, what changed since the previous one (added,
taken off by compaction), each compaction beside what it replaced, and the requests to pick from."""

from __future__ import annotations

from typing import Any, Final

from sessionlog.transcript import ShownBlock

from .frame import (
    SYNTHETIC_TEXT,
    SessionContext,
    esc,
    html_page,
    lineage,
    num,
    plural,
    session_bottom,
    session_href,
    session_top,
)
from .transcript import render_block

REQUESTS_SHOWN: Final = 60  # requests listed around the one the model's view shows


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
        badges += f' <span class="badge synthetic">{esc(text)}</span>'
    classes = (
        f"msg role-{esc(role)} {cls}" + (" added" if added else "") + (" synthetic" if item.get("synthetic") else "")
    )
    return (
        f'<article class="{classes}" id="m{item["seq"]}" data-seq="{item["seq"]}">'
        f'<div class="meta"><span class="who">{esc(who)}</span>{badges}<span class="seq">#{item["seq"]}</span></div>'
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
        f'<span class="muted">(sourceEventSeqs {esc(sources)})</span></div>'
        '<div class="side-by-side"><div class="col"><h4>what the model gets</h4>'
        f"{_message_card(item, added=added, cls='summary')}</div>"
        f'<div class="col"><h4>what it replaced ({plural(len(rep["shadowed"]), "message")})</h4>'
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
            f'<tr class="req{current}"><td><a href="{base}/context?at={r.at}">{esc(r.label())}</a></td>'
            f'<td class="num">{r.first_chunk}</td><td class="num">{r.messages}</td>'
            f'<td class="num">{num(r.input_tokens)}</td></tr>'
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
        f"request {esc(request['label'])} (first chunk at seq {request['first_chunk']})"
        if request
        else f"the log up to seq {at}"
    )
    facts = [f"<b>{view['total']:,}</b> messages"]
    if header:
        facts.append(
            f'model <b class="model">{esc(header["model"])}</b> via {esc(header["provider"])} '
            f"(header at seq {header['seq']}, {esc(header['reason'])})"
        )
    else:
        facts.append('<span class="error-text">no request/header before this point</span>')
    diff = ""
    if previous:
        removed = previous["removed"]
        diff = (
            f'<div class="diff">since request {esc(previous["request"]["label"])}: '
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
                f"({plural(len(removed), 'message')})</summary>"
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
                f'<pre class="body">{esc(sys_text)}</pre></details>'
            )
        if isinstance(tools, list) and tools:
            names = ", ".join(str(t.get("name", "?")) if isinstance(t, dict) else "?" for t in tools)
            system += f'<div class="muted small">tools: {esc(names)}</div>'
    body_html = (
        session_top(ctx)
        + f'<section class="view-head"><h2>What the model saw at {what}</h2><div class="sub">{" · ".join(facts)}</div>'
        + diff
        + system
        + "</section>"
        + '<div class="two">'
        + f'<main id="context" class="messages">{pager}{"".join(cards) or "<p class=empty>No messages.</p>"}'
        + f"{pager}</main>"
        + f'<aside class="picker"><h3>Requests</h3>{_request_list(ctx, at)}{lineage(ctx)}</aside></div>'
        + session_bottom(ctx, side_panel=False)
    )
    return html_page(f"model's view · {ctx.title or ctx.session_id}", body_html, wide=True)
