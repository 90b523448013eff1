"""Import and export between JSONL files and the JetStream log, and the CLI commands that do it.

Import and export are lossless copies: every real dsh log goes in and comes out with the same events, a file
with seqs comes back byte for byte (plain and zstd), and a file that is refused leaves nothing visible.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import FIXTURES_DIR, normalize_fixture
from natsfixtures import log_settings, new_session_id

from bench.synth import LogBuilder
from sessionlog.embedded import free_port
from sessionlog.errors import SessionLogError
from sessionlog.jsonl import encode_jsonl, parse_jsonl, read_jsonl, write_jsonl
from sessionlog.log import SessionLog
from sessionlog.session import Session
from sessionlog.settings import Settings

pytest_plugins = ["natsfixtures"]
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

FIXTURE_FILES = sorted(FIXTURES_DIR.glob("*.jsonl"))
CLI_TIMEOUT_S = 60.0


def normalized_fixture(path: Path) -> bytes:
    return normalize_fixture(path.read_bytes())


def header_line(session_id: str, **extra: Any) -> bytes:
    header = {"type": "session", "version": 0, "id": session_id, "createdAt": 1_780_000_000_000, **extra}
    header.setdefault("delegationDepth", 0)
    return msgspec.json.encode(header)


def synthetic_events(turns: int = 3) -> list[bytes]:
    """A log with seqs and times whose delta runs pack into chunk rows (bench/synth.py)."""
    builder = LogBuilder()
    for _ in range(turns):
        builder.turn_with_tools(deltas=12, tools=2)
    return builder.events


async def assert_invisible(log: SessionLog, session_id: str) -> None:
    assert await log.header(session_id) is None
    assert session_id not in {s.id for s in await log.sessions()}
    assert await log.reader.events(session_id) == [], "nothing was written"


# ---------------------------------------------------------------------------------------------- library


async def test_every_dsh_fixture_is_here() -> None:
    assert len(FIXTURE_FILES) == 81


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=[p.name.removesuffix(".jsonl")[-60:] for p in FIXTURE_FILES])
async def test_every_dsh_log_imports_and_exports_with_the_same_events(
    log: SessionLog, path: Path, tmp_path: Path
) -> None:
    source = parse_jsonl(normalized_fixture(path))
    sid = new_session_id("dsh")
    assert await log.import_log(source, session_id=sid) == (sid, len(source.events))

    out = tmp_path / "exported.jsonl"
    assert await log.export_file(sid, out) == len(source.events)
    exported = read_jsonl(out)
    assert exported.events == source.events
    assert exported.torn is None
    assert exported.header.id == sid
    original = msgspec.json.decode(source.header_raw)
    assert msgspec.json.decode(exported.header_raw) == {**original, "id": sid}, "only the id changed"
    Session(exported.events)  # and the copy is still a valid log


@pytest.mark.parametrize("name", ["log.jsonl", "log.jsonl.zstd"])
async def test_a_file_with_seqs_round_trips_byte_for_byte(log: SessionLog, tmp_path: Path, name: str) -> None:
    sid = new_session_id("rt")
    original = tmp_path / name
    events = synthetic_events()
    write_jsonl(original, header_line(sid, cwd="/repo"), events)
    assert b'"text-chunks"' in encode_jsonl(header_line(sid), events), "packed rows are part of the round trip"

    assert await log.import_file(original) == (sid, len(events))
    copy = tmp_path / f"copy-{name}"
    await log.export_file(sid, copy)
    assert copy.read_bytes() == original.read_bytes()


async def test_a_header_only_log_imports_as_an_empty_session_and_exports_as_the_same_file(
    log: SessionLog, tmp_path: Path
) -> None:
    sid = new_session_id("empty")
    original = tmp_path / "empty.jsonl"
    write_jsonl(original, header_line(sid), [])
    assert await log.import_file(original) == (sid, 0)
    assert {s.id: s.events for s in await log.sessions()}[sid] == 0
    await log.export_file(sid, tmp_path / "copy.jsonl")
    assert (tmp_path / "copy.jsonl").read_bytes() == original.read_bytes()


async def test_an_import_never_appends_closers_to_a_log_left_mid_turn(log: SessionLog) -> None:
    events = synthetic_events(1)[:-3]  # cut inside the answering step: turn and step left open
    sid = new_session_id("open")
    await log.import_log(parse_jsonl(header_line(sid) + b"\n" + b"".join(e + b"\n" for e in events)))
    assert await log.reader.events(sid) == events
    assert {s.id: s.open_turn for s in await log.sessions()}[sid] == 1


async def test_an_invalid_log_is_refused_before_anything_is_sent(log: SessionLog) -> None:
    events = synthetic_events(2)
    bad = list(events)
    bad[len(bad) // 2 + 1] = bad[len(bad) // 2 + 1].replace(b'"turn":2', b'"turn":7', 1)
    sid = new_session_id("bad")
    with pytest.raises(SessionLogError) as refused:
        await log.import_log(parse_jsonl(header_line(sid) + b"\n" + b"".join(e + b"\n" for e in bad)))
    assert refused.value.code == "STRUCTURE_INVALID"
    await assert_invisible(log, sid)


async def test_an_import_with_an_event_too_large_for_a_record_sends_nothing(provisioned: Settings) -> None:
    assert provisioned.nats_url is not None
    small = await SessionLog.connect(log_settings(provisioned.nats_url, write_max_bytes=4096))
    try:
        builder = LogBuilder()
        for _ in range(3):
            builder.turn_with_tools(deltas=20, tools=2)  # several records' worth at a 3 KB bound
        builder.turn += 1
        builder.add("turn/start", {"turn": builder.turn})
        builder.add("todo/write", {"todos": [{"content": "z" * 8000, "status": "pending"}]})
        sid = new_session_id("large")
        source = parse_jsonl(header_line(sid) + b"\n" + b"".join(e + b"\n" for e in builder.events))
        with pytest.raises(SessionLogError) as refused:
            await small.import_log(source)
        assert refused.value.code == "EVENT_TOO_LARGE"
        assert await small.header(sid) is None
        assert await small.reader.events(sid) == [], "nothing is sent for a refused import"
    finally:
        await small.close()


# ---------------------------------------------------------------------------------------------- the CLI


class Cli:
    """`sessionlog ...` in a child process, talking to the test server through SESSIONLOG_NATS_URL."""

    def __init__(self, url: str, cwd: Path) -> None:
        self.cwd = cwd
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
        self.env.update(SESSIONLOG_NATS_URL=url, COLUMNS="200", PYTHONUNBUFFERED="1")

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sessionlog",
            *args,
            cwd=self.cwd,  # no stray .env file
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def run(self, *args: str) -> tuple[int, bytes, str]:
        process = await self.start(*args)
        try:
            out, err = await asyncio.wait_for(process.communicate(), CLI_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            pytest.fail(f"sessionlog {' '.join(args)} did not finish within {CLI_TIMEOUT_S}s")
        assert process.returncode is not None
        return process.returncode, out, err.decode()


@pytest.fixture
def cli(provisioned: Settings, tmp_path: Path) -> Cli:
    assert provisioned.nats_url is not None
    return Cli(provisioned.nats_url, tmp_path)


async def test_cli_import_export_sessions_and_tail_work_against_the_server(
    cli: Cli, log: SessionLog, tmp_path: Path
) -> None:
    sid = new_session_id("cli")
    original = tmp_path / "in.jsonl.zstd"
    events = synthetic_events(2)
    write_jsonl(original, header_line(sid), events)

    code, out, err = await cli.run("import", str(original), "--id", sid)
    assert (code, out.decode().strip(), err) == (0, f"imported {sid}: {len(events)} events", "")

    copy = tmp_path / "out.jsonl.zstd"
    code, out, err = await cli.run("export", sid, "-o", str(copy))
    assert code == 0 and err == "" and out.decode().strip() == f"exported {sid}: {len(events)} events -> {copy}"
    assert copy.read_bytes() == original.read_bytes()
    # The read-only commands, side by side (each is a process start).
    stdout, as_json, table, head, middle = await asyncio.gather(
        cli.run("export", sid),  # no -o: plain JSONL on stdout
        cli.run("sessions", "--json"),
        cli.run("sessions"),
        cli.run("tail", sid, "--limit", "5"),
        cli.run("tail", sid, "--from-seq", "10", "--limit", "3"),
    )
    assert stdout[0] == 0 and stdout[1] == encode_jsonl(header_line(sid), events)
    listed = {info["id"]: info for info in map(msgspec.json.decode, as_json[1].splitlines())}
    assert as_json[0] == 0 and listed[sid]["events"] == len(events) and listed[sid]["open_turn"] is None
    assert table[0] == 0 and sid in table[1].decode()
    assert head[0] == 0 and head[1].splitlines() == events[:5]
    assert middle[0] == 0 and middle[1].splitlines() == events[10:13]


async def test_cli_tail_follows_events_appended_while_it_runs(cli: Cli, log: SessionLog) -> None:
    sid = new_session_id("tail")
    writer = await log.create(sid)
    try:
        first = await writer.emit("turn/start", {"turn": 1})
        await writer.flush()
        tail = await cli.start("tail", sid, "--limit", "3")
        assert tail.stdout is not None
        line = await asyncio.wait_for(tail.stdout.readline(), CLI_TIMEOUT_S)
        assert line == first.raw + b"\n", "replays what is there"
        later = [await writer.emit("todo/write", {"todos": []}), await writer.emit("todo/write", {"todos": []})]
        await writer.flush()
        out, _ = await asyncio.wait_for(tail.communicate(), CLI_TIMEOUT_S)
        assert tail.returncode == 0
        assert out.splitlines() == [e.raw for e in later], "then follows live and stops at --limit"
    finally:
        await writer.close()


async def test_cli_refusals_are_one_error_line_and_leave_nothing_visible(
    cli: Cli, log: SessionLog, tmp_path: Path
) -> None:
    events = synthetic_events(2)
    corrupt = tmp_path / "corrupt.jsonl"
    lines = [e + b"\n" for e in events]
    lines[5] = b'{"seq":5,"type":"assistant/chunk","data":{\n'  # a torn line in the middle, turn/ends after it
    corrupt.write_bytes(header_line("whatever") + b"\n" + b"".join(lines))
    invalid = tmp_path / "invalid.jsonl"
    renumbered = list(events)
    renumbered[-1] = renumbered[-1].replace(b'"turn":2', b'"turn":3', 1)  # a turn/end of a turn that is not open
    invalid.write_bytes(header_line("whatever") + b"\n" + b"".join(e + b"\n" for e in renumbered))

    refused = [(corrupt, "CORRUPT_LOG", new_session_id("refused")), (invalid, "STRUCTURE_INVALID", new_session_id("x"))]
    missing = new_session_id("missing")
    commands = [("import", str(path), "--id", sid) for path, _, sid in refused] + [
        ("export", missing, "-o", str(tmp_path / "x.jsonl")),
        ("tail", missing),
        ("import", str(tmp_path / "nope.jsonl")),
        ("import", str(invalid), "--id", "bad.id"),
    ]
    results = await asyncio.gather(*(cli.run(*args) for args in commands))
    expected = ["CORRUPT_LOG", "STRUCTURE_INVALID", "SESSION_NOT_FOUND", "SESSION_NOT_FOUND", "", "INVALID_SESSION_ID"]
    for args, (code, out, err), code_name in zip(commands, results, expected, strict=True):
        assert code in (1, 2) and out == b"", (args, code, out)
        assert len(err.splitlines()) == 1 and err.startswith(f"error {code_name}".strip()), (args, err)
    for _, _, sid in refused:
        await assert_invisible(log, sid)
    assert not (tmp_path / "x.jsonl").exists()


async def test_cli_log_commands_with_no_server_listening_print_one_log_unavailable_line(tmp_path: Path) -> None:
    cli = Cli(f"nats://127.0.0.1:{free_port()}", tmp_path)
    original = tmp_path / "in.jsonl"
    write_jsonl(original, header_line("offline"), synthetic_events(1))
    commands = [
        ("sessions",),
        ("export", "offline"),
        ("import", str(original)),
        ("tail", "offline"),
        ("purge", "offline", "--yes"),
    ]
    results = await asyncio.gather(*(cli.run(*args) for args in commands))
    for args, (code, out, err) in zip(commands, results, strict=True):
        assert code == 1 and out == b"", (args, code, out, err)
        assert len(err.splitlines()) == 1 and err.startswith("error LOG_UNAVAILABLE: cannot connect"), (args, err)
