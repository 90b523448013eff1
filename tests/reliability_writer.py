"""A writer process for the reliability suite: it writes one session as an agent does and kills itself with SIGKILL
at a named checkpoint of a tool turn (fault 4 of issue 15).

    python tests/reliability_writer.py SESSION_ID CHECKPOINT     (the log from SESSIONLOG_* settings)
    python tests/reliability_writer.py --load PREFIX COUNT SECONDS

The second form is the load of issue 15: COUNT sessions written concurrently for SECONDS, each a whole streamed tool
turn now and then; at the end it prints one JSON line: every session's last acknowledged seq and every failure.

The session gets one whole turn first, then a second turn that streams an answer announcing two tool calls, runs
them (a durable `tool/call` before each body, as SPEC 7 needs) and ends with a step that answers. `CHECKPOINTS` are
the moments the process may die at; it prints `at CHECKPOINT` just before it does.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sessiongen import (
    assistant_message_data,
    closed_turn,
    streamed_turn,
    text_block,
    tool_call_block,
    tool_result_data,
    user_message_data,
)

from sessionlog.log import SessionLog, SessionWriter

CHECKPOINTS = (
    "before-request-flush",  # the turn's first events queued, nothing of it durable
    "after-request-flush",  # the request header durable, no chunk yet
    "mid-chunks",  # some chunks durable, more queued
    "after-assistant-message",  # the message announcing two calls durable, no tool/call yet
    "before-call-flush",  # the first tool/call queued, not flushed: its body has not started
    "after-call-flush",  # the first tool/call durable: its body may have run
    "after-tool-result",  # the first call's result durable, the second call not started
    "after-final-message",  # the answering step's assistant message durable, the turn not ended
)
CALLS = ("call-a", "call-b")
# The load's pause between an agent's turns (its model and its tools), in seconds: "LOW,HIGH".
PAUSE_S = tuple(float(s) for s in os.environ.get("RELIABILITY_LOAD_PAUSE_S", "2,8").split(","))


def die(checkpoint: str) -> None:
    print(f"at {checkpoint}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


async def tool_turn(writer: SessionWriter, checkpoint: str) -> None:
    turn = writer.session.last_turn + 1
    await writer.emit("turn/start", {"turn": turn})
    await writer.emit("user/message", user_message_data("read two files", f"u{turn}"), surface_op="append")
    await writer.emit("step/start", {"turn": turn, "step": 1})
    header = {"config": {"provider": "scripted", "model": "scripted-model"}, "system": "be brief"}
    reason = "initial" if writer.session.fold_request_header() is None else "change"
    await writer.emit("request/header", {"header": header, "reason": reason})
    if checkpoint == "before-request-flush":
        die(checkpoint)
    await writer.flush()  # before the provider request
    if checkpoint == "after-request-flush":
        die(checkpoint)
    first = writer.next_seq
    chunk = {"type": "block-start", "index": 0, "blockType": "text"}
    await writer.emit("assistant/chunk", {"turn": turn, "step": 1, "chunk": chunk})
    for i in range(6):
        delta = {"type": "text-delta", "index": 0, "text": f"w{i} "}
        await writer.emit("assistant/chunk", {"turn": turn, "step": 1, "chunk": delta})
        if i == 2:
            await writer.flush()  # a write-behind window closed mid-stream
    if checkpoint == "mid-chunks":
        die(checkpoint)
    said = "".join(f"w{i} " for i in range(6))
    end = {"type": "block-end", "index": 0, "block": text_block(said)}
    await writer.emit("assistant/chunk", {"turn": turn, "step": 1, "chunk": end})
    calls = [tool_call_block(call_id, "read", f'{{"path":"{call_id}.txt"}}') for call_id in CALLS]
    message = assistant_message_data(turn, 1, [text_block(said), *calls], f"a{turn}")
    await writer.emit(
        "assistant/message", message, surface_op="append", source_event_seqs=list(range(first, first + 8))
    )
    if checkpoint == "after-assistant-message":
        await writer.flush()
        die(checkpoint)
    for call in calls:
        data = {"turn": turn, "step": 1, "callId": call["id"], "name": "read", "arguments": call["arguments"]}
        call_seq = (await writer.emit("tool/call", data)).seq
        if checkpoint == "before-call-flush":
            die(checkpoint)
        await writer.flush()  # before the tool body
        if checkpoint == "after-call-flush":
            die(checkpoint)
        result = tool_result_data(turn, 1, call["id"], "contents", msg_id=f"r-{call['id']}")
        await writer.emit("tool/result", result, surface_op="append", source_event_seqs=[call_seq])
        if checkpoint == "after-tool-result":
            await writer.flush()
            die(checkpoint)
    await writer.emit("step/end", {"turn": turn, "step": 1})
    await writer.emit("step/start", {"turn": turn, "step": 2})
    await writer.flush()  # before the second provider request
    answer = assistant_message_data(turn, 2, [text_block("both read")], f"a{turn}b")
    await writer.emit("assistant/message", answer, surface_op="append", source_event_seqs=[])
    if checkpoint == "after-final-message":
        await writer.flush()
        die(checkpoint)
    await writer.emit("step/end", {"turn": turn, "step": 2})
    await writer.emit("turn/end", {"turn": turn, "reason": {"kind": "completed"}})
    await writer.flush()


async def main(session_id: str, checkpoint: str) -> None:
    if checkpoint not in CHECKPOINTS:
        raise SystemExit(f"unknown checkpoint {checkpoint!r}; one of {', '.join(CHECKPOINTS)}")
    log = await SessionLog.connect()
    writer = await log.create(session_id)
    await closed_turn(writer, "first question")
    await writer.flush()
    await tool_turn(writer, checkpoint)
    print("finished without dying", flush=True)
    await writer.close()
    await log.close()


async def one_session(log: SessionLog, session_id: str, until: float, failures: list[str]) -> tuple[str, int]:
    writer = await log.create(session_id)
    chance = random.Random(session_id)
    turns = 0
    try:
        await asyncio.sleep(chance.uniform(0, 1))  # spread the sessions' turns over time
        while time.monotonic() < until:
            await streamed_turn(writer, f"turn {turns}", deltas=chance.randint(3, 12), tools=turns % 3)
            await writer.flush()
            turns += 1
            await asyncio.sleep(chance.uniform(*PAUSE_S))  # an agent waits for its model and its tools
        await writer.close()
    except Exception as err:  # reported, not raised: the test decides
        failures.append(f"{session_id}: {type(err).__name__}: {err}")
        await writer.abandon()
    return session_id, writer.durable_seq


async def load(prefix: str, count: int, seconds: float) -> None:
    log = await SessionLog.connect()
    failures: list[str] = []
    until = time.monotonic() + seconds
    done = await asyncio.gather(*(one_session(log, f"{prefix}-{i}", until, failures) for i in range(count)))
    await log.close()
    print(json.dumps({"acked": dict(done), "failures": failures}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--load":
        asyncio.run(load(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
    else:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
