"""Reliability, fault 4 of issue 15: writer processes killed with SIGKILL at every checkpoint of a tool turn.

Each checkpoint of `reliability_writer.CHECKPOINTS` gets a real process that writes a session as an agent does and
kills itself there (before and after the request flush, mid chunks, after the message announcing two calls, before
and after the tool/call flush, after a result, after the answering message). Then: the repairer closes each open turn
with the SPEC 7 closers the durable prefix calls for (`TOOL_OUTCOME_UNKNOWN` for a durable tool/call,
`TOOL_NOT_STARTED` for a call only announced, then `step/end` and `turn/end` interrupted); `resume` continues the
session; and the gateway accepts the next request of the resumed session. The full run repeats every checkpoint.

(The same for the gateway's record mode, when it exists: issue 11, wt-record.)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from natsfixtures import new_session_id
from reliability import Stopwatch, record_figures, scale
from reliability_writer import CALLS, CHECKPOINTS
from scaffold import WAIT_S, eventually
from sessiongen import user_message_data
from test_gateway import gateway_config
from test_repairer import Stack, codes, lease_free

from services.gateway import ScriptedProvider, ServerThread, build_app
from sessionlog.log import SessionLog
from sessionlog.micro import call
from sessionlog.session import Session
from sessionlog.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

WRITER = Path(__file__).resolve().parent / "reliability_writer.py"


@pytest.fixture(scope="module")
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture(scope="module")
def gateway(provisioned: Settings, provider: ScriptedProvider) -> Iterator[ServerThread]:
    with (
        ServerThread(provider.app()) as upstream,
        ServerThread(build_app(provisioned, gateway_config(provisioned, upstream.url))) as served,
    ):
        yield served


@pytest_asyncio.fixture(loop_scope="module")
async def stack(url: str) -> AsyncIterator[Stack]:
    async with Stack(url) as opened:
        yield opened


def expected_closer_codes(prefix: Session) -> list[str]:
    """SPEC 7 read independently of repair.py: the open step's announced calls without a result, in order
    (a durable tool/call: outcome unknown; none: not started), then step/end if a step is open, then turn/end."""
    if prefix.open_turn is None:
        return []
    out: list[str] = []
    step = prefix.open_step
    if step is not None:
        events = [json.loads(e.raw) for e in prefix]
        here = [e for e in events if e["data"].get("turn") == prefix.open_turn and e["data"].get("step") == step.number]
        announced = [
            block["id"]
            for e in here
            if e["type"] == "assistant/message"
            for block in e["data"]["message"]["content"]
            if block["type"] == "tool-call"
        ]
        called = {e["data"]["callId"] for e in here if e["type"] == "tool/call"}
        answered = {e["data"]["message"]["content"][0]["toolCallId"] for e in here if e["type"] == "tool/result"}
        out += ["TOOL_OUTCOME_UNKNOWN" if c in called else "TOOL_NOT_STARTED" for c in announced if c not in answered]
        out.append("step/end")
    return [*out, "turn/end"]


# What each checkpoint leaves durable is fixed by the flushes the writer makes before dying there; the two kills
# before a flush leave whatever the write-behind window had published (nothing, the way the writer queues).
EXACT = {
    "before-request-flush": [],
    "after-request-flush": ["step/end", "turn/end"],
    "mid-chunks": ["step/end", "turn/end"],
    "after-assistant-message": ["TOOL_NOT_STARTED", "TOOL_NOT_STARTED", "step/end", "turn/end"],
    "after-call-flush": ["TOOL_OUTCOME_UNKNOWN", "TOOL_NOT_STARTED", "step/end", "turn/end"],
    "after-tool-result": ["TOOL_NOT_STARTED", "step/end", "turn/end"],
    "after-final-message": ["step/end", "turn/end"],
}


def start_writer(url: str, session_id: str, checkpoint: str, workdir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(SESSIONLOG_NATS_URL=url, SESSIONLOG_LEASE_TTL_S="1", SESSIONLOG_METRICS_PORT="0")
    return subprocess.Popen(
        [sys.executable, str(WRITER), session_id, checkpoint],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def writers_prefix(log: SessionLog, session_id: str) -> list[bytes]:
    """What the dead writer made durable: the events of every record not written by the repairer (epoch 0), which
    may already have closed the turn."""
    records = await log.reader.records(session_id)
    return [raw for record in records if record.epoch != 0 for raw in record.events]


async def resumed_request(log: SessionLog, http: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    """Resume once the dead writer's lease is gone, write the next turn's request, and send it through the gateway
    (derive mode); returns the provider's answer as the gateway relayed it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            writer = await log.resume(session_id)
            break
        except Exception as err:  # LEASE_HELD until the 1 s lease of the dead process expires
            if getattr(err, "code", None) != "LEASE_HELD" or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
    try:
        session = writer.session
        assert session.open_turn is None, "resume leaves no open turn"
        turn = session.last_turn + 1
        await writer.emit("turn/start", {"turn": turn})
        await writer.emit("user/message", user_message_data("go on", f"u{turn}"), surface_op="append")
        await writer.emit("step/start", {"turn": turn, "step": 1})
        header = {"config": {"provider": "scripted", "model": "scripted-model"}, "system": "be brief"}
        await writer.emit("request/header", {"header": header, "reason": "resume"})
        seq = await writer.flush()
        response = await http.post(
            f"/v1/sessions/{session_id}/completions", json={}, headers={"X-Session-Seq": str(seq)}
        )
        assert response.status_code == 200, f"{session_id}: the gateway refused the next request: {response.text}"
        return dict(response.json())
    finally:
        await writer.abandon()


