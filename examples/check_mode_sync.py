"""Check mode for an agent that is not async: the same protocol as `examples/check_mode.py`, with the synchronous
writer (`sessionlog.sync`) and the synchronous `OpenAI` client.

The writer's lease is refreshed on a thread of its own, so a model call or a tool that blocks this thread for longer
than the lease lasts cannot let it lapse unnoticed.

    python examples/check_mode_sync.py SESSION_ID   # the log from SESSIONLOG_NATS_URL (default: the embedded
                                                    # server); GATEWAY_URL (default http://127.0.0.1:8470), MODEL
"""

import os
import sys

from openai import OpenAI

from sessionlog.settings import Settings
from sessionlog.sync import SyncSessionLog
from sessionlog.wire import to_wire

session_id = sys.argv[1]
gateway = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8470")
client = OpenAI(base_url=f"{gateway}/v1", api_key=os.environ.get("GATEWAY_API_KEY", "unused"))
model = os.environ.get("MODEL", "deepseek-chat")

with SyncSessionLog(Settings()) as log:
    writer = log.create(session_id)
    writer.emit("turn/start", {"turn": 1})
    question = {"type": "text", "text": "What is 2 + 3?"}
    writer.emit("user/message", {"id": "u1", "role": "user", "source": {"kind": "user"}, "content": [question]},
                surface_op="append")  # fmt: skip
    writer.emit("step/start", {"turn": 1, "step": 1})
    header = {"config": {"provider": "default", "model": model}, "system": "You are a careful assistant."}
    writer.emit("request/header", {"header": header, "reason": "initial"})
    seq = writer.flush()  # durable: the gateway checks the request against the log up to here

    request = to_wire(writer.session.derive_messages(), writer.session.fold_request_header())
    response = client.chat.completions.create(**request, extra_headers={"X-Session-Id": session_id,
                                                                        "X-Session-Seq": str(seq)})  # fmt: skip

    text = response.choices[0].message.content
    source = {"kind": "model", "provider": "default", "model": model}
    answer = {"id": "a1", "role": "assistant", "source": source, "content": [{"type": "text", "text": text}]}
    usage = {"inputTokens": response.usage.prompt_tokens, "outputTokens": response.usage.completion_tokens}
    writer.emit("assistant/message", {"turn": 1, "step": 1, "message": answer, "usage": usage},
                surface_op="append", source_event_seqs=[])  # fmt: skip
    writer.emit("step/end", {"turn": 1, "step": 1})
    writer.emit("turn/end", {"turn": 1, "reason": {"kind": "completed"}})
    print("answer:", text)  # leaving the block flushes the writer, releases its lease and closes the connection
