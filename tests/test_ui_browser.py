"""The transcript page in a real headless Chromium (Debian's `/usr/bin/chromium`, driven by Playwright): what a
person sees of a compacted, forked, interrupted session; a live tail that adds a streamed answer and a message while
the page is open; and a message holding a `<script>` that shows as text and never runs. Screenshots are saved under
`test-output/ui-browser/` (gitignored) and the test's tmp path."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from browserfixtures import skip_without_chromium
from conftest import REPO_ROOT
from natsfixtures import new_session_id
from scaffold import eventually, serving
from sessiongen import text_block, tool_call_block, tool_result_data, user_message_data

from services.ui_replayer.service import UIReplayerService
from sessionlog.log import SessionLog, SessionWriter
from sessionlog.repair import interrupted_turn_closers

skip_without_chromium()

pytest_plugins = ["natsfixtures", "browserfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

WAIT_MS = 10_000
SCRIPT = '<script>window.__pwned = "script"</script><img src=x onerror="window.__pwned = \'img\'">'
SCREENSHOTS = REPO_ROOT / "test-output" / "ui-browser"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ui(log: SessionLog) -> AsyncIterator[UIReplayerService]:
    partitions = list(range(log.settings.partition_count))
    async with serving(UIReplayerService(log, host="127.0.0.1", port=0, partitions=partitions)) as service:
        yield service


def screenshot_path(tmp_path: Path, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return tmp_path / f"{name}.png"


async def save(tab: Any, tmp_path: Path, name: str) -> Path:
    path = screenshot_path(tmp_path, name)
    await tab.screenshot(path=str(path), full_page=True)
    shutil.copy(path, SCREENSHOTS / path.name)
    assert path.stat().st_size > 10_000  # a real rendering, not a blank page
    return path


async def answer(writer: SessionWriter, turn: int, step: int, blocks: list[dict[str, Any]]) -> None:
    """A streamed step: chunks, then the assistant/message they assemble to."""
    seqs = []
    for index, block in enumerate(blocks):
        start = {"type": "block-start", "index": index, "blockType": block["type"]}
        seqs.append((await writer.emit("assistant/chunk", {"turn": turn, "step": step, "chunk": start})).seq)
        if block["type"] == "text":
            delta = {"type": "text-delta", "index": index, "text": block["text"]}
        else:
            delta = {
                "type": "tool-call-delta",
                "index": index,
                "id": block["id"],
                "name": block["name"],
                "argumentsDelta": block["arguments"],
            }
        seqs.append((await writer.emit("assistant/chunk", {"turn": turn, "step": step, "chunk": delta})).seq)
        end = {"type": "block-end", "index": index, "block": block}
        seqs.append((await writer.emit("assistant/chunk", {"turn": turn, "step": step, "chunk": end})).seq)
    message = {
        "id": f"a-{turn}-{step}",
        "role": "assistant",
        "content": blocks,
        "source": {"kind": "model", "provider": "p", "model": "m"},
    }
    await writer.emit(
        "assistant/message",
        {"turn": turn, "step": step, "message": message},
        surface_op="append",
        source_event_seqs=seqs,
    )


async def compacted_forked_interrupted(log: SessionLog) -> tuple[str, str, dict[str, int]]:
    """A parent whose turn 2 compacts turn 1, holds a message with a script in it and is cut by a crash (closed by
    the SPEC section 7 closers); then a fork of it. Returns (parent, child, seqs)."""
    writer = await log.create(new_session_id("parent"))
    seqs: dict[str, int] = {}
    await writer.emit("turn/start", {"turn": 1})
    seqs["question"] = (
        await writer.emit("user/message", user_message_data("What is in notes.txt?", "u1"), surface_op="append")
    ).seq
    await writer.emit("request/header", {"header": {"config": {"provider": "p", "model": "m"}}, "reason": "initial"})
    await writer.emit("step/start", {"turn": 1, "step": 1})
    await answer(writer, 1, 1, [tool_call_block("call-1", "read", '{"path":"notes.txt"}')])
    call = await writer.emit("tool/call", {"turn": 1, "step": 1, "callId": "call-1", "name": "read", "arguments": "{}"})
    result = tool_result_data(1, 1, "call-1", "buy milk", msg_id="r1")
    await writer.emit("tool/result", result, surface_op="append", source_event_seqs=[call.seq])
    await writer.emit("step/end", {"turn": 1, "step": 1})
    await writer.emit("step/start", {"turn": 1, "step": 2})
    await answer(writer, 1, 2, [text_block("notes.txt says: buy milk.")])
    seqs["last_of_turn_1"] = len(writer.session) - 1
    await writer.emit("step/end", {"turn": 1, "step": 2})
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    await writer.emit("turn/start", {"turn": 2})
    nodes = writer.session.surface.nodes
    seqs["compaction"] = (await writer.compact(nodes[0], nodes[-1], "The user asked about notes.txt: buy milk.")).seq
    seqs["first"], seqs["through"] = nodes[0], nodes[-1]
    seqs["script"] = (await writer.emit("user/message", user_message_data(SCRIPT, "u2"), surface_op="append")).seq
    await writer.emit("step/start", {"turn": 2, "step": 1})
    await answer(writer, 2, 1, [tool_call_block("call-2", "write", '{"path":"notes.txt"}')])
    await writer.emit("tool/call", {"turn": 2, "step": 1, "callId": "call-2", "name": "write", "arguments": "{}"})
    for raw in interrupted_turn_closers(writer.session):  # the crash: what resume or the repairer appends
        await writer.append(raw)
    await writer.close()
    child = new_session_id("child")
    await log.fork(writer.session_id, child)
    return writer.session_id, child, seqs


async def in_fleet_index(ui: UIReplayerService, session_id: str) -> bool:
    """Whether the UI's fleet index, which the overview and its search read, holds the session with its events."""
    return session_id in ui.fleet.rows and ui.fleet.rows[session_id].events > 0


