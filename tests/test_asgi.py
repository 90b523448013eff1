"""The in-loop ASGI server (`sessionlog.asgi`): stopping it while a request never ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from sessionlog.asgi import GRACEFUL_SHUTDOWN_S, STOP_TIMEOUT_S, serve_asgi, uvicorn_config
from sessionlog.embedded import free_port


def test_a_stopping_server_cancels_its_open_requests_in_time_for_the_lifespan_shutdown() -> None:
    assert uvicorn_config(Starlette()).timeout_graceful_shutdown == GRACEFUL_SHUTDOWN_S < STOP_TIMEOUT_S - 2


async def test_a_streamed_answer_that_never_ends_does_not_keep_the_lifespan_shutdown_from_running() -> None:
    """Found probing record mode, 2026-12-05: a gateway stopped (SIGTERM) while an answer streamed for longer than the
    stop's 10 s was cancelled whole, its lifespan shutdown never ran, and the sessions whose client ran a tool were
    neither parked nor released (the repairer then closed their turns)."""
    shut_down: list[bool] = []

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        yield
        shut_down.append(True)

    async def endless(_request: Request) -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.05)

        return StreamingResponse(lines(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/stream", endless)], lifespan=lifespan)
    server = await serve_asgi(app, "127.0.0.1", free_port(), name="test")
    async with httpx.AsyncClient(timeout=10) as client, client.stream("GET", server.url + "/stream") as response:
        lines = response.aiter_lines()  # kept: a dropped iterator closes the response, which ends the request
        await anext(lines)  # streaming now
        await server.stop()  # cancels the endless answer after GRACEFUL_SHUTDOWN_S, then shuts the app down
    assert shut_down == [True]
    assert server.task.done() and not server.task.cancelled()
