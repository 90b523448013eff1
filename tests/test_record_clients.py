"""Record mode with real, unmodified clients: the official `openai` Python SDK, the `openai` npm package run by
node, and `openai-agents` on its chat-completions model, each changing only its base URL to
`/record/{session_id}/v1`.

Everything is a real process: a nats-server, `sessionlog serve gateway`, `sessionlog scripted-provider`, the
examples the README shows (run as they are), and the CLI that inspects the result. Each session is then exported,
checked, derived at every request's seq and compared with what the provider received (read from the raw tee
`SESSIONLOG_RAW` and from the provider itself), shown as a transcript, and audited with no findings. A
framework-style compaction (the client swaps older messages for a summary) becomes a logged replace with
provenance under the default policy, and is refused before the provider under `refuse`. The real SDKs also meet a
stream stopped and regenerated, a concurrent request (`SESSION_BUSY`, which they must not retry) and tenant keys;
and the check-mode example (an agent that writes its own log) goes through the same inspection.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import pytest_asyncio
from conftest import REPO_ROOT
from natsfixtures import new_session_id
from scaffold import ServiceProcess, eventually

from services.token_auditor.service import read_raw_exchanges
from sessionlog.audit import RawExchange
from sessionlog.embedded import EmbeddedServer, free_port
from sessionlog.events import Event
from sessionlog.jsonl import read_jsonl
from sessionlog.log import SessionLog
from sessionlog.session import Session
from sessionlog.settings import Settings
from sessionlog.wire import canonical, to_wire

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

NODE_DIR = REPO_ROOT / "tests" / "node"
MODEL = "scripted-model"
RUN_S = 90.0  # the bound of one client or CLI subprocess
WAIT_S = 15.0
TRANSPORT = {"stream", "stream_options"}  # request fields that shape the transport, not what the model sees

# What the provider answers the examples (the README's walkthrough serves the same file): a tool call and an
# answer per turn, two turns; then one answer for the check-mode example.
SCRIPT: list[dict[str, Any]] = json.loads((REPO_ROOT / "examples" / "record_script.json").read_text())
EXAMPLE_SCRIPT, CHECK_MODE_SCRIPT = SCRIPT[:4], SCRIPT[4:]
TENANT_KEYS = {"acme": "sk-acme-test-key", "globex": "sk-globex-test-key"}
EXAMPLE_QUESTIONS = ("What is 2 + 3?", "And that doubled?")
EXAMPLE_ANSWERS = ("answer: 2 + 3 = 5.", "answer: Doubled, that is 10.")


# ---------------------------------------------------------------------------------------------- processes


@dataclass
class Provider:
    """The scripted provider's process and its HTTP controls."""

    process: ServiceProcess
    url: str

    async def load(self, replies: list[dict[str, Any]]) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            (await client.post(f"{self.url}/_scripted/script", json=replies)).raise_for_status()

    async def received(self) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=5) as client:
            reply = await client.get(f"{self.url}/_scripted/requests")
            reply.raise_for_status()
            bodies: list[dict[str, Any]] = reply.json()
            return bodies


@dataclass
class Gateway:
    process: ServiceProcess
    url: str

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/record/{session_id}/v1"

    async def refusals(self, code: str) -> float:
        async with httpx.AsyncClient(timeout=5) as client:
            text = (await client.get(f"{self.url}/metrics")).text
        for line in text.splitlines():
            if line.startswith("sessionlog_gateway_refusals_total{") and f'code="{code}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("record-clients")


@pytest.fixture(scope="module")
def node_clients() -> Path:
    """The npm package the Node test runs, installed from its lock file (`make setup` does it; so does this)."""
    assert shutil.which("node") and shutil.which("npm"), "node and npm are needed: the Node client test must run"
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=NODE_DIR, check=True, timeout=300
        )
    return NODE_DIR


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def provider(nats_server: EmbeddedServer, workdir: Path) -> AsyncIterator[Provider]:
    script = workdir / "script.json"
    script.write_text("[]")
    port = free_port()
    command = ["scripted-provider", "--script", str(script), "--port", str(port)]
    process = ServiceProcess("scripted-provider", nats_server.url, workdir, command=command)
    process.start()
    try:
        url = f"http://127.0.0.1:{port}"
        await process.wait_ready(url=f"{url}/healthz")
        yield Provider(process, url)
    finally:
        process.stop()


