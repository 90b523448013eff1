"""The scripted provider: a real local HTTP server speaking OpenAI chat-completions, replying from a script.

For offline demos, tests and benchmarks. It streams SSE chunks (`data: {...}` lines, then `data: [DONE]`) or
answers one JSON object, exactly as an OpenAI-compatible provider does, and records every request body it
received, so a test can assert that a refused request never reached it.

A script is a JSON array or JSONL file of replies, used in order (`cycle` repeats them). A reply is an object:

- `text`: the assistant's text; `reasoning_content`: DeepSeek-style reasoning, streamed before the text;
- `refusal`: an OpenAI refusal instead of text (`content: null` and `refusal` in the message, `refusal` deltas);
- `tool_calls`: `[{"id", "name", "arguments"}]` (arguments a string, streamed in pieces);
- `usage`: `{"prompt_tokens", "completion_tokens"}` (default: a rough count), sent when streaming only if the
  request asks with `stream_options.include_usage`;
- `finish_reason`: default `tool_calls` when there are tool calls, else `stop`;
- `delay_s`: wait before answering at all; `chunk_delay_s`: wait between streamed chunks; `end_delay_s`: keep the
  streamed body open that long after `data: [DONE]` (a provider whose stream ends after its last line);
- `status` and `error`: answer that HTTP status with an OpenAI-style error instead;
- `disconnect_after`: drop the connection after that many streamed chunks;
- `error_after`: answer HTTP 200 but carry the `error` as an OpenAI-style error object in the body, as providers do
  when they fail once the status is sent: streamed, a `data:` line after that many chunks (then `data: [DONE]`);
  not streamed, the whole body;
- `headers`: response headers to send with the reply (`retry-after`, `x-ratelimit-remaining-requests`, ...);
- `stamp_chunks`: each streamed chunk's `system_fingerprint` is `sent_ns=<CLOCK_MONOTONIC in ns>` as it is sent,
  so a client on the same machine can tell how long each chunk took to reach it (the benchmarks do).

When the script is used up the provider answers 500 "script exhausted". `GET /v1/models` lists its one model;
`GET /_scripted/requests` returns the bodies received; `POST /_scripted/script` replaces the script.

A script is checked when it is loaded: an unknown field, a value of the wrong type, a negative delay or a status
outside 100-599 is a `ScriptError` naming the reply and field (`POST /_scripted/script` answers it 400 and keeps
the script it had).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class ScriptError(ValueError):
    """A script that is not a list of replies as described above: which reply, which field, and why."""


NonNegative = Annotated[float, Meta(ge=0)]


class _ToolCall(Struct, forbid_unknown_fields=True):
    id: str
    name: str
    arguments: str = ""


class _Reply(Struct, forbid_unknown_fields=True):
    """The shape of one reply, checked when a script is loaded (a misspelt field or a delay in words is refused
    then, not answered as something else later)."""

    text: str = ""
    reasoning_content: str = ""
    refusal: str = ""
    tool_calls: list[_ToolCall] = []
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    delay_s: NonNegative = 0.0
    chunk_delay_s: NonNegative = 0.0
    end_delay_s: NonNegative = 0.0
    status: Annotated[int, Meta(ge=100, le=599)] = 200
    error: str | None = None
    disconnect_after: Annotated[int, Meta(ge=0)] | None = None
    error_after: Annotated[int, Meta(ge=0)] | None = None
    headers: dict[str, str] = {}
    stamp_chunks: bool = False


def check_script(replies: Any) -> list[dict[str, Any]]:
    """The replies of a decoded script, each checked against the reply fields; `ScriptError` names the first
    reply that does not fit (`$[2].delay_s`: the third reply's delay)."""
    if isinstance(replies, tuple):
        replies = list(replies)
    if not isinstance(replies, list):
        raise ScriptError(f"not a script of replies: a JSON array of reply objects, not {type(replies).__name__}")
    try:
        msgspec.convert(replies, list[_Reply])
    except msgspec.ValidationError as err:
        raise ScriptError(f"not a script of replies: {err}") from None
    return [dict(reply) for reply in replies]


def load_script(path: Path) -> list[dict[str, Any]]:
    """Replies from a JSON array or a JSONL file (one reply per line; blank lines and `#` lines skipped), checked."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ScriptError(f"not a script of replies: not UTF-8 text ({err})") from None
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            replies = msgspec.json.decode(stripped)
        else:
            lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
            replies = [msgspec.json.decode(line) for line in lines]
    except msgspec.DecodeError as err:
        raise ScriptError(f"not a script of replies: not JSON ({err})") from None
    return check_script(replies)


class _Dropped(Exception):
    """Raised inside a streaming reply to drop the connection on purpose (`disconnect_after`)."""


class ScriptedProvider:
    """The provider's state: the script, the position in it, and what it received."""

    def __init__(
        self,
        script: list[dict[str, Any]] | tuple[dict[str, Any], ...] | Path | None = None,
        *,
        cycle: bool = False,
        model: str = "scripted",
    ) -> None:
        self._lock = threading.Lock()
        self._replies: list[dict[str, Any]] = []
        self._next = 0
        self.cycle = cycle
        self.model = model
        self.received: list[bytes] = []
        self.disconnects = 0
        self.completed = 0
        self.load(script if script is not None else [])

    def load(self, script: list[dict[str, Any]] | tuple[dict[str, Any], ...] | Path) -> None:
        """Replace the script and start from its first reply."""
        replies = load_script(script) if isinstance(script, Path) else check_script(script)
        with self._lock:
            self._replies = replies
            self._next = 0

    def clear(self) -> None:
        with self._lock:
            self.received.clear()
            self.disconnects = 0
            self.completed = 0

    def _take(self) -> dict[str, Any] | None:
        with self._lock:
            if self._next >= len(self._replies):
                if not self.cycle or not self._replies:
                    return None
                self._next = 0
            reply = self._replies[self._next]
            self._next += 1
            return reply

    # ---------------------------------------------------------------------------------- endpoints

    async def completions(self, request: Request) -> Response:
        body = await request.body()
        self.received.append(body)
        try:
            parsed = msgspec.json.decode(body)
        except msgspec.DecodeError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(parsed, dict) or not isinstance(parsed.get("messages"), list):
            return _error(400, "a chat-completions request needs a messages array", "invalid_request_error")
        reply = self._take()
        if reply is None:
            return _error(500, "script exhausted: the scripted provider has no reply left", "server_error")
        delay = float(reply.get("delay_s", 0))
        if delay and not await _sleep_unless_disconnected(request, delay):
            self.disconnects += 1
            return Response(status_code=499)
        status = int(reply.get("status", 200))
        headers = dict(reply.get("headers") or {})
        if status != 200:
            error = _error(status, str(reply.get("error", f"scripted error {status}")), "server_error")
            error.headers.update(headers)
            return error
        model = str(parsed.get("model") or self.model)
        if parsed.get("stream") is True:
            include_usage = bool((parsed.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(
                self._stream(reply, model, include_usage, len(body)), media_type="text/event-stream", headers=headers
            )
        self.completed += 1
        if reply.get("error_after") is not None:
            return Response(_error_object(reply), media_type="application/json", headers=headers)
        completion = msgspec.json.encode(_completion(reply, model, len(body)))
        return Response(completion, media_type="application/json", headers=headers)

    async def _stream(self, reply: dict[str, Any], model: str, include_usage: bool, size: int) -> AsyncIterator[bytes]:
        chunk_delay = float(reply.get("chunk_delay_s", 0))
        drop_after = reply.get("disconnect_after")
        error_after = reply.get("error_after")
        stamp = bool(reply.get("stamp_chunks"))
        sent = 0
        try:
            for chunk in _chunks(reply, model, include_usage, size):
                if drop_after is not None and sent >= int(drop_after):
                    raise _Dropped("scripted disconnect")
                if error_after is not None and sent >= int(error_after):
                    break
                if sent and chunk_delay:
                    await asyncio.sleep(chunk_delay)
                if stamp:
                    chunk = {**chunk, "system_fingerprint": f"sent_ns={time.monotonic_ns()}"}
                yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                sent += 1
            if error_after is not None:
                yield b"data: " + _error_object(reply) + b"\n\n"
            yield b"data: [DONE]\n\n"
            end_delay = float(reply.get("end_delay_s", 0))
            if end_delay:
                await asyncio.sleep(end_delay)
            self.completed += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.disconnects += 1
            raise

    async def requests(self, request: Request) -> Response:
        return JSONResponse([msgspec.json.decode(b) for b in list(self.received)])

    async def replace_script(self, request: Request) -> Response:
        try:
            replies = msgspec.json.decode(await request.body())
            self.load(replies)
        except msgspec.DecodeError as err:  # the script in place stays
            return _error(400, f"not a script of replies: not JSON ({err})", "invalid_request_error")
        except ScriptError as err:
            return _error(400, str(err), "invalid_request_error")
        return JSONResponse({"replies": len(replies)})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                         "owned_by": "scripted"}]})  # fmt: skip

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/chat/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/models", self.models, methods=["GET"]),
                Route("/_scripted/requests", self.requests, methods=["GET"]),
                Route("/_scripted/script", self.replace_script, methods=["POST"]),
                Route("/healthz", self.health, methods=["GET"]),
            ]
        )


