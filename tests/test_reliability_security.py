"""Reliability, security of issue 15, against a nats-server started with deploy/'s accounts (the configs and users
tests/test_deploy.py generates and checks; its helpers are reused here, not copied).

- Nobody but the admin can purge: every other role's purge request is refused by the server (a permissions
  violation in its log, the session's records untouched); the admin's purge erases the session and every
  projection (context-deriver, token-auditor, ui-replayer, repairer, each under its own user) forgets it.
- The gateway refuses requests without its key (or with a wrong one) and the provider sees none of them.
- Secrets (every NATS password, the gateway's key, the provider's key) appear in no log line (of the test's
  process, of a service process, of nats-server), in no event or raw-tee message, no KV value, and no metric.
- The UI escapes everything it renders: markup in every field a session can carry reaches the page as text.

- A writer cannot publish another tenant's sessions: with tenants configured (`make_accounts.py --tenant a --tenant
  b`, one account each), tenant a's writer asking for tenant b's session is `SESSION_NOT_FOUND`, what it publishes
  under that session's id lands in its own account's log, and tenant b's log is unchanged.

Tenant keys are tested in the gateway's record mode under deploy's gateway user.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import pytest_asyncio
from reliability import record_figures
from scaffold import WAIT_S, eventually
from sessiongen import assistant_message_data, text_block, tool_call_block, tool_result_data, user_message_data
from test_context_deriver import ServiceProcess
from test_deploy import (
    HEADER,
    PASSWORDS,
    ROLES,
    SERVER_ENV,
    accounts,
    connect_as,
    deploy_copy,
    log_mark,
    new_id,
    publish_record,
    role_settings,
    serving,
    start_with_env,
    violations,
    wait_for_violation,
)

from sessionlog.embedded import EmbeddedServer
from sessionlog.errors import SessionLogError, SessionNotFound
from sessionlog.log import SessionLog
from sessionlog.micro import call
from sessionlog.record import events_filter

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

GATEWAY_KEY = f"gw-key-{uuid.uuid4().hex}"
PROVIDER_KEY = f"sk-provider-{uuid.uuid4().hex}"
HEADER_WRITERS = ("writer", "gateway")  # roles that put session headers (the gateway in record mode)
MARKUP = "<script>window.__pwned=1</script>\"><img src=x onerror=alert(1)>&lt;'javascript:alert(2)"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """deploy/nats/single.conf with accounts.conf, on free loopback ports."""
    base = tmp_path_factory.mktemp("secure")
    config = deploy_copy(base / "config") / "single.conf"
    started = EmbeddedServer(base / "data", extra_args=["-c", str(config)], log_path=base / "nats-server.log")
    start_with_env(started)
    try:
        yield started
    finally:
        started.kill()


def settings_of(server: EmbeddedServer, role: str, **overrides: Any) -> Any:
    # The stream allows erasure (decided when it is created): only then does "only the admin may purge" mean anything.
    return role_settings(server.url, role, allow_purge=True, **overrides)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def admin(server: EmbeddedServer) -> AsyncIterator[SessionLog]:
    log = await SessionLog.connect(settings_of(server, "admin"))
    try:
        yield log
    finally:
        await log.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def writer_log(server: EmbeddedServer, admin: SessionLog) -> AsyncIterator[SessionLog]:
    log = await SessionLog.connect(settings_of(server, "writer"))
    try:
        yield log
    finally:
        await log.close()


async def tool_session(log: SessionLog, text: str = "Hello.") -> tuple[str, int]:
    """A closed session with a header, a tool call and its result; its id and last seq."""
    writer = await log.create(new_id("sec"))
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("user/message", user_message_data(text, "u1"), surface_op="append")
    await writer.emit("step/start", {"turn": 1, "step": 1})
    await writer.emit("request/header", {"header": HEADER, "reason": "initial"})
    call_block = tool_call_block("c1", "read", json.dumps({"path": text}))
    await writer.emit(
        "assistant/message",
        assistant_message_data(1, 1, [text_block(text), call_block], "a1"),
        surface_op="append",
        source_event_seqs=[],
    )
    call_seq = (await writer.emit("tool/call", {"turn": 1, "step": 1, "callId": "c1", "name": "read",
                                               "arguments": call_block["arguments"]})).seq  # fmt: skip
    await writer.emit(
        "tool/result", tool_result_data(1, 1, "c1", text), surface_op="append", source_event_seqs=[call_seq]
    )
    await writer.emit("step/end", {"turn": 1, "step": 1})
    await writer.emit("turn/end", {"turn": 1, "reason": {"kind": "error", "error": {"message": text, "code": "E"}}})
    seq = await writer.flush()
    await writer.close()
    return writer.session_id, seq


# ================================================================================================ purge


@pytest.mark.parametrize("role", [r for r in ROLES if r != "admin"])
async def test_no_role_but_the_admin_can_purge_a_session(
    server: EmbeddedServer, admin: SessionLog, writer_log: SessionLog, role: str
) -> None:
    session_id, seq = await tool_session(writer_log)
    nc, _ = await connect_as(server.url, role)
    try:
        body = json.dumps({"filter": events_filter(session_id)}).encode()
        with pytest.raises(Exception):  # noqa: B017 - no answer at all: the server dropped the request
            await nc.request(f"$JS.API.STREAM.PURGE.{admin.settings.stream}", body, timeout=1)
        await wait_for_violation(server, role, "Publish", f"$JS.API.STREAM.PURGE.{admin.settings.stream}")
        kv = f"$KV.{admin.settings.kv_sessions}.{session_id}"
        await nc.publish(kv, b"", headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"})
        await nc.flush()
    finally:
        await nc.close()
    assert len(await admin.reader.events(session_id)) == seq + 1, f"{role}: the session's records are untouched"
    assert await admin.header(session_id) is not None, f"{role}: the session's header is untouched"


@pytest.mark.parametrize("role", HEADER_WRITERS)
async def test_a_header_writer_cannot_purge_a_sessions_header(
    server: EmbeddedServer, admin: SessionLog, writer_log: SessionLog, role: str
) -> None:
    session_id, seq = await tool_session(writer_log)
    nc, _ = await connect_as(server.url, role)
    try:
        await nc.publish(
            f"$KV.{admin.settings.kv_sessions}.{session_id}",
            b"",
            headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"},
        )
        await nc.flush()
        await asyncio.sleep(0.2)
    finally:
        await nc.close()
    assert len(await admin.reader.events(session_id)) == seq + 1
    assert await admin.header(session_id) is not None, "the writer erased the session's header"


async def test_the_admins_purge_is_forgotten_by_every_projection_under_its_own_user(
    server: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    session_id, seq = await tool_session(writer_log)
    keep, keep_seq = await tool_session(writer_log)
    mark = log_mark(server)
    async with contextlib.AsyncExitStack() as stack:
        services = {}
        for name in ("context-deriver", "token-auditor", "ui-replayer", "repairer"):
            services[name], _ = await stack.enter_async_context(serving(server.url, name, allow_purge=True))
        ui_url = f"http://127.0.0.1:{services['ui-replayer'].port}"

        async def answers(sid: str, min_seq: int) -> dict[str, Any]:
            out: dict[str, Any] = {}
            asks = (
                ("derive", "sessionlog.context.derive", {"min_seq": min_seq}),
                ("audit", "sessionlog.audit.report", {}),
            )
            for name, subject, extra in asks:
                try:
                    out[name] = await call(writer_log.nc, subject, {"session": sid, **extra}, timeout=WAIT_S)
                except SessionLogError as err:
                    out[name] = err.code
            async with httpx.AsyncClient(timeout=WAIT_S) as http:
                out["ui"] = (await http.get(f"{ui_url}/api/sessions/{sid}/transcript")).status_code
            return out

        known = await answers(session_id, seq)
        assert isinstance(known["derive"], dict) and isinstance(known["audit"], dict) and known["ui"] == 200, known

        async def held() -> bool:
            return all(session_id in s.runner.states for s in services.values())

        await eventually(held, "every projection holds the session")
        await admin.purge(session_id)

        async def forgotten() -> bool:
            return all(session_id not in s.runner.states for s in services.values())

        await eventually(forgotten, "every projection drops the purged session")
        gone = await answers(session_id, 0)
        assert gone == {"derive": "SESSION_NOT_FOUND", "audit": "SESSION_NOT_FOUND", "ui": 404}, gone
        kept = await answers(keep, keep_seq)
        assert isinstance(kept["derive"], dict) and kept["ui"] == 200, "the other session is untouched"
    assert await admin.reader.events(session_id) == []
    assert violations(server, since=mark) == [], "they needed nothing more"


async def test_a_projection_under_its_own_user_needs_no_permission_deploy_lacks(
    server: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    session_id, _ = await tool_session(writer_log)
    mark = log_mark(server)
    async with serving(server.url, "context-deriver", allow_purge=True) as (service, _):

        async def held() -> bool:
            return session_id in service.runner.states or bool(await service.runner.state(session_id))

        await eventually(held, "the deriver holds the session")
        await admin.purge(session_id)

        async def forgotten() -> bool:
            return session_id not in service.runner.states

        await eventually(forgotten, "the deriver forgets the purged session")
        await asyncio.sleep(1.5)  # a checkpoint round
    assert violations(server, "context-deriver", since=mark) == []


# ================================================================================================ gateway key, secrets


@pytest.fixture(scope="module")
def provider_url() -> Iterator[tuple[Any, str]]:
    from services.gateway import ScriptedProvider, ServerThread

    provider = ScriptedProvider([{"text": "fine"}] * 10)
    with ServerThread(provider.app()) as upstream:
        yield provider, upstream.url


def secrets() -> dict[str, str]:
    return {f"nats password of {role}": pw for role, pw in PASSWORDS.items()} | {
        "gateway key": GATEWAY_KEY,
        "provider key": PROVIDER_KEY,
    }


def leaks(text: str, where: str) -> list[str]:
    return [f"{name} in {where}" for name, secret in secrets().items() if secret in text]


async def stream_dump(admin: SessionLog, stream: str) -> str:
    """Every message of a stream, headers and data, as text."""
    info = await admin.js.stream_info(stream)
    out: list[str] = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(Exception):
            message = await admin.js.get_msg(stream, seq)
            out.append(json.dumps(message.headers or {}) + (message.data or b"").decode(errors="replace"))
    return "\n".join(out)


async def test_the_gateway_refuses_without_its_key_and_no_secret_reaches_a_log_an_event_or_a_metric(
    server: EmbeddedServer,
    admin: SessionLog,
    writer_log: SessionLog,
    provider_url: tuple[Any, str],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    provider, upstream = provider_url
    caplog.set_level(logging.DEBUG)
    writer = await writer_log.create(new_id("key"))
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("user/message", user_message_data("Say hi.", "u1"), surface_op="append")
    await writer.emit("step/start", {"turn": 1, "step": 1})
    await writer.emit("request/header", {"header": HEADER, "reason": "initial"})
    seq = await writer.flush()
    overrides = {"provider_base_url": upstream, "provider_api_key": PROVIDER_KEY, "gateway_api_key": GATEWAY_KEY}
    refused = 0
    async with serving(server.url, "gateway", allow_purge=True, **overrides) as (service, ready):
        url = f"http://127.0.0.1:{service.config.port}/v1/sessions/{writer.session_id}/completions"
        metrics_url = ready.replace("/readyz", "/metrics")
        async with httpx.AsyncClient(timeout=10) as http:
            before = len(provider.received)
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": GATEWAY_KEY[:-1]},
                            {"Authorization": f"Basic {GATEWAY_KEY}"}):  # fmt: skip
                response = await http.post(url, headers={"X-Session-Seq": str(seq), **headers})
                assert response.status_code == 401, response.text
                assert response.json()["error"]["code"] == "UNAUTHORIZED"
                assert GATEWAY_KEY not in response.text
                refused += 1
            assert len(provider.received) == before, "a refused request never reaches the provider"
            for headers in ({"Authorization": f"Bearer {GATEWAY_KEY}"}, {"x-api-key": GATEWAY_KEY}):
                response = await http.post(url, headers={"X-Session-Seq": str(seq), **headers})
                assert response.status_code == 200, response.text
            diverging = await http.post(
                url, json={"temperature": 2}, headers={"X-Session-Seq": str(seq), "x-api-key": GATEWAY_KEY}
            )
            assert diverging.status_code == 409
            gateway_metrics = (await http.get(f"http://127.0.0.1:{service.config.port}/metrics")).text
            process_metrics = (await http.get(metrics_url)).text
            health = (await http.get(ready)).text
        await service.gateway.tee.drain()
    await writer.close()
    # A service process too: its whole output, started with its password in the environment.
    deriver = ServiceProcess(
        "context-deriver",
        server.url,
        tmp_path,
        SESSIONLOG_NATS_USER="context-deriver",
        SESSIONLOG_NATS_PASSWORD=PASSWORDS["context-deriver"],
        SESSIONLOG_ALLOW_PURGE="true",
        SESSIONLOG_LOG_LEVEL="DEBUG",
    )
    try:
        deriver.start()
        await deriver.wait_ready()
        process_health = json.dumps(deriver.health("/healthz")[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{deriver.metrics_port}/metrics", timeout=5) as reply:
            process_metrics += reply.read().decode()
    finally:
        deriver.stop()
    found: list[str] = []
    found += leaks(caplog.text, "the test process's log records")
    found += leaks(deriver.output(), "the context-deriver process's output")
    found += leaks(server.log_path.read_text(errors="replace"), "the nats-server log")
    found += leaks(gateway_metrics + process_metrics + health + process_health, "metrics and health")
    found += leaks(await stream_dump(admin, admin.settings.stream), "the event stream")
    found += leaks(await stream_dump(admin, admin.settings.raw_stream), "the raw audit stream")
    for bucket in (admin.settings.kv_sessions, admin.settings.kv_leases, admin.settings.kv_checkpoints):
        found += leaks(await stream_dump(admin, f"KV_{bucket}"), f"KV {bucket}")
    assert caplog.records, "the check read some log lines"
    assert found == []
    record_figures(
        "secrets and the gateway key",
        fault="requests without or with a wrong gateway key; every log, event, raw-tee message, KV value and metric "
        "scanned for every password and key",
        refused_without_key=refused,
        secrets_checked=len(secrets()),
        leaks=0,
    )


# ================================================================================================ the UI escapes


async def test_the_ui_renders_markup_in_every_field_as_text(
    server: EmbeddedServer, admin: SessionLog, writer_log: SessionLog
) -> None:
    writer = await writer_log.create(new_id("xss"))
    await writer.emit("turn/start", {"turn": 1})
    await writer.emit("session/title", {"title": MARKUP, "messageSeqs": [1], "source": {"kind": "fallback"}})
    await writer.emit("user/message", user_message_data(MARKUP, "u1"), surface_op="append")
    await writer.emit("step/start", {"turn": 1, "step": 1})
    header = {**HEADER, "system": MARKUP, "config": {**HEADER["config"], "model": MARKUP}}
    await writer.emit("request/header", {"header": header, "reason": "initial"})
    call_block = tool_call_block("c1", MARKUP, json.dumps({"path": MARKUP}))
    content = [{"type": "reasoning", "text": MARKUP}, text_block(MARKUP), call_block]
    await writer.emit(
        "assistant/message", assistant_message_data(1, 1, content, "a1"), surface_op="append", source_event_seqs=[]
    )
    call_seq = (await writer.emit("tool/call", {"turn": 1, "step": 1, "callId": "c1", "name": MARKUP,
                                               "arguments": call_block["arguments"]})).seq  # fmt: skip
    result = tool_result_data(1, 1, "c1", MARKUP, is_error=True, error={"name": MARKUP, "code": MARKUP})
    await writer.emit("tool/result", result, surface_op="append", source_event_seqs=[call_seq])
    await writer.emit("step/end", {"turn": 1, "step": 1})
    reason = {"kind": "error", "error": {"message": MARKUP, "code": MARKUP}}
    await writer.emit("turn/end", {"turn": 1, "reason": reason})
    await writer.close()
    async with serving(server.url, "ui-replayer", allow_purge=True) as (service, _):
        base = f"http://127.0.0.1:{service.port}"
        async with httpx.AsyncClient(base_url=base, timeout=WAIT_S) as http:

            async def listed() -> bool:
                return writer.session_id in (await http.get("/")).text

            await eventually(listed, "the session is listed")
            pages = {
                "session page": (await http.get(f"/sessions/{writer.session_id}")).text,
                "list": (await http.get("/")).text,
                "search": (await http.get("/", params={"q": MARKUP})).text,
                "error page": (await http.get(f"/sessions/{writer.session_id}", params={"at": MARKUP})).text,
            }
            transcript = (await http.get(f"/api/sessions/{writer.session_id}/transcript")).json()
    for name, page in pages.items():
        for raw in ("<script>window.__pwned", "<img src=x", "onerror=alert(1)>"):
            assert raw not in page, f"{name}: {raw!r} reached the page unescaped"
    assert "&lt;script&gt;window.__pwned" in pages["session page"], "the markup is shown, as text"
    assert MARKUP in strings_in(transcript), "the JSON keeps the text as it was"


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in strings_in(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return []


# ================================================================================================ tenants


async def test_a_tenants_key_cannot_reach_another_tenants_session(
    server: EmbeddedServer, admin: SessionLog, provider_url: tuple[Any, str]
) -> None:
    """Record mode under deploy/'s gateway user: tenant a's key makes a session, tenant b's key cannot reach it."""
    provider, upstream = provider_url
    key_a, key_b = f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"
    keys = {hashlib.sha256(key_a.encode()).hexdigest(): "a", hashlib.sha256(key_b.encode()).hexdigest(): "b"}
    mark = log_mark(server)
    overrides = {"provider_base_url": upstream, "gateway_keys": keys}
    async with serving(server.url, "gateway", allow_purge=True, **overrides) as (service, _):
        session_id = new_id("tenant")
        url = f"http://127.0.0.1:{service.config.port}/record/{session_id}/v1/chat/completions"
        body = {"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}]}
        before = len(provider.received)
        async with httpx.AsyncClient(timeout=10) as http:
            mine = await http.post(url, json=body, headers={"Authorization": f"Bearer {key_a}"})
            assert mine.status_code == 200, mine.text
            theirs = await http.post(url, json=body, headers={"Authorization": f"Bearer {key_b}"})
            assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "SESSION_NOT_FOUND", theirs.text
            nobody = await http.post(url, json=body)
            assert nobody.status_code == 401
        assert len(provider.received) == before + 1, "only tenant a's request reached the provider"
    assert violations(server, "gateway", since=mark) == [], "record mode needs no permission deploy/ lacks"


TENANTS = ("a", "b")
TENANT_PASSWORDS = {(t, r): f"{t}-{r}-{uuid.uuid4().hex[:8]}" for t in TENANTS for r in ROLES}


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """deploy/nats/single.conf with the accounts `make_accounts.py --tenant a --tenant b` writes."""
    base = tmp_path_factory.mktemp("tenants")
    config = deploy_copy(base / "config")
    (config / "accounts.conf").write_text(accounts.render(accounts.PARTITION_COUNT, TENANTS))
    started = EmbeddedServer(
        base / "data", extra_args=["-c", str(config / "single.conf")], log_path=base / "nats-server.log"
    )
    with pytest.MonkeyPatch.context() as mp:
        for (tenant, role), password in TENANT_PASSWORDS.items():
            mp.setenv(accounts.password_env(role, tenant), password)
        mp.setenv("NATS_SYS_PASSWORD", SERVER_ENV["NATS_SYS_PASSWORD"])
        started.start()
    try:
        yield started
    finally:
        started.kill()


def tenant_settings(server: EmbeddedServer, tenant: str, role: str) -> Any:
    user, password = accounts.user_name(role, tenant), TENANT_PASSWORDS[(tenant, role)]
    return role_settings(server.url, role, nats_user=user, nats_password=password, allow_purge=True)


async def test_a_tenants_writer_cannot_publish_another_tenants_session(tenant_server: EmbeddedServer) -> None:
    async with contextlib.AsyncExitStack() as stack:
        logs = {}
        for tenant in TENANTS:
            for role in ("admin", "writer"):  # the admin provisions its tenant's log first
                log = await SessionLog.connect(tenant_settings(tenant_server, tenant, role))
                stack.push_async_callback(log.close)
                logs[tenant, role] = log
        theirs = logs["b", "writer"]
        session_id, seq = await tool_session(theirs, "tenant b's")

        async def snapshot() -> tuple[Any, ...]:
            info = await theirs.js.stream_info(theirs.settings.stream)
            events = await theirs.reader.events(session_id)
            return info.state.messages, info.state.last_seq, await theirs.header(session_id), events

        before = await snapshot()
        assert len(before[3]) == seq + 1
        mine = logs["a", "writer"]
        # Through the API: tenant b's session is not in tenant a's log, so nothing can be appended to it.
        with pytest.raises(SessionNotFound) as refused:
            await mine.open(session_id)
        assert refused.value.code == "SESSION_NOT_FOUND"
        with pytest.raises(SessionNotFound):
            await mine.resume(session_id)
        assert await mine.header(session_id) is None and await mine.reader.events(session_id) == []
        # Raw, as any client of tenant a's writer user could: the same subject reaches tenant a's own stream only.
        mark = log_mark(tenant_server)
        nc = await nats.connect(
            tenant_server.url,
            user=accounts.user_name("writer", "a"),
            password=TENANT_PASSWORDS["a", "writer"],
            max_reconnect_attempts=0,
        )
        try:
            ack = await publish_record(nc, session_id)
        finally:
            await nc.close()
        assert ack.stream == mine.settings.stream
        assert [r.stream_seq for r in await mine.reader.records(session_id)] == [ack.seq]
        # A session of that id created in tenant a's log is tenant a's; tenant a's admin erasing it erases only that.
        with pytest.raises(SessionLogError):
            await mine.create(session_id)  # its records are there now (the raw publish), so it exists
        await logs["a", "admin"].purge(session_id)
        assert await mine.reader.events(session_id) == []
        assert await snapshot() == before, "tenant b's log is unchanged"
        with open(tenant_server.log_path, "rb") as f:
            f.seek(mark)
            assert b"Violation" not in f.read(), "tenant a's writer needed no permission it lacks"