async def start_gateway(url: str, workdir: Path, provider: Provider, **env: str) -> Gateway:
    workdir.mkdir(exist_ok=True)
    port = free_port()
    process = ServiceProcess(
        "gateway",
        url,
        workdir,
        SESSIONLOG_GATEWAY_PORT=str(port),
        SESSIONLOG_PROVIDER_BASE_URL=f"{provider.url}/v1",
        SESSIONLOG_GATEWAY_DERIVATION="stream",
        SESSIONLOG_GATEWAY_UPSTREAM_TIMEOUT_S="30",
        **env,
    )
    process.start()
    try:
        await process.wait_ready()
        await process.wait_ready(url=f"http://127.0.0.1:{port}/healthz")
    except BaseException:
        process.stop()
        raise
    return Gateway(process, f"http://127.0.0.1:{port}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(
    provisioned: Settings, nats_server: EmbeddedServer, workdir: Path, provider: Provider
) -> AsyncIterator[Gateway]:
    started = await start_gateway(nats_server.url, workdir / "record", provider)
    try:
        yield started
    finally:
        started.process.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def keyed_gateway(
    provisioned: Settings, nats_server: EmbeddedServer, workdir: Path, provider: Provider
) -> AsyncIterator[Gateway]:
    keys = json.dumps({hashlib.sha256(key.encode()).hexdigest(): tenant for tenant, key in TENANT_KEYS.items()})
    started = await start_gateway(nats_server.url, workdir / "keyed", provider, SESSIONLOG_GATEWAY_KEYS=keys)
    try:
        yield started
    finally:
        started.process.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def refusing_gateway(
    provisioned: Settings, nats_server: EmbeddedServer, workdir: Path, provider: Provider
) -> AsyncIterator[Gateway]:
    started = await start_gateway(
        nats_server.url, workdir / "refuse", provider, SESSIONLOG_GATEWAY_HISTORY_EDITS="refuse"
    )
    try:
        yield started
    finally:
        started.process.stop()


def client_env(gateway: Gateway) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(GATEWAY_URL=gateway.url, MODEL=MODEL)
    return env


