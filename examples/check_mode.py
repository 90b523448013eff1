"""Check mode: the agent writes its own log and the gateway checks every request against it.

Every event goes through the session writer; the request is rebuilt from the log with `to_wire` after a flush, and
names the session and the flushed seq in `X-Session-Id` / `X-Session-Seq`. The gateway forwards it only if it is
exactly what the durable log derives (409 `DERIVATION_DIVERGES` otherwise, before the provider sees anything).

    python examples/check_mode.py SESSION_ID   # the log from SESSIONLOG_NATS_URL (default: the embedded server);
                                               # GATEWAY_URL (default http://127.0.0.1:8470), MODEL
"""

import asyncio
import os
import sys

from openai import AsyncOpenAI

from sessionlog.log import SessionLog
from sessionlog.settings import Settings
from sessionlog.wire import to_wire


async def main(session_id: str) -> None:
    gateway = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8470")
    client = AsyncOpenAI(base_url=f"{gateway}/v1", api_key=os.environ.get("GATEWAY_API_KEY", "unused"))
    model = os.environ.get("MODEL", "deepseek-chat")
    log = await SessionLog.connect(Settings())
    writer = await log.create(session_id)
    try:
        await writer.emit("turn/start", {"turn": 1})
        question = {"type": "text", "text": "What is 2 + 3?"}
        user = {"id": "u1", "role": "user", "source": {"kind": "user"}, "content": [question]}
        await writer.emit("user/message", user, surface_op="append")
        await writer.emit("step/start", {"turn": 1, "step": 1})
        header = {"config": {"provider": "default", "model": model}, "system": "You are a careful assistant."}
        await writer.emit("request/header", {"header": header, "reason": "initial"})
        seq = await writer.flush()  # durable: the gateway checks the request against the log up to here

        request = to_wire(writer.session.derive_messages(), writer.session.fold_request_header())
        names = {"X-Session-Id": session_id, "X-Session-Seq": str(seq)}
        response = await client.chat.completions.create(**request, extra_headers=names)

        text = response.choices[0].message.content
        source = {"kind": "model", "provider": "default", "model": model}
        answer = {"id": "a1", "role": "assistant", "source": source, "content": [{"type": "text", "text": text}]}
        usage = {"inputTokens": response.usage.prompt_tokens, "outputTokens": response.usage.completion_tokens}
        step = {"turn": 1, "step": 1, "message": answer, "usage": usage}
        await writer.emit("assistant/message", step, surface_op="append", source_event_seqs=[])
        await writer.emit("step/end", {"turn": 1, "step": 1})
        await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
        await writer.flush()
        print("answer:", text)
    finally:
        await writer.close()
        await log.close()


asyncio.run(main(sys.argv[1]))