async def test_writers_killed_at_every_checkpoint_of_a_tool_turn_are_repaired_resumed_and_served(
    stack: Stack, gateway: ServerThread, provider: ScriptedProvider, tmp_path: Path
) -> None:
    rounds = scale(1, 5)
    await stack.repairer()
    log = await stack.connect()
    provider.load([{"text": "carrying on"}] * (rounds * len(CHECKPOINTS)))
    repaired_in = Stopwatch()
    killed = 0
    events_checked = 0
    async with httpx.AsyncClient(base_url=gateway.url, timeout=WAIT_S) as http:
        for _ in range(rounds):
            sessions = {checkpoint: new_session_id(checkpoint[:12]) for checkpoint in CHECKPOINTS}
            procs = {cp: start_writer(stack.url, sid, cp, tmp_path) for cp, sid in sessions.items()}
            for checkpoint, proc in procs.items():
                out, err = await asyncio.to_thread(proc.communicate, None, 60)
                assert out.strip() == f"at {checkpoint}".encode(), err.decode(errors="replace")[-2000:]
                assert proc.returncode == -9, f"{checkpoint}: the writer was not killed ({proc.returncode})"
                killed += 1
            died_at = time.monotonic()
            for checkpoint, sid in sessions.items():
                prefix = Session(await writers_prefix(log, sid))
                expected = expected_closer_codes(prefix)
                if checkpoint in EXACT:
                    assert expected == EXACT[checkpoint], f"{checkpoint}: the durable prefix is not what it flushed"
                else:  # before-call-flush: the call never became durable, so its body never started
                    assert "TOOL_OUTCOME_UNKNOWN" not in expected
                if expected:

                    async def closed(sid: str = sid, length: int = len(prefix)) -> bool:
                        events = await log.reader.events(sid)
                        return len(events) > length and Session(events).open_turn is None

                    await eventually(closed, f"{checkpoint}: the repairer closes {sid}", WAIT_S * 2)
                    repaired_in.since(died_at)
                events = await log.reader.events(sid)
                closers = events[len(prefix) :]
                assert codes(closers) == expected, f"{checkpoint}: wrong closers"
                if closers:
                    assert json.loads(closers[-1])["data"]["reason"] == {"kind": "interrupted"}
                    results = [
                        json.loads(c)["data"]["message"]["source"]["callId"] for c in closers if b"tool/result" in c
                    ]
                    assert results == [c for c in CALLS if c in results], "synthetic results in announcement order"
                # The repairer answers "nothing to close" now, whatever the checkpoint.
                await lease_free(log, sid)
                again = await call(log.nc, "sessionlog.repair.close", {"session": sid}, timeout=WAIT_S)
                assert again["closers"] == []
                answer = await resumed_request(log, http, sid)
                assert answer["choices"][0]["message"]["content"] == "carrying on"
                final = Session(await log.reader.events(sid))  # every rule holds on the whole log
                events_checked += len(final)
    record_figures(
        "writer processes killed at every checkpoint of a tool turn",
        fault="SIGKILL of a writer process at each of 8 checkpoints",
        events_written=events_checked,
        faults_injected=killed,
        events_lost=0,
        worst_recovery_s=repaired_in.worst,
        recovery="repairer closes the turn (1 s lease, 0.3 s grace), resume, gateway request 200",
    )