async def run(argv: list[str], *, cwd: Path = REPO_ROOT, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One bounded subprocess; its output is kept for the assertion messages."""
    return await asyncio.to_thread(
        subprocess.run, argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_S, check=False
    )


async def sessionlog(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(SESSIONLOG_NATS_URL=url, COLUMNS="200")
    return await run([sys.executable, "-m", "sessionlog", *args], env=env)


def succeeded(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"{done.args} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


# ---------------------------------------------------------------------------------------------- the checks


@dataclass
class Recorded:
    """A session recorded through the gateway, exported and inspected with the CLI."""

    session: Session
    file: Path
    exchanges: list[RawExchange]
    bodies: list[dict[str, Any]]  # what the provider received, from the raw tee
    transcript: str
    audit: dict[str, Any]

    def of_type(self, kind: str) -> list[Event]:
        return [e for e in self.session if e.type == kind]


async def settled(log: SessionLog, session_id: str, requests: int) -> list[RawExchange]:
    """Wait until the session's last turn is closed and the raw tee holds `requests` exchanges (both are written
    after the client has its last byte), then return the exchanges."""

    async def closed() -> bool:
        _, session, _ = await log.load(session_id)
        return len(session) > 0 and not session.turn_is_open

    await eventually(closed, f"session {session_id}'s last turn is closed", WAIT_S)
    exchanges: list[RawExchange] = []

    async def teed() -> bool:
        nonlocal exchanges
        exchanges = await read_raw_exchanges(log.nc, log.settings.raw_stream, session_id)
        return len(exchanges) >= requests

    await eventually(teed, f"the raw tee of {session_id} holds {requests} exchanges", WAIT_S)
    return exchanges


async def recorded(
    log: SessionLog,
    url: str,
    session_id: str,
    tmp_path: Path,
    *,
    requests: int,
    provider_bodies: list[dict[str, Any]],
    outcomes: list[str] | None = None,
    audited: bool = True,
) -> Recorded:
    """Export the session, then check it with the CLI the way an operator would, asserting what must hold for
    every session record mode writes (and, when `audited`, that the audit finds nothing)."""
    exchanges = await settled(log, session_id, requests)
    assert len(exchanges) == requests, [e.request_id for e in exchanges]
    assert [e.outcome for e in exchanges] == (outcomes or ["complete"] * requests)
    file = tmp_path / f"{session_id}.jsonl"
    succeeded(await sessionlog(url, "export", session_id, "-o", str(file)))
    summary = succeeded(await sessionlog(url, "check", str(file)))
    assert summary.startswith("ok: ") and "no open turn" in summary and "no torn tail" in summary, summary
    session = Session(read_jsonl(file).events)

    bodies = [json.loads(e.request) for e in exchanges]
    assert bodies == provider_bodies, "the raw tee must hold exactly what the provider received"
    for exchange, body in zip(exchanges, bodies, strict=True):
        seq = exchange.session_seq
        # the request was derived from the log just before its response began (SPEC's theorem)
        assert session[seq + 1].type.startswith("assistant/"), (seq, session[seq + 1].type)
        derived = json.loads(succeeded(await sessionlog(url, "derive", str(file), "--at", str(seq))))
        prefix = session.prefix(seq)
        assert derived == [m.to_builtins() for m in prefix.derive_messages()]
        header = prefix.fold_request_header()
        assert header is not None
        expected = to_wire(prefix.derive_messages(), header)
        assert canonical(body["messages"]) == canonical(expected["messages"]), f"request at seq {seq}"
        assert {k: body.get(k) for k in expected} == expected, f"request fields at seq {seq}"
        assert set(body) - set(expected) <= TRANSPORT, f"unlogged request fields at seq {seq}"

    transcript = succeeded(await sessionlog(url, "transcript", str(file)))
    done = await sessionlog(url, "audit", session_id, "--local", "--json")
    audit = json.loads(done.stdout)
    if audited:
        assert done.returncode == 0 and audit["findings"] == [], audit["findings"]
    assert audit["raw_exchanges"] == requests
    return Recorded(session, file, exchanges, bodies, transcript, audit)


def assert_example_session(rec: Recorded) -> None:
    """The two-turn tool loop every example runs, as the log must hold it."""
    assert [e.data.turn for e in rec.of_type("turn/end")] == [1, 2]
    assert {msgspec.to_builtins(e.data.reason)["kind"] for e in rec.of_type("turn/end")} == {"completed"}
    calls = rec.of_type("tool/call")
    assert [(c.data.call_id, c.data.name, json.loads(c.data.arguments)) for c in calls] == [
        ("call_add_1", "add", {"a": 2, "b": 3}),
        ("call_add_2", "add", {"a": 5, "b": 5}),
    ]
    results = rec.of_type("tool/result")
    assert [r.source_event_seqs for r in results] == [[c.seq] for c in calls]
    assert [r.data.message.content[0].content[0].text for r in results] == ["5", "10"]
    assert not any(e.is_replace for e in rec.session), "a faithful client never causes a replace"
    users = [e.data.content[0].text for e in rec.of_type("user/message")]
    assert users == list(EXAMPLE_QUESTIONS)
    for line in ("2 + 3 = 5.", "Doubled, that is 10.", "[call call_add_1]: 5", "[call call_add_2]: 10"):
        assert line in rec.transcript
    # the last request carried the second call's result right after the call
    last = rec.bodies[-1]["messages"]
    assert [m["role"] for m in last[-2:]] == ["assistant", "tool"]
    assert last[-2]["tool_calls"][0]["id"] == last[-1]["tool_call_id"] == "call_add_2"
    assert rec.audit["ledger"]["total"]["requests"] == len(rec.exchanges)


def streamed_steps(rec: Recorded) -> set[tuple[int, int]]:
    return {(e.data.turn, e.data.step) for e in rec.of_type("assistant/chunk")}


async def run_example(
    provider: Provider, gateway: Gateway, argv: list[str], session_id: str, cwd: Path = REPO_ROOT
) -> tuple[str, list[dict[str, Any]]]:
    """Run one example as it is; return its output and the bodies the provider received while it ran."""
    await provider.load(EXAMPLE_SCRIPT)
    before = len(await provider.received())
    done = await run([*argv, session_id], cwd=cwd, env=client_env(gateway))
    out = succeeded(done)
    for answer in EXAMPLE_ANSWERS:
        assert answer in out, out
    return out, (await provider.received())[before:]


# ---------------------------------------------------------------------------------------------- the clients


async def test_the_openai_python_sdk_unmodified_streaming_and_not_with_a_tool_loop(
    provider: Provider, gateway: Gateway, log: SessionLog, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    session_id = new_session_id("rec-py")
    _, received = await run_example(provider, gateway, [sys.executable, "examples/record_openai.py"], session_id)
    rec = await recorded(log, nats_server.url, session_id, tmp_path, requests=4, provider_bodies=received)
    assert_example_session(rec)
    assert [b.get("stream") is True for b in rec.bodies] == [False, False, True, True]
    assert streamed_steps(rec) == {(2, 1), (2, 2)}, "turn 2 streamed: its chunks are logged as assistant/chunk"
    usage = [e.data.usage for e in rec.of_type("assistant/message")]
    assert all(u is not None for u in usage), "the SDK asked for usage (include_usage) and every reply had it"


async def test_the_node_openai_package_unmodified_streaming_and_not_with_a_tool_loop(
    provider: Provider,
    gateway: Gateway,
    log: SessionLog,
    nats_server: EmbeddedServer,
    node_clients: Path,
    tmp_path: Path,
) -> None:
    session_id = new_session_id("rec-node")
    node = shutil.which("node")
    assert node is not None
    _, received = await run_example(provider, gateway, [node, "record_chat.mjs"], session_id, cwd=node_clients)
    rec = await recorded(log, nats_server.url, session_id, tmp_path, requests=4, provider_bodies=received)
    assert_example_session(rec)
    assert [b.get("stream") is True for b in rec.bodies] == [True, True, False, False]
    assert streamed_steps(rec) == {(1, 1), (1, 2)}


async def test_openai_agents_on_its_chat_completions_model_unmodified(
    provider: Provider, gateway: Gateway, log: SessionLog, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    session_id = new_session_id("rec-agents")
    _, received = await run_example(provider, gateway, [sys.executable, "examples/record_agents.py"], session_id)
    rec = await recorded(log, nats_server.url, session_id, tmp_path, requests=4, provider_bodies=received)
    assert_example_session(rec)
    assert [b.get("stream") is True for b in rec.bodies] == [False, False, True, True]
    assert streamed_steps(rec) == {(2, 1), (2, 2)}
    # the agent's function tool is strict: the flag is logged and forwarded, as a direct call would carry it
    assert all(b["tools"][0]["function"].get("strict") is True for b in rec.bodies)


async def test_with_gateway_keys_the_example_sends_its_key_and_another_tenant_cannot_reach_its_session(
    provider: Provider, keyed_gateway: Gateway, node_clients: Path
) -> None:
    session_id = new_session_id("rec-keyed")
    node = shutil.which("node")
    assert node is not None
    await provider.load(EXAMPLE_SCRIPT)
    env = {**client_env(keyed_gateway), "GATEWAY_API_KEY": TENANT_KEYS["acme"]}
    out = succeeded(await run([node, "record_chat.mjs", session_id], cwd=node_clients, env=env))
    assert EXAMPLE_ANSWERS[1] in out
    received = len(await provider.received())
    question = [{"role": "user", "content": "What did acme ask?"}]
    for key, refusal in ((TENANT_KEYS["globex"], openai.NotFoundError), ("sk-nobody", openai.AuthenticationError)):
        client = openai.AsyncOpenAI(base_url=keyed_gateway.base_url(session_id), api_key=key)
        async with client:
            with pytest.raises(refusal) as refused:
                await client.chat.completions.create(model=MODEL, messages=question)
        assert refused.value.response.headers.get("x-should-retry") == "false"
    assert len(await provider.received()) == received, "nothing of another tenant's request reached the provider"


async def test_an_agent_that_writes_its_own_log_in_check_mode(
    provider: Provider, gateway: Gateway, log: SessionLog, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    session_id = new_session_id("check")
    await provider.load(CHECK_MODE_SCRIPT)
    before = len(await provider.received())
    env = {**client_env(gateway), "SESSIONLOG_NATS_URL": nats_server.url}
    out = succeeded(await run([sys.executable, "examples/check_mode.py", session_id], env=env))
    assert "answer: 2 + 3 = 5." in out
    received = (await provider.received())[before:]
    rec = await recorded(log, nats_server.url, session_id, tmp_path, requests=1, provider_bodies=received)
    assert [e.type for e in rec.session][-3:] == ["assistant/message", "step/end", "turn/end"]
    assert rec.audit["ledger"]["total"]["requests"] == 1


async def test_an_agent_that_is_not_async_writes_its_own_log_with_the_sync_writer(
    provider: Provider, gateway: Gateway, log: SessionLog, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    session_id = new_session_id("check-sync")
    await provider.load(CHECK_MODE_SCRIPT)
    before = len(await provider.received())
    env = {**client_env(gateway), "SESSIONLOG_NATS_URL": nats_server.url}
    out = succeeded(await run([sys.executable, "examples/check_mode_sync.py", session_id], env=env))
    assert "answer: 2 + 3 = 5." in out
    received = (await provider.received())[before:]
    rec = await recorded(log, nats_server.url, session_id, tmp_path, requests=1, provider_bodies=received)
    assert [e.type for e in rec.session][-3:] == ["assistant/message", "step/end", "turn/end"]


async def test_models_are_listed_under_the_record_base_url(gateway: Gateway) -> None:
    async with openai.AsyncOpenAI(base_url=gateway.base_url(new_session_id("rec-models")), api_key="-") as client:
        models = [m.id async for m in await client.models.list()]
    assert models == ["scripted"], "GET models answers under the record base URL (the provider's list)"


async def test_a_client_that_stops_a_stream_and_asks_again_continues_the_session(
    provider: Provider, gateway: Gateway, log: SessionLog, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The user presses stop after two chunks, then regenerates: the SDK closes the stream, then sends the same
    history again (it never received the cut reply). The log stays valid and the retry extends it."""
    session_id = new_session_id("rec-stop")
    slow = {"text": "one two three four five six seven eight nine ten", "chunk_delay_s": 0.3}
    await provider.load([slow, {"text": "Short answer."}])
    before = len(await provider.received())
    client = sdk_client(gateway, session_id)
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "Count to ten."}]

    def stop_after_two_chunks() -> str:
        stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True)
        seen = [chunk.choices[0].delta.content or "" for chunk, _ in zip(stream, range(2), strict=False)]
        stream.close()
        return "".join(seen)

    assert "one" in await asyncio.to_thread(stop_after_two_chunks)

    async def cut_turn_closed() -> bool:
        _, session, _ = await log.load(session_id)
        return any(e.type == "turn/end" for e in session)

    await eventually(cut_turn_closed, "the cut turn is closed", WAIT_S)
    again = await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=messages)
    assert again.choices[0].message.content == "Short answer."

    received = (await provider.received())[before:]
    rec = await recorded(log, nats_server.url, session_id, tmp_path, requests=2, provider_bodies=received,
                         outcomes=["client_disconnected", "complete"], audited=False)  # fmt: skip
    assert not any(e.is_replace for e in rec.session), "the retry extends the log"
    reasons = [msgspec.to_builtins(e.data.reason)["kind"] for e in rec.of_type("turn/end")]
    assert reasons[0] == "aborted" and reasons[-1] == "completed", reasons
    assert len(rec.of_type("assistant/chunk")) >= 2, "the chunks the user saw are logged"
    assert "Short answer." in rec.transcript