def _error_object(reply: dict[str, Any]) -> bytes:
    message = str(reply.get("error") or "scripted error")
    return msgspec.json.encode({"error": {"message": message, "type": "server_error", "param": None,
                                          "code": "scripted_error"}})  # fmt: skip


async def _sleep_unless_disconnected(request: Request, delay: float) -> bool:
    """Sleep `delay` seconds; False as soon as the client disconnects (a caller that gave up is noticed)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait_for(asyncio.shield(watcher), timeout=delay)
    except TimeoutError:
        return True
    finally:
        watcher.cancel()
    return False


def _error(status: int, message: str, kind: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _usage(reply: dict[str, Any], size: int) -> dict[str, Any]:
    usage = reply.get("usage")
    if isinstance(usage, dict):
        return usage
    out_chars = len(reply.get("text", "")) + len(reply.get("reasoning_content", "")) + len(reply.get("refusal", ""))
    out_chars += sum(len(c.get("arguments", "")) for c in reply.get("tool_calls", ()))
    prompt, completion = max(1, size // 4), max(1, out_chars // 4)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(reply: dict[str, Any]) -> str:
    return str(reply.get("finish_reason") or ("tool_calls" if reply.get("tool_calls") else "stop"))


def _pieces(text: str) -> list[str]:
    """Streamed pieces: a word and its following space, like a tokenizer's output."""
    return re.findall(r"\s*\S+\s*|\s+", text) or ([text] if text else [])