async def visible_text(tab: Any, selector: str) -> str:
    locator = tab.locator(selector).first
    await locator.wait_for(state="visible", timeout=WAIT_MS)
    return str(await locator.inner_text())


async def test_a_compacted_forked_interrupted_session_reads_as_a_person_expects(
    ui: UIReplayerService, log: SessionLog, page: Any, tmp_path: Path
) -> None:
    parent, child, seqs = await compacted_forked_interrupted(log)
    await page.goto(f"{ui.url}/sessions/{child}")
    fork = await visible_text(page, ".banner.fork")
    assert f"forked from {parent}" in fork
    assert await page.locator(".banner.fork a.parent").get_attribute("href") == f"/sessions/{parent}"
    marker = await visible_text(page, ".compaction .marker")
    assert marker == f"summarised for the model: events {seqs['first']}-{seqs['through']}"
    # the compaction removed nothing: every original message is still there to read
    for text in ("What is in notes.txt?", "buy milk", "notes.txt says: buy milk."):
        assert await page.get_by_text(text, exact=True).first.is_visible(), text
    synthetic = await visible_text(page, ".msg.synthetic .badge.synthetic")
    assert "synthetic result" in synthetic and "outcome is unknown" in synthetic
    assert "Turn 2 interrupted by a crash" in await visible_text(page, ".turn-end.outcome-interrupted")
    assert "inherited history ends here" in await visible_text(page, ".seed")
    # the script in a message is text on the page, and it never ran
    shown = await visible_text(page, f"#e{seqs['script']} .block.text .body")
    assert shown == SCRIPT
    assert await page.evaluate("typeof window.__pwned") == "undefined"
    assert await page.locator("main img").count() == 0 and await page.locator("main script").count() == 0
    assert page.dialogs == [] and page.errors == []
    await save(page, tmp_path, "compacted-forked-interrupted")
    await eventually(lambda: in_fleet_index(ui, child), "the child in the fleet index")
    await page.goto(f"{ui.url}/?q={child}")
    assert await page.locator("table.sessions a.session-link").all_inner_texts() == [child]


async def test_an_open_page_shows_a_streamed_answer_and_new_messages_as_they_arrive(
    ui: UIReplayerService, log: SessionLog, page: Any, tmp_path: Path
) -> None:
    writer = await log.create(new_session_id("live"))
    try:
        await writer.emit("turn/start", {"turn": 1})
        await writer.emit("user/message", user_message_data("Count to three.", "u1"), surface_op="append")
        await writer.emit(
            "request/header", {"header": {"config": {"provider": "p", "model": "m"}}, "reason": "initial"}
        )
        await writer.emit("step/start", {"turn": 1, "step": 1})
        await writer.flush()
        await page.goto(f"{ui.url}/sessions/{writer.session_id}")
        await page.locator("#live-status.on").wait_for(state="attached", timeout=WAIT_MS)
        start = {"type": "block-start", "index": 0, "blockType": "text"}
        chunks = [(await writer.emit("assistant/chunk", {"turn": 1, "step": 1, "chunk": start})).seq]
        for piece in ("one, ", "two, "):
            delta = {"type": "text-delta", "index": 0, "text": piece}
            chunks.append((await writer.emit("assistant/chunk", {"turn": 1, "step": 1, "chunk": delta})).seq)
        await writer.flush()
        streaming = page.locator(".msg.stream .block.text .body")
        await streaming.filter(has_text="one, two,").wait_for(timeout=WAIT_MS)
        assert "streaming" in await visible_text(page, ".msg.stream .state")
        await save(page, tmp_path, "live-streaming")
        delta = {"type": "text-delta", "index": 0, "text": "three."}
        chunks.append((await writer.emit("assistant/chunk", {"turn": 1, "step": 1, "chunk": delta})).seq)
        message = {
            "id": "a1",
            "role": "assistant",
            "content": [text_block("one, two, three.")],
            "source": {"kind": "model", "provider": "p", "model": "m"},
        }
        await writer.emit(
            "assistant/message",
            {"turn": 1, "step": 1, "message": message},
            surface_op="append",
            source_event_seqs=chunks,
        )
        await writer.emit("step/end", {"turn": 1, "step": 1})
        await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
        await writer.emit("turn/start", {"turn": 2})
        await writer.emit("user/message", user_message_data(SCRIPT + " and thanks!", "u2"), surface_op="append")
        await writer.flush()
        await page.get_by_text("one, two, three.", exact=True).wait_for(timeout=WAIT_MS)
        await page.locator(".turn-end.outcome-completed").wait_for(timeout=WAIT_MS)
        await page.get_by_text(SCRIPT + " and thanks!", exact=True).wait_for(timeout=WAIT_MS)
        assert await page.locator(".msg.stream").count() == 0  # the message took the streamed answer's place
        assert await page.evaluate("typeof window.__pwned") == "undefined"
        assert await page.locator("main img").count() == 0 and page.dialogs == [] and page.errors == []
        await save(page, tmp_path, "live-tail")
    finally:
        await writer.close()