async def test_a_second_request_while_one_is_answered_is_refused_busy_and_the_sdk_does_not_retry(
    provider: Provider, gateway: Gateway, log: SessionLog
) -> None:
    session_id = new_session_id("rec-busy")
    await provider.load([{"text": "Slow answer.", "delay_s": 1.5}, {"text": "never sent"}])
    before = len(await provider.received())
    client = sdk_client(gateway, session_id)
    messages: list[Any] = [SYSTEM, {"role": "user", "content": "Take your time."}]
    first = asyncio.ensure_future(asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=messages))

    async def first_reached_the_provider() -> bool:
        return len(await provider.received()) > before

    await eventually(first_reached_the_provider, "the first request reached the provider", WAIT_S)
    busy = await gateway.refusals("SESSION_BUSY")
    with pytest.raises(openai.ConflictError) as refused:
        await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=messages)
    assert refused.value.code == "SESSION_BUSY"
    assert refused.value.response.headers.get("x-should-retry") == "false"
    assert await gateway.refusals("SESSION_BUSY") == busy + 1, "the SDK did not retry"
    assert (await first).choices[0].message.content == "Slow answer."
    assert len(await provider.received()) == before + 1, "the refused request never reached the provider"


# ---------------------------------------------------------------------------------------------- compaction


