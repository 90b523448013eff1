"""An ordinary tool loop on the official `openai` SDK; the gateway's record mode keeps its event log.

Nothing here knows about sessionlog: only the base URL points at the gateway, `/record/{session_id}/v1`. The
first turn is not streamed, the second is, and each appends the assistant message the SDK returned, as it is.

    python examples/record_openai.py SESSION_ID   # GATEWAY_URL (default http://127.0.0.1:8470), MODEL
"""

import json
import os
import sys

from openai import OpenAI

session_id = sys.argv[1]
gateway = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8470")
client = OpenAI(base_url=f"{gateway}/record/{session_id}/v1", api_key=os.environ.get("GATEWAY_API_KEY", "unused"))
model = os.environ.get("MODEL", "deepseek-chat")

tools = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: int, b: int) -> int:
    return a + b


messages = [{"role": "system", "content": "You are a careful assistant. Use the add tool for sums."}]


def ask(stream: bool):
    if not stream:
        return client.chat.completions.create(model=model, messages=messages, tools=tools).choices[0].message
    options = {"include_usage": True}
    with client.chat.completions.stream(model=model, messages=messages, tools=tools, stream_options=options) as events:
        for event in events:
            if event.type == "content.delta":
                print(event.delta, end="", flush=True)
        print()
        return events.get_final_completion().choices[0].message


def turn(question: str, stream: bool) -> str:
    messages.append({"role": "user", "content": question})
    while True:
        message = ask(stream)
        messages.append(message)  # the SDK's own object goes back into the history
        if not message.tool_calls:
            return message.content
        for call in message.tool_calls:
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})


print("answer:", turn("What is 2 + 3?", stream=False))
print("answer:", turn("And that doubled?", stream=True))
