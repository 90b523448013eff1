"""The fleet page: every session's row (the script updates them live) beside the deployment's health (partitions
and lag per projection, quarantined records, refusals over time)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from ..charts import bar_chart
from .frame import esc, html_page, num, session_href, state_badge, when


def fleet_row(row: dict[str, Any]) -> str:
    sid = row["id"]
    parent = f'<a href="{session_href(row["parent"])}">{esc(row["parent"])}</a>' if row.get("parent") else ""
    holder = esc(row["lease_holder"]) if row.get("lease_holder") else '<span class="muted">—</span>'
    findings = row.get("findings")
    finding_cell = f'<span class="badge error">{findings}</span>' if findings else num(findings)
    return (
        f'<tr class="{"open" if row.get("open_turn") else "closed"}" data-id="{esc(sid)}">'
        f'<td><a class="session-link" href="{session_href(sid)}">{esc(sid)}</a>'
        f'<div class="title">{esc(row.get("title") or "")}</div></td>'
        f'<td class="state">{state_badge(row.get("open_turn"), row.get("error"))}</td><td class="holder">{holder}</td>'
        f'<td class="num events">{num(row.get("events"))}</td>'
        f'<td class="when">{esc(when(row.get("last_activity") or row.get("created_at")))}</td>'
        f'<td class="num tokens">{num(row.get("tokens"))}</td><td class="num findings">{finding_cell}</td>'
        f'<td class="parent">{parent}</td><td class="cwd">{esc(row.get("cwd") or "")}</td></tr>'
    )


def _health_panel(health: dict[str, Any]) -> str:
    blocks = []
    for projection in health["projections"]:
        rows = "".join(
            f'<tr class="{"lagging" if p["lag"] else ""}"><td class="num">{p["partition"]}</td>'
            f'<td class="owner">{esc(p["owner"] or "—")}</td><td class="num">{num(p["applied"])}</td>'
            f'<td class="num lag">{num(p["lag"])}</td></tr>'
            for p in projection["partitions"]
        )
        blocks.append(
            f'<details class="projection" open><summary>{esc(projection["projection"])}</summary>'
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
            f'<li><span class="badge error">{esc(q.get("projection", "?"))}</span> '
            f"stream seq {esc(q.get('stream_seq'))} "
            f"of <code>{esc(q.get('session', '?'))}</code>: {esc(q.get('reason', ''))}</li>"
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
            [when(i["time"])[11:19] for i in intervals],
            [(c, [i["by_code"].get(c, 0) for i in intervals]) for c in codes],
            css="small",
        )
        if codes
        else '<p class="ok-text small">No refusals since this process started.</p>'
    )
    totals = "".join(
        f'<tr><td><code>{esc(c)}</code></td><td class="num">{num(int(v))}</td></tr>'
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
        f'<input type="search" name="q" value="{esc(query)}" placeholder="search id, title, parent, cwd" '
        f'aria-label="search sessions"> <select name="state" aria-label="state">{options}</select> '
        '<button type="submit">filter</button></form></header>'
        f'<div class="layout"><main class="content">{table}{pager}</main>{_health_panel(health)}</div>'
    )
    live = "1" if fleet["page"] == 1 and not query and not state else "0"
    return html_page("fleet", body, body_attrs=f' data-fleet="1" data-prepend="{live}"', wide=True)
