"""An `openai-agents` agent on its chat-completions model; the gateway's record mode keeps its event log.

Nothing here knows about sessionlog: the agent's `AsyncOpenAI` client has the gateway's base URL,
`/record/{session_id}/v1`. The first run is not streamed, the second is and continues the first's history.

    python examples/record_agents.py SESSION_ID   # GATEWAY_URL (default http://127.0.0.1:8470), MODEL
"""

import asyncio
import os
import sys

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main(session_id: str) -> None:
    set_tracing_disabled(True)  # the gateway's log is the record; no traces go to the OpenAI platform
    gateway = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8470")
    client = AsyncOpenAI(base_url=f"{gateway}/record/{session_id}/v1", api_key=os.environ.get("GATEWAY_API_KEY", "-"))
    model = OpenAIChatCompletionsModel(model=os.environ.get("MODEL", "deepseek-chat"), openai_client=client)
    agent = Agent(name="calculator", instructions="You are a careful assistant. Use the add tool for sums.",
                  model=model, tools=[add])  # fmt: skip

    first = await Runner.run(agent, "What is 2 + 3?")
    print("answer:", first.final_output)

    second = Runner.run_streamed(agent, [*first.to_input_list(), {"role": "user", "content": "And that doubled?"}])
    async for _ in second.stream_events():
        pass
    print("answer:", second.final_output)


asyncio.run(main(sys.argv[1]))
