"""The audit tab (totals, findings, charts, per step, per turn, per model) and the raw-exchanges tab (what the
provider received and returned against the log's derivation at that seq)."""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import quote

from ..charts import bar_chart, line_chart
from .frame import SessionContext, esc, html_page, num, session_bottom, session_top

STEPS_SHOWN: Final = 300  # rows of the audit's step table (the JSON has them all)


# ---------------------------------------------------------------------------------------------- the audit


def _finding_list(findings: list[dict[str, Any]]) -> str:
    if not findings:
        return '<p class="ok-text">No findings: the chunks, the messages, the provenance and the raw tee agree.</p>'
    items = "".join(
        f'<li class="finding"><span class="badge error">{esc(f["code"])}</span> '
        f'<span class="where">{esc(_where(f))}</span> <span class="message">{esc(f["message"])}</span></li>'
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
        f'<div class="tile{" bad" if name == "findings" and value else ""}"><div class="v">{num(value)}</div>'
        f'<div class="k">{esc(name)}</div></div>'
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
        codes = "".join(f'<span class="badge error">{esc(f["code"])}</span> ' for f in s["findings"])
        rows.append(
            f'<tr class="step{bad}"><td>{s["turn"]}.{s["step"]}</td><td class="num">{s["attempts"]}</td>'
            f'<td class="num">{num(s["first_chunk"])}</td><td>{esc(s["model"] or "")}</td>'
            f'<td class="num">{num(s["context_messages"])}</td><td class="num">{num(s["input_tokens"])}</td>'
            f'<td class="num">{num(s["output_tokens"])}</td><td>{esc(s["finish"] or "")}</td><td>{codes}</td></tr>'
        )
    step_table = (
        '<table class="grid steps"><thead><tr><th>step</th><th class=num>attempts</th>'
        "<th class=num>first chunk</th><th>model</th>"
        "<th class=num>context msgs</th><th class=num>input</th><th class=num>output</th><th>finish</th>"
        "<th>findings</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )
    turn_rows = "".join(
        f'<tr><td>{t["turn"]}</td><td class="num">{t["steps"]}</td><td class="num">{num(t["input_tokens"])}</td>'
        f'<td class="num">{num(t["output_tokens"])}</td><td class="num">{t["findings"]}</td></tr>'
        for t in body["turns"]
    )
    turn_table = (
        '<table class="grid turns"><thead><tr><th>turn</th><th class=num>steps</th><th class=num>input</th>'
        "<th class=num>output</th>"
        f"<th class=num>findings</th></tr></thead><tbody>{turn_rows}</tbody></table>"
    )
    by_model = "".join(
        f'<tr><td>{esc(m["provider"])}</td><td class="model">{esc(m["model"])}</td>'
        f'<td class="num">{num(m["tokens"]["requests"])}</td><td class="num">{num(m["tokens"]["input_tokens"])}</td>'
        f'<td class="num">{num(m["tokens"]["output_tokens"])}</td></tr>'
        for m in body["ledger"]["by_model"]
    )
    model_table = (
        '<table class="grid models"><thead><tr><th>provider</th><th>model</th><th class=num>requests</th>'
        "<th class=num>input</th>"
        f"<th class=num>output</th></tr></thead><tbody>{by_model}</tbody></table>"
    )
    raw = f"{body['raw_matched']} of {body['raw_exchanges']} raw exchanges compared with the log"
    html_body = (
        session_top(ctx)
        + f'<section class="tiles">{tiles}</section>'
        + f'<section><h2>Findings</h2>{_finding_list(body["findings"])}<div class="muted small">{esc(raw)}</div>'
        + "</section>"
        + f'<section class="charts">{"".join(charts)}</section>'
        + f'<section><h2>Per step</h2><div class="muted small">{_steps_note(len(steps))}each chart\'s numbers: '
        + "this table, and "
        + f'<a href="/api/sessions/{quote(ctx.session_id, safe="")}/audit">the audit JSON</a>'
        + f"</div>{step_table}</section>"
        + f'<section class="cols"><div><h2>Per turn</h2>{turn_table}</div><div>'
        + f"<h2>Per model</h2>{model_table}</div></section>"
        + session_bottom(ctx)
    )
    return html_page(f"audit · {ctx.title or ctx.session_id}", html_body, wide=True)


# ---------------------------------------------------------------------------------------------- raw exchanges


def render_raw_page(exchanges: list[dict[str, Any]], ctx: SessionContext) -> str:
    parts = [session_top(ctx)]
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
            f'<section class="exchange verdict-{esc(verdict)}" data-request="{esc(x["request_id"])}">'
            f'<h3>request <code>{esc(x["request_id"])}</code> <span class="badge {cls}">{esc(text)}</span></h3>'
            f'<div class="sub">checked at seq {x["session_seq"]} · HTTP {x["status"]} · {esc(x["outcome"])}</div>'
            f"{_finding_list(x['findings']) if x['findings'] else ''}"
            '<div class="three">'
            f'<div class="col"><h4>what the provider received</h4><pre class="body">{esc(x["request"])}</pre></div>'
            f'<div class="col"><h4>the log\'s derivation at seq {x["session_seq"]}</h4>'
            f'<pre class="body">{esc(derivation)}</pre><h4>request header</h4>'
            f'<pre class="body">{esc(header)}</pre></div>'
            f'<div class="col"><h4>what the provider returned</h4><pre class="body">{esc(x["response"])}</pre></div>'
            "</div></section>"
        )
    parts.append(session_bottom(ctx))
    return html_page(f"raw · {ctx.title or ctx.session_id}", "".join(parts), wide=True)