def _chunks(reply: dict[str, Any], model: str, include_usage: bool, size: int) -> Iterable[dict[str, Any]]:
    cid = "chatcmpl-" + uuid.uuid4().hex[:16]
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces(str(reply.get("reasoning_content", ""))):
        yield chunk({"reasoning_content": piece})
    for piece in _pieces(str(reply.get("text", ""))):
        yield chunk({"content": piece})
    for piece in _pieces(str(reply.get("refusal", ""))):
        yield chunk({"refusal": piece})
    for index, call in enumerate(reply.get("tool_calls", ())):
        head = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": ""},
        }
        yield chunk({"tool_calls": [head]})
        arguments = str(call.get("arguments", ""))
        for start in range(0, len(arguments), 8):
            part = arguments[start : start + 8]
            yield chunk({"tool_calls": [{"index": index, "function": {"arguments": part}}]})
    yield chunk({}, _finish_reason(reply))
    if include_usage:
        yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": _usage(reply, size)}  # fmt: skip


def _completion(reply: dict[str, Any], model: str, size: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("text", "")}
    if reply.get("refusal"):
        message.update(content=None, refusal=reply["refusal"])
    if reply.get("reasoning_content"):
        message["reasoning_content"] = reply["reasoning_content"]
    if reply.get("tool_calls"):
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", "")}}
            for c in reply["tool_calls"]
        ]
    return {
        "id": "chatcmpl-" + uuid.uuid4().hex[:16],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(reply)}],
        "usage": _usage(reply, size),
    }


def run(script: Path, *, host: str = "127.0.0.1", port: int = 8479, cycle: bool = False) -> None:
    """Serve `script` on host:port until SIGINT or SIGTERM (what `sessionlog scripted-provider` runs).

    The script is read and checked before anything listens, so a bad one fails at once (`ScriptError`, a
    `ValueError`, or `OSError`) instead of answering something else on the first request that uses it.
    """
    from sessionlog import asgi

    replies = load_script(script)
    provider = ScriptedProvider(replies, cycle=cycle)

    async def serve() -> None:
        task = asyncio.ensure_future(asgi.serve_until_cancelled(provider.app(), host, port))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        print(f"scripted provider on http://{host}:{port}/v1 ({len(replies)} replies)", flush=True)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(serve())


def main(argv: list[str] | None = None) -> int:
    """`python -m services.gateway.scripted SCRIPT [--port N] [--cycle]`: serve a script until interrupted."""
    import argparse

    parser = argparse.ArgumentParser(description="the scripted OpenAI-compatible provider")
    parser.add_argument("script", type=Path, help="JSON array or JSONL file of replies")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8479)
    parser.add_argument("--cycle", action="store_true", help="start again from the first reply when used up")
    args = parser.parse_args(argv)
    run(args.script, host=args.host, port=args.port, cycle=args.cycle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