SYSTEM = {"role": "system", "content": "You are a careful assistant."}
COMPACTION_SCRIPT = [{"text": "First answer."}, {"text": "Second answer."}, {"text": "Third answer."}]
SUMMARY = "Summary of the conversation so far: the user asked a first question and got the first answer."


def sdk_client(gateway: Gateway, session_id: str) -> openai.OpenAI:
    # the SDK's default retries stay on: a refusal must say it is final (x-should-retry: false)
    return openai.OpenAI(base_url=gateway.base_url(session_id), api_key="unused", timeout=30)


def two_turns(client: openai.OpenAI) -> list[Any]:
    """Two ordinary turns; returns the history as the client holds it."""
    messages: list[Any] = [SYSTEM]
    for question in ("First question?", "Second question?"):
        messages.append({"role": "user", "content": question})
        response = client.chat.completions.create(model=MODEL, messages=messages)
        messages.append(response.choices[0].message)
    return messages


def compacted(messages: list[Any]) -> list[Any]:
    """What a framework's compaction sends: the first exchange swapped for a summary, the rest kept, a new
    question appended."""
    return [SYSTEM, {"role": "user", "content": SUMMARY}, *messages[3:], {"role": "user", "content": "Third question?"}]


def surface_seqs_by_turn(session: Session) -> dict[int, list[int]]:
    """The seqs of the surface events appended in each turn."""
    out: dict[int, list[int]] = {}
    turn = 0
    for event in session:
        if event.type == "turn/start":
            turn = event.data.turn
        elif event.is_surface:
            out.setdefault(turn, []).append(event.seq)
    return out


