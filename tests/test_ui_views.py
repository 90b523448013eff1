"""The operator's views in a real headless Chromium (Debian's chromium, driven by Playwright) against a real
nats-server: the fleet overview (live rows, health), and a session's tabs (transcript, the model's view at a
request, the audit with its charts, the raw exchanges against the log's derivation, lineage) on the compacted dsh
fixture, a forked session, a crash-repaired one and a live one; every field of the log that reaches a page is
inert HTML. Each view's JSON endpoint is checked beside its page. Screenshots go to `tests/screenshots/`
(git-ignored)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio
from browserfixtures import skip_without_chromium
from conftest import FIXTURES_DIR, REPO_ROOT
from natsfixtures import new_session_id
from scaffold import WAIT_S, eventually, serving
from sessiongen import closed_turn, text_block, tool_call_block, tool_result_data, user_message_data
from test_fixtures_corpus import read_fixture
from test_runner import publish_raw
from test_ui_browser import answer, compacted_forked_interrupted, in_fleet_index

from services.ui_replayer.service import UIReplayerService
from sessionlog.log import SessionLog
from sessionlog.metrics import REQUESTS
from sessionlog.record import H_RAW_KIND, H_RAW_REQUEST_ID, H_RAW_SESSION_SEQ, H_RAW_STATUS, raw_subject
from sessionlog.wire import to_wire

skip_without_chromium()

pytest_plugins = ["natsfixtures", "browserfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

WAIT_MS = 10_000
SCREENSHOTS = REPO_ROOT / "tests" / "screenshots"
XSS = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
XSS_RAW = "<img src=x onerror=alert(1)><b>bold</b>"  # no quotes: it stays whole inside the JSON of an SSE chunk
COMPACTED = "acp-agent-agent-instructions-session.jsonl"  # seq 17 replaces the user message at seq 5
CRASHED = "examples__headless-agent__tests__semantic-checkpoint-snapshots__tool-outcome-unknown-session.jsonl"
PRICES = {"deepseek-v4-flash": {"input": 0.27, "output": 1.1}, "m": {"input": 1.0, "output": 2.0}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ui(log: SessionLog) -> AsyncIterator[UIReplayerService]:
    partitions = list(range(log.settings.partition_count))
    service = UIReplayerService(log, host="127.0.0.1", port=0, partitions=partitions, model_prices=PRICES)
    async with serving(service) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="module")
async def http(ui: UIReplayerService) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=ui.url, timeout=WAIT_S) as client:
        yield client


@pytest.fixture(scope="module")
def viewport_width() -> int:
    return 1440


async def shot(tab: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    await tab.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a real rendering, not a blank page


async def inert(tab: Any) -> None:
    """Nothing the log holds ran or became markup."""
    assert await tab.evaluate("typeof window.__pwned") == "undefined"
    assert await tab.locator(".wrap img").count() == 0
    assert await tab.locator(".wrap script").count() == 0
    assert tab.dialogs == [] and tab.errors == []


async def imported(log: SessionLog, name: str) -> str:
    session_id = new_session_id("dsh")
    await log.import_log(read_fixture(FIXTURES_DIR / name), session_id)
    return session_id


async def visible_text(tab: Any, selector: str) -> str:
    locator = tab.locator(selector).first
    await locator.wait_for(state="visible", timeout=WAIT_MS)
    return str(await locator.inner_text())


# ---------------------------------------------------------------------------------------------- compaction


async def test_the_models_view_shows_the_shadowed_message_before_the_compaction_and_the_summary_after(
    ui: UIReplayerService, log: SessionLog, http: httpx.AsyncClient, page: Any
) -> None:
    sid = await imported(log, COMPACTED)
    requests = (await http.get(f"/api/sessions/{sid}/requests")).json()
    assert [c["seq"] for c in requests["compactions"]] == [17]
    before = [r for r in requests["requests"] if r["at"] < 17]
    after = [r for r in requests["requests"] if r["at"] > 17]
    assert before and after
    # before: the message at seq 5 is what the model got
    view = (await http.get(f"/api/sessions/{sid}/context", params={"at": before[-1]["at"]})).json()
    assert 5 in [m["seq"] for m in view["messages"]] and 17 not in [m["seq"] for m in view["messages"]]
    await page.goto(f"{ui.url}/sessions/{sid}/context?at={before[-1]['at']}")
    await page.locator("#context #m5").wait_for(timeout=WAIT_MS)
    assert await page.locator("#context .compaction-view").count() == 0
    await shot(page, "context-before-compaction")
    # after: the summary stands in its place, with what it replaced beside it, and the diff names the change
    view = (await http.get(f"/api/sessions/{sid}/context", params={"at": after[0]["at"]})).json()
    seqs = [m["seq"] for m in view["messages"]]
    assert 17 in seqs and 5 not in seqs
    (summary,) = [m for m in view["messages"] if m["seq"] == 17]
    assert summary["replaces"]["source_event_seqs"] == [5]
    assert [s["seq"] for s in summary["replaces"]["shadowed"]] == [5]
    assert [r["seq"] for r in view["previous"]["removed"]] == [5]
    assert view["previous"]["removed"][0]["replaced_by"] == 17 and 17 in view["previous"]["added"]
    await page.goto(f"{ui.url}/sessions/{sid}/context?at={after[0]['at']}")
    card = page.locator("#context .compaction-view[data-seq='17']")
    await card.wait_for(timeout=WAIT_MS)
    assert "compaction at seq 17" in await card.locator(".marker").inner_text()
    assert await card.locator(".msg.summary#m17").count() == 1
    assert await card.locator(".msg.shadowed[data-seq='5']").count() == 1
    assert "−1 taken off by compaction" in await visible_text(page, ".diff")
    assert await page.locator("tr.req.current").count() == 1
    assert await page.locator("svg.timeline .compaction-mark").count() == 1
    assert await page.locator("svg.timeline .hdr").count() == 1  # the fixture's one request/header, a link
    await inert(page)
    await shot(page, "context-after-compaction")
    await page.set_viewport_size({"width": 1280, "height": 800})
    await page.screenshot(path=str(SCREENSHOTS / "readme-models-view.png"))  # the one docs/ shows, one screen
    # the transcript still shows the message the model no longer sees, and a marker where it was summarised
    await page.goto(f"{ui.url}/sessions/{sid}")
    assert await page.locator("#transcript #e5").count() == 1
    assert "summarised for the model" in await visible_text(page, ".compaction .marker")
    await shot(page, "transcript-compacted")


async def test_the_audit_shows_the_ledger_per_step_with_charts_whose_numbers_are_in_tables_and_json(
    ui: UIReplayerService, log: SessionLog, http: httpx.AsyncClient, page: Any
) -> None:
    sid = await imported(log, COMPACTED)
    audit = (await http.get(f"/api/sessions/{sid}/audit")).json()
    steps = audit["steps"]
    assert len(steps) == len({(s["turn"], s["step"]) for s in steps}) >= 2
    assert sum(s["input_tokens"] for s in steps) == audit["ledger"]["total"]["input_tokens"]
    assert audit["compactions"][0]["seq"] == 17
    assert audit["priced"] and audit["total_cost_usd"] > 0
    cumulative = [p["cumulative_cost_usd"] for p in audit["requests"]]
    assert cumulative == sorted(cumulative)
    await page.goto(f"{ui.url}/sessions/{sid}/audit")
    await page.locator("figure.chart svg").first.wait_for(timeout=WAIT_MS)
    assert await page.locator("figure.chart").count() == 3  # tokens per step, context size, cumulative cost
    assert await page.locator("figure.chart .mark").count() >= 1  # the compaction on the context chart
    assert await page.locator("table.steps tbody tr").count() == len(steps)
    first = page.locator("table.steps tbody tr").first
    assert f"{steps[0]['input_tokens']:,}" in await first.inner_text()
    await inert(page)
    await shot(page, "audit")


# ---------------------------------------------------------------------------------------------- fork, repair


async def test_fork_lineage_is_a_tree_and_repair_closers_are_marked_synthetic_in_every_view(
    ui: UIReplayerService, log: SessionLog, http: httpx.AsyncClient, page: Any
) -> None:
    parent, child, _ = await compacted_forked_interrupted(log)
    await eventually(lambda: in_fleet_index(ui, child), "the child in the fleet index")
    lineage = (await http.get(f"/api/sessions/{child}/lineage")).json()
    assert lineage["parent"] == parent and lineage["ancestors"] == [parent]
    assert (await http.get(f"/api/sessions/{parent}/lineage")).json()["children"] == [child]
    forks = (await http.get("/api/fleet", params={"q": parent, "state": "forks"})).json()["rows"]
    assert [r["id"] for r in forks] == [child]  # found by its parent's id, and the only fork of it
    await page.goto(f"{ui.url}/sessions/{child}")
    assert await page.locator(".lineage a.ancestor").inner_text() == parent
    assert await page.locator(".lineage li.self code").inner_text() == child
    await page.goto(f"{ui.url}/sessions/{parent}")
    assert await page.locator(".lineage a.child").inner_text() == child
    await shot(page, "transcript-forked-repaired")
    # the model's view after the crash: the closer's result is there, marked synthetic
    view = (
        await http.get(
            f"/api/sessions/{parent}/context",
            params={"at": len_of(await http.get(f"/api/sessions/{parent}/requests")) - 1},
        )
    ).json()
    synthetic = [m for m in view["messages"] if m.get("synthetic")]
    assert [m["synthetic"] for m in synthetic] == ["TOOL_OUTCOME_UNKNOWN"]
    await page.goto(f"{ui.url}/sessions/{parent}/context?at={synthetic[0]['seq']}")
    badge = await visible_text(page, f"#m{synthetic[0]['seq']} .badge.synthetic")
    assert "outcome is unknown" in badge
    await inert(page)
    await shot(page, "context-repaired")


def len_of(response: httpx.Response) -> int:
    return int(response.json()["events"])


async def test_a_dsh_session_that_dsh_repaired_shows_its_synthetic_result_in_the_models_view(
    ui: UIReplayerService, log: SessionLog, http: httpx.AsyncClient
) -> None:
    sid = await imported(log, CRASHED)
    view = (await http.get(f"/api/sessions/{sid}/context", params={"at": 7})).json()
    assert [(m["seq"], m["synthetic"]) for m in view["messages"] if m.get("synthetic")] == [(5, "TOOL_OUTCOME_UNKNOWN")]
    page = (await http.get(f"/sessions/{sid}/context", params={"at": 7})).text
    assert 'class="msg role-user  synthetic"' in page or "badge synthetic" in page


# ---------------------------------------------------------------------------------------------- raw exchanges


async def publish_exchange(
    log: SessionLog, session_id: str, request_id: str, seq: int, request: bytes, response: bytes
) -> None:
    subject = raw_subject(session_id)
    common = {H_RAW_REQUEST_ID: request_id, H_RAW_SESSION_SEQ: str(seq), H_RAW_STATUS: "200"}
    await log.js.publish(subject, request, headers={**common, H_RAW_KIND: "request"})
    await log.js.publish(subject, response, headers={**common, H_RAW_KIND: "response"})


def sse_response(text: str) -> bytes:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": text}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    return b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def test_the_raw_exchange_stands_beside_the_logs_derivation_with_the_checks_verdict(
    ui: UIReplayerService, log: SessionLog, http: httpx.AsyncClient, page: Any
) -> None:
    writer = await log.create(new_session_id("raw"))
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("user/message", user_message_data("Say hi.", "u1"), surface_op="append")
    await writer.emit("request/header", {"header": {"config": {"provider": "p", "model": "m"}}, "reason": "initial"})
    await writer.emit("step/start", {"turn": 1, "step": 1})
    checked_at = len(writer.session) - 1
    wire = to_wire(writer.session.derive_messages(), writer.session.fold_request_header())  # type: ignore[arg-type]
    await answer(writer, 1, 1, [text_block("hi")])
    await writer.emit("step/end", {"turn": 1, "step": 1})
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await writer.close()
    sid = writer.session_id
    await publish_exchange(log, sid, "req-good", checked_at, msgspec.json.encode(wire), sse_response("hi"))
    await publish_exchange(log, sid, "req-xss", checked_at, msgspec.json.encode(wire), sse_response(XSS_RAW))
    body = (await http.get(f"/api/sessions/{sid}/raw")).json()
    verdicts = {x["request_id"]: x["verdict"] for x in body}
    assert verdicts == {"req-good": "agrees", "req-xss": "differs"}
    flagged = (await http.get("/api/fleet", params={"q": sid, "state": "findings"})).json()
    assert [r["id"] for r in flagged["rows"]] == [sid] and flagged["rows"][0]["findings"] == 1
    (bad,) = [x for x in body if x["request_id"] == "req-xss"]
    assert {f["code"] for f in bad["findings"]} == {"RAW_STREAM_DIFFERS"}
    assert '"Say hi."' in bad["derivation"] and XSS_RAW in bad["response"]
    await page.goto(f"{ui.url}/sessions/{sid}/raw")
    await page.locator("section.exchange").first.wait_for(timeout=WAIT_MS)
    assert "found no difference" in await page.locator("section[data-request='req-good'] h3").inner_text()
    differs = page.locator("section[data-request='req-xss']")
    assert "RAW_STREAM_DIFFERS" in await differs.locator(".findings").inner_text()
    assert XSS_RAW in await differs.locator(".three .col").nth(2).inner_text()
    assert await page.locator(".wrap b:has-text('bold')").count() == 0  # the provider's bytes, as text
    await inert(page)
    await shot(page, "raw-exchanges")
    # the finding (holding the provider's text) is inert on the audit page too
    await page.goto(f"{ui.url}/sessions/{sid}/audit")
    assert "RAW_STREAM_DIFFERS" in await visible_text(page, "ul.findings")
    await inert(page)


# ---------------------------------------------------------------------------------------------- live, XSS


async def test_the_overview_and_the_session_page_show_a_new_event_without_a_reload(
    ui: UIReplayerService, log: SessionLog, page: Any, browser: Any
) -> None:
    writer = await log.create(new_session_id("live"), cwd="/srv/agents/live")
    try:
        await writer.emit("turn/start", {"turn": 1})
        await writer.emit("user/message", user_message_data("First.", "u1"), surface_op="append")
        await writer.flush()
        await eventually(lambda: in_fleet_index(ui, writer.session_id), "the live session in the index")
        await page.goto(ui.url + "/")
        await page.locator("#live-status.on").wait_for(state="attached", timeout=WAIT_MS)
        row = page.locator(f"#fleet-rows tr[data-id='{writer.session_id}']")
        await row.wait_for(timeout=WAIT_MS)
        assert "turn 1 open" in await row.locator(".state").inner_text()
        assert await row.locator(".holder").inner_text() != "—"  # the writer holds its lease
        second = await browser.new_page(viewport={"width": 1200, "height": 800})
        await second.goto(f"{ui.url}/sessions/{writer.session_id}")
        await second.locator("#live-status.on").wait_for(state="attached", timeout=WAIT_MS)
        await writer.emit("user/message", user_message_data("Second, live.", "u2"), surface_op="append")
        await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
        await writer.flush()
        await second.get_by_text("Second, live.", exact=True).wait_for(timeout=WAIT_MS)
        await (
            page.locator(f"#fleet-rows tr[data-id='{writer.session_id}'] .state")
            .filter(has_text="closed")
            .wait_for(timeout=WAIT_MS)
        )
        events = await page.locator(f"#fleet-rows tr[data-id='{writer.session_id}'] .events").inner_text()
        assert events == "4"
        # a session that did not exist when the page loaded gets its row at the top
        newcomer = await log.create(new_session_id("new"))
        await closed_turn(newcomer, "hello")
        await newcomer.close()
        await page.locator(f"#fleet-rows tr[data-id='{newcomer.session_id}']").wait_for(timeout=WAIT_MS)
        assert await page.locator("#fleet-rows tr").first.get_attribute("data-id") == newcomer.session_id
        await shot(page, "fleet")
        await second.close()
    finally:
        await writer.close()


async def test_markup_in_every_field_of_the_log_is_shown_as_text_on_every_page(
    ui: UIReplayerService, log: SessionLog, http: httpx.AsyncClient, page: Any
) -> None:
    writer = await log.create(new_session_id("xss"), cwd=f"/tmp/{XSS}")
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("user/message", user_message_data(XSS, "u1"), surface_op="append")
    header = {"config": {"provider": XSS, "model": XSS}, "system": XSS}
    await writer.emit("request/header", {"header": header, "reason": "initial"})
    await writer.emit("step/start", {"turn": 1, "step": 1})
    block = tool_call_block("call-1", XSS, '{"x": 1}')
    await answer(writer, 1, 1, [block])
    await writer.emit("tool/call", {"turn": 1, "step": 1, "callId": "call-1", "name": XSS, "arguments": "{}"})
    result = tool_result_data(1, 1, "call-1", XSS, msg_id="r1")
    call_seq = len(writer.session) - 1
    await writer.emit("tool/result", result, surface_op="append", source_event_seqs=[call_seq])
    await writer.emit("step/end", {"turn": 1, "step": 1})
    await writer.emit("step/start", {"turn": 1, "step": 2})
    # a message that differs from its chunks: the finding quotes the text
    start = await writer.emit(
        "assistant/chunk", {"turn": 1, "step": 2, "chunk": {"type": "block-start", "index": 0, "blockType": "text"}}
    )
    delta = await writer.emit(
        "assistant/chunk", {"turn": 1, "step": 2, "chunk": {"type": "text-delta", "index": 0, "text": "B" + XSS_RAW}}
    )
    message = {
        "id": "a2",
        "role": "assistant",
        "content": [text_block("A" + XSS_RAW)],
        "source": {"kind": "model", "provider": XSS, "model": XSS},
    }
    await writer.emit(
        "assistant/message",
        {"turn": 1, "step": 2, "message": message},
        surface_op="append",
        source_event_seqs=[start.seq, delta.seq],
    )
    await writer.emit("step/end", {"turn": 1, "step": 2})
    await writer.emit("session/title", {"title": XSS})
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await writer.close()
    sid = writer.session_id
    audit = (await http.get(f"/api/sessions/{sid}/audit")).json()
    assert any(XSS_RAW in f["message"] for f in audit["findings"])
    await eventually(lambda: in_fleet_index(ui, sid), "the session in the index")
    for path in ("/", f"/sessions/{sid}", f"/sessions/{sid}/context", f"/sessions/{sid}/audit", f"/sessions/{sid}/raw"):
        response = await http.get(path)
        assert response.status_code == 200, path
        assert "<img src=x" not in response.text and "<script>window" not in response.text, path
        await page.goto(ui.url + path)
        await page.locator(".wrap").wait_for(timeout=WAIT_MS)
        await inert(page)
    for view in ("transcript", "context", "audit", "raw", "requests", "lineage"):  # JSON is never sniffed as HTML
        response = await http.get(f"/api/sessions/{sid}/{view}")
        assert response.headers["content-type"] == "application/json", view
        assert response.headers["x-content-type-options"] == "nosniff", view
    await page.goto(f"{ui.url}/sessions/{sid}/context")
    assert XSS in await page.locator("#context .tool-name").first.inner_text()
    assert XSS in await page.locator(".view-head .model").inner_text()
    await page.goto(f"{ui.url}/?q={sid}")
    assert XSS in await page.locator(f"tr[data-id='{sid}'] .cwd").inner_text()


# ---------------------------------------------------------------------------------------------- fleet, health


async def test_the_overview_pages_filters_and_shows_each_projections_partitions_and_quarantined_records(
    ui: UIReplayerService, log: SessionLog, http: httpx.AsyncClient, page: Any
) -> None:
    tag = new_session_id("pg")
    for i in range(57):
        writer = await log.create(f"{tag}-{i:02d}", cwd=f"/srv/{tag}")
        await closed_turn(writer, f"hello {i}")
        await writer.close()
    opened = await log.create(f"{tag}-open", cwd=f"/srv/{tag}")
    await opened.emit("turn/start", {"turn": 1})
    await opened.flush()
    try:
        await eventually(lambda: _rows_with(ui, tag, 58), "58 sessions in the fleet index")
        first = (await http.get("/api/fleet", params={"q": f"/srv/{tag}"})).json()
        assert (first["total"], first["pages"], len(first["rows"])) == (58, 2, 50)
        assert first["rows"][0]["id"] == f"{tag}-open"  # most recent activity first
        second = (await http.get("/api/fleet", params={"q": f"/srv/{tag}", "page": 2})).json()
        ids = [r["id"] for r in first["rows"] + second["rows"]]
        assert len(set(ids)) == 58
        assert (await http.get("/api/fleet", params={"q": tag, "state": "forks"})).json()["total"] == 0
        only_open = (await http.get("/api/fleet", params={"q": tag, "state": "open"})).json()
        assert [(r["id"], r["open_turn"], r["lease_holder"] is not None) for r in only_open["rows"]] == [
            (f"{tag}-open", 1, True)
        ]
        closed = (await http.get("/api/sessions", params={"q": tag, "state": "closed", "page": 2})).json()
        assert len(closed) == 7 and all(r["open_turn"] is None and r["events"] == 6 for r in closed)
        # a record the projection refuses: quarantined, and the health panel lists it
        junk = new_session_id("junk")
        stream_seq = await publish_raw(log, junk, b"not a record", None)
        await eventually(lambda: _quarantined(http, stream_seq), "the quarantined record in the health JSON")
        await eventually(lambda: _checkpointed(http, ui.runner.replica_id), "every applied partition checkpointed")
        health = (await http.get("/api/health")).json()
        (mine,) = [p for p in health["projections"] if p["projection"] == "ui-replayer"]
        assert [p["partition"] for p in mine["partitions"]] == list(range(log.settings.partition_count))
        assert all(p["lag"] == 0 for p in mine["partitions"])  # it has applied every record, and says so
        await page.goto(f"{ui.url}/?q=/srv/{tag}")
        assert await page.locator("#fleet-rows tr").count() == 50
        assert "page 1 of 2" in await page.locator(".pager").inner_text()
        assert str(stream_seq) in await page.locator("ul.quarantine").inner_text()
        await shot(page, "fleet-paged")
    finally:
        await opened.close()


async def _rows_with(ui: UIReplayerService, tag: str, count: int) -> bool:
    return sum(1 for r in ui.fleet.rows.values() if r.id.startswith(tag) and r.events) >= count


async def _checkpointed(http: httpx.AsyncClient, replica: str) -> bool:
    """Every partition the ui-replayer applied records of names it as owner (its checkpoint follows within ~1 s)."""
    health = (await http.get("/api/health")).json()
    (mine,) = [p for p in health["projections"] if p["projection"] == "ui-replayer"]
    return {p["owner"] for p in mine["partitions"] if p["applied"]} == {replica}


async def _quarantined(http: httpx.AsyncClient, stream_seq: int) -> bool:
    ui_health = (await http.get("/api/health")).json()
    return any(q.get("stream_seq") == stream_seq for q in ui_health["quarantined"])


async def test_refusals_are_counted_by_code_per_interval_and_drawn_on_the_overview(
    ui: UIReplayerService, http: httpx.AsyncClient
) -> None:
    ui.deployment.sample()
    REQUESTS.labels("gateway", "chat", "DERIVATION_DIVERGES").inc(3)
    REQUESTS.labels("gateway", "chat", "ok").inc(5)  # answers are not refusals
    ui.deployment.sample()
    refusals = ui.deployment.refusals()
    assert refusals["intervals"][-1]["by_code"] == {
        **dict.fromkeys(refusals["codes"], 0),
        "DERIVATION_DIVERGES": 3,
    }
    assert "ok" not in refusals["codes"]
    ui.deployment._cached = None  # the panel is cached for two seconds
    page = (await http.get("/")).text
    assert "refusals by code" in page and "DERIVATION_DIVERGES" in page


async def test_a_long_transcript_pages_back_and_only_its_latest_page_follows_live(
    log: SessionLog, http: httpx.AsyncClient
) -> None:
    writer = await log.create(new_session_id("long"))
    await writer.emit("turn/start", {"turn": 1})
    for i in range(450):
        await writer.emit("user/message", user_message_data(f"line {i}", f"u{i}"), surface_op="append")
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await writer.close()
    sid = writer.session_id
    latest = (await http.get(f"/sessions/{sid}")).text
    assert latest.count('class="entry ') == 400 and 'data-live="1"' in latest
    assert "line 449" in latest and ">line 49<" not in latest
    before = int(latest.split('class="earlier" href="')[1].split("before=")[1].split('"')[0])
    earlier = (await http.get(f"/sessions/{sid}", params={"before": before})).text
    assert ">line 0<" in earlier and "line 449" not in earlier and 'data-live="0"' in earlier