def texts(messages: list[Any]) -> list[str]:
    return [m.message.content[0].text for m in messages]


async def test_a_framework_compaction_is_logged_as_a_replace_with_provenance_and_the_transcript_keeps_it_all(
    provider: Provider, gateway: Gateway, log: SessionLog, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    session_id = new_session_id("rec-compact")
    await provider.load(COMPACTION_SCRIPT)
    before = len(await provider.received())
    client = sdk_client(gateway, session_id)
    history = await asyncio.to_thread(two_turns, client)
    answer = await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=compacted(history))
    assert answer.choices[0].message.content == "Third answer."

    received = (await provider.received())[before:]
    rec = await recorded(log, nats_server.url, session_id, tmp_path, requests=3, provider_bodies=received)
    replaces = [e for e in rec.session if e.is_replace]
    assert len(replaces) == 1, [(e.seq, e.type, e.surface_op) for e in replaces]
    replace = replaces[0]
    first, second = surface_seqs_by_turn(rec.session)[1], surface_seqs_by_turn(rec.session)[2]
    assert set(first) <= set(replace.source_event_seqs), "provenance covers every shadowed node"
    final = texts(list(rec.session.derive_messages()))
    assert final == [SUMMARY, "Second question?", "Second answer.", "Third question?", "Third answer."]
    assert [m["content"] for m in rec.bodies[-1]["messages"]][1:] == final[:-1]
    # the transcript keeps the originals, marks the compaction, and shows each message the user saw once
    for kept in ("First question?", "First answer.", "Second question?", "Second answer.", "Third answer."):
        assert rec.transcript.count(f"] {'user' if 'question' in kept else 'assistant'}: {kept}\n") == 1, kept
    # the client's summary, as far as the log can tell, is a message it put there: "replaced", not "summarised"
    # (found probing record mode, 2026-12-05: every replacement was called a summary, a trimming too)
    assert f"[{replace.seq}] (replaced for the model: events {min(first)}-{max(first)})" in rec.transcript
    assert set(second).isdisjoint(replace.source_event_seqs), "what the client kept is kept, not re-logged"


async def test_a_framework_compaction_is_refused_under_the_refuse_policy_and_the_provider_gets_nothing(
    provider: Provider, refusing_gateway: Gateway, log: SessionLog
) -> None:
    session_id = new_session_id("rec-refuse")
    await provider.load(COMPACTION_SCRIPT)
    client = sdk_client(refusing_gateway, session_id)
    history = await asyncio.to_thread(two_turns, client)
    await settled(log, session_id, 2)
    _, before, _ = await log.load(session_id)
    received = len(await provider.received())
    refusals = await refusing_gateway.refusals("DERIVATION_DIVERGES")

    with pytest.raises(openai.ConflictError) as refused:
        await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=compacted(history))
    assert refused.value.status_code == 409
    assert refused.value.response.headers.get("x-should-retry") == "false"
    assert refused.value.code == "DERIVATION_DIVERGES"
    assert len(await provider.received()) == received, "the provider received nothing"
    assert await refusing_gateway.refusals("DERIVATION_DIVERGES") == refusals + 1, "the SDK did not retry"
    _, after, _ = await log.load(session_id)
    assert [e.raw for e in after] == [e.raw for e in before], "a refused request leaves the log as it was"

    # the faithful continuation still goes through
    history.append({"role": "user", "content": "Third question?"})
    answer = await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=history)
    assert answer.choices[0].message.content == "Third answer."
