"""The offline CLI on JSONL files: the acceptance checks drive exactly these commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from conftest import FIXTURES_DIR, dsh_header_problem, normalize_fixture

from services.cli import main as installed_main
from sessionlog.cli import main
from sessionlog.embedded import free_port
from sessionlog.jsonl import read_jsonl
from sessionlog.repair import interrupted_turn_closers
from sessionlog.session import Session

PARALLEL = FIXTURES_DIR / "acp-agent-parallel-tool-calls-session.jsonl"
UNKNOWN = (
    FIXTURES_DIR / "examples__headless-agent__tests__semantic-checkpoint-snapshots__tool-outcome-unknown-session.jsonl"
)


def normalized(src: Path, dst: Path) -> Path:
    """The fixture with the recorder's `"{{tools}}"` placeholder replaced by an empty list."""
    dst.write_bytes(normalize_fixture(src.read_bytes()))
    return dst


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def parallel(tmp_path: Path) -> Path:
    return normalized(PARALLEL, tmp_path / "parallel.jsonl")


def test_check_prints_a_one_line_summary(capsys: pytest.CaptureFixture[str], parallel: Path) -> None:
    code, out, err = run(capsys, "check", str(parallel))
    assert code == 0 and err == ""
    assert out.count("\n") == 1
    assert "32 events" in out and "1 turns" in out and "no open turn" in out and "no torn tail" in out


def test_check_reports_the_first_violation_with_code_and_seq(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"type":"session","version":0,"id":"s","createdAt":1}\n'
        '{"seq":0,"time":1,"type":"turn/start","data":{"turn":1}}\n'
        '{"seq":1,"time":1,"type":"turn/start","data":{"turn":2}}\n'
    )
    code, out, err = run(capsys, "check", str(bad))
    assert code == 1 and out == ""
    assert err.startswith("error STRUCTURE_INVALID at seq 1: ")
    assert err.count("\n") == 1


def test_check_reports_a_torn_tail_as_dropped(capsys: pytest.CaptureFixture[str], parallel: Path) -> None:
    data = parallel.read_bytes()
    parallel.write_bytes(data[: data.index(b"\n", 2000) + 30])  # cut inside a line
    code, out, _ = run(capsys, "check", str(parallel))
    assert code == 0
    assert "torn tail dropped at line" in out and "turn 1 open" in out


def test_derive_prints_the_messages_of_the_prefix_inclusive(capsys: pytest.CaptureFixture[str], parallel: Path) -> None:
    code, out, _ = run(capsys, "derive", str(parallel), "--at", "4")
    assert code == 0
    messages = json.loads(out)
    assert len(messages) == 1 and messages[0]["role"] == "user"
    session = Session(read_jsonl(parallel).events)
    code, out, _ = run(capsys, "derive", str(parallel))
    assert json.loads(out) == [json.loads(m.raw) for m in session.derive_messages()]


def test_transcript_json_entries_carry_their_seq(capsys: pytest.CaptureFixture[str], parallel: Path) -> None:
    code, out, _ = run(capsys, "transcript", str(parallel), "--json")
    assert code == 0
    entries = json.loads(out)
    session = Session(read_jsonl(parallel).events)
    assert [e["seq"] for e in entries] == [e.seq for e in session.transcript()]
    assert all(e["type"] in {"user/message", "assistant/message", "tool/result"} for e in entries)


def test_transcript_text_is_readable(capsys: pytest.CaptureFixture[str], parallel: Path) -> None:
    code, out, _ = run(capsys, "transcript", str(parallel))
    assert code == 0
    assert "--- turn 1 ---" in out and "read(" in out and "tool result" in out


def test_repair_prints_closers_and_write_appends_them_durably(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = normalized(UNKNOWN, tmp_path / "u.jsonl")
    log = read_jsonl(path)
    prefix = tmp_path / "prefix.jsonl"
    lines = path.read_bytes().split(b"\n")
    prefix.write_bytes(b"\n".join(lines[:6]) + b"\n")  # header + seqs 0..4: the tool/call is durable
    code, out, _ = run(capsys, "repair", str(prefix))
    assert code == 0
    closers = [line.encode() for line in out.splitlines()]
    assert closers == list(interrupted_turn_closers(Session(log.events[:5])))
    assert b"TOOL_OUTCOME_UNKNOWN" in closers[0]
    code, out, _ = run(capsys, "repair", str(prefix), "--write")
    assert code == 0
    repaired = read_jsonl(prefix)
    assert repaired.events[5:] == closers and Session(repaired.events).open_turn is None
    code, out, _ = run(capsys, "repair", str(prefix))
    assert code == 0 and out == ""  # nothing is open any more


def test_repair_write_refuses_a_prefix(capsys: pytest.CaptureFixture[str], parallel: Path) -> None:
    before = parallel.read_bytes()
    code, _, err = run(capsys, "repair", str(parallel), "--at", "3", "--write")
    assert code == 2 and "whole file" in err
    assert parallel.read_bytes() == before


def test_fork_writes_the_child_and_refuses_inside_an_open_turn(
    capsys: pytest.CaptureFixture[str], parallel: Path, tmp_path: Path
) -> None:
    child = tmp_path / "child.jsonl"
    code, _, err = run(capsys, "fork", str(parallel), "--at", "5", "--id", "kid", "-o", str(child))
    assert code == 1 and err.startswith("error OPEN_TURN at seq 5:")
    assert not child.exists()
    code, _, _ = run(capsys, "fork", str(parallel), "--at", "31", "--id", "kid", "-o", str(child))
    assert code == 0
    forked = read_jsonl(child)
    assert forked.header.id == "kid" and forked.header.seed_length == 32
    child_header = json.loads(forked.header_raw)
    assert child_header["cwd"] == "{{cwd}}"  # the recorder's placeholder, copied from the parent
    child_header["cwd"] = "/cwd"
    assert "origin" not in child_header and dsh_header_problem(child_header) is None, child_header
    assert forked.events[:32] == read_jsonl(parallel).events
    assert b"session/end-seed" in forked.events[32]
    code, _, err = run(capsys, "fork", str(parallel), "--id", "kid", "-o", str(child))
    assert code == 1 and err.startswith("error SESSION_ALREADY_EXISTS")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["derive", "{file}", "--at", "abc"], "error: Invalid value for '--at'"),
        (["derive", "{file}", "--at", "999"], "error INVALID_BOUNDARY"),
        (["check", "/no/such/file.jsonl"], "error SESSION_NOT_FOUND"),
        (["fork", "{file}", "--id", "bad id!", "-o", "{tmp}/x.jsonl"], "error INVALID_SESSION_ID"),
        (["nonsense"], "error: No such command"),
        (["check"], "error: Missing argument"),
    ],
)
def test_bad_arguments_give_one_clear_line(
    capsys: pytest.CaptureFixture[str], parallel: Path, tmp_path: Path, args: list[str], needle: str
) -> None:
    argv = [a.format(file=parallel, tmp=tmp_path) for a in args]
    code, _, err = run(capsys, *argv)
    assert code != 0
    assert err.startswith(needle) and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json\n",
        b'{"type":"session","version":7,"id":"s","createdAt":1}\n',
        b'{"type":"session","version":0,"id":"s","createdAt":1}\n{"seq":0,"type":"turn/start"}\n',
        b'{"type":"session","version":0,"id":"s","createdAt":1}\n{"seq":0,"type":"mystery","data":{}}\n',
    ],
)
def test_bad_files_give_one_clear_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    code, _, err = run(capsys, "check", str(path))
    assert code == 1
    assert err.startswith("error ") and err.count("\n") == 1


def test_the_console_script_runs_as_a_process(parallel: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sessionlog", "check", str(parallel)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: 32 events")


def test_the_scripted_provider_command_serves_its_script_until_terminated(tmp_path: Path) -> None:
    script = tmp_path / "replies.jsonl"
    script.write_text('# one reply a line\n{"text": "hello from the script"}\n')
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    argv = [sys.executable, "-m", "sessionlog", "scripted-provider", "--script", str(script), "--port", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = None
        deadline = time.monotonic() + 20
        while reply is None and time.monotonic() < deadline:
            try:
                reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            except openai.APIConnectionError:
                assert proc.poll() is None, "the scripted provider exited"
                time.sleep(0.05)
        assert reply is not None and reply.choices[0].message.content == "hello from the script"
        with pytest.raises(openai.InternalServerError, match="script exhausted"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    assert f"scripted provider on http://127.0.0.1:{port}/v1 (1 replies)" in out


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no script file"),
        ('[{"text": "ok"}, 3]', "not a script of replies: Expected `object`, got `int` - at `$[1]`"),
        ("{oops\n", "not a script of replies: not JSON"),
        ('"a string"\n', "not a script of replies: Expected `object`, got `str` - at `$[0]`"),
        ('[{"text": "ok", "delay": 2}]', "Object contains unknown field `delay` - at `$[0]`"),  # delay_s misspelt
        ('[{"text": "ok"}, {"delay_s": "2"}]', "Expected `float`, got `str` - at `$[1].delay_s`"),
        ('[{"chunk_delay_s": -1}]', "Expected `float` >= 0.0 - at `$[0].chunk_delay_s`"),
        ('[{"status": 1000}]', "Expected `int` <= 599 - at `$[0].status`"),
        ('{"tool_calls": [{"id": "c1"}]}\n', "Object missing required field `name` - at `$[0].tool_calls[0]`"),
        (b'[{"text": "\xff\xfe"}]', "not a script of replies: not UTF-8 text"),
    ],
)
def test_the_scripted_provider_command_refuses_a_bad_script_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | bytes | None, expected: str
) -> None:
    script = tmp_path / "replies.json"
    if isinstance(content, bytes):
        script.write_bytes(content)
    elif content is not None:
        script.write_text(content)
    code = installed_main(["scripted-provider", "--script", str(script), "--port", str(free_port())])
    err = capsys.readouterr().err
    assert code == 2
    assert expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize("depth", [70, 3000])
def test_a_file_whose_event_nests_too_deep_is_one_typed_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, depth: int
) -> None:
    """Past MAX_EVENT_DEPTH, and far past Python's recursion limit: `EVENT_TOO_DEEP`, never a traceback."""
    path = tmp_path / "deep.jsonl"
    nested = "[" * depth + "]" * depth
    header = '{"type":"session","version":0,"id":"deep","createdAt":1}'
    path.write_text(header + '\n{"seq":0,"time":1,"type":"session/title","data":{"t":' + nested + "}}\n")
    code, out, err = run(capsys, "derive", str(path))
    assert code == 1 and out == ""
    assert err.startswith("error EVENT_TOO_DEEP at seq 0:"), err


def test_the_text_transcript_shows_control_characters_escaped_never_raw() -> None:
    """A user message can hold terminal control sequences (a title change, an OSC 52 clipboard write, BEL, a
    carriage return that hides what came before it); `sessionlog transcript` prints them as `\\x1b`, never raw to
    the operator's terminal (found probing record mode, 2026-12-05). Newlines and tabs stay."""
    from sessionlog.events import encode_new_event
    from sessionlog.transcript import build_transcript, transcript_plain

    hostile = "title \x1b]0;pwned\x07 clip \x1b]52;c;cm0gLXJmIH4=\x07 hidden\rshown \x9b31m del\x7f\nline two\tok"
    session = Session()
    for kind, data, surface in (
        ("turn/start", {"turn": 1}, {}),
        ("user/message", {"id": "u1", "role": "user", "source": {"kind": "user"},
                          "content": [{"type": "text", "text": hostile}]}, {"surface_op": "append"}),
        ("turn/end", {"turn": 1, "reason": {"kind": "completed"}}, {}),
    ):  # fmt: skip
        session.append(encode_new_event(kind, data, seq=len(session), time=0, **surface))
    text = transcript_plain(build_transcript(session))
    assert not any(ch in text for ch in "\x1b\x07\r\x9b\x7f"), repr(text)
    assert "\\x1b]0;pwned\\x07" in text and "hidden\\x0dshown" in text and "\\x9b31m" in text
    assert "\nline two\tok" in text


HOSTILE_CELLS = ("gpt[/x]", "[bold red]loud[/bold red]", "m\x1b[31mred", "a\x1b]52;c;cm0=\x07b")


@pytest.mark.parametrize("hostile", HOSTILE_CELLS)
def test_the_audit_report_prints_what_a_client_sent_as_text_never_as_markup(hostile: str) -> None:
    """A model name, provider and finding are what a client or provider sent: `sessionlog audit` prints them as they
    are (Rich markup neither read nor raising, `gpt[/x]` crashed the command with MarkupError) and control characters
    escaped (found probing record mode, 2026-12-05)."""
    import io

    from rich.console import Console

    from sessionlog.cli.auditcmds import print_report

    tokens = {"requests": 1, "input_tokens": 3, "output_tokens": 4}
    report = {
        "session": "s1",
        "ledger": {"by_model": [{"provider": hostile, "model": hostile, "tokens": tokens}], "total": tokens},
        "provider_ledger": {"by_model": [{"model": hostile, "tokens": tokens}], "total": tokens},
        "ledger_difference": [f"model {hostile} differs"],
        "findings": [{"code": "RAW_STREAM_DIFFERS", "seq": 4, "turn": 1, "step": 1, "message": f"saw {hostile}"}],
    }
    out = io.StringIO()
    print_report(report, Console(file=out, width=400, color_system=None))
    text = out.getvalue()
    shown = hostile.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
    assert text.count(shown) == 5, text  # provider and model, the provider's model, the difference, the finding
    assert "\x1b" not in text and "\x07" not in text


@pytest.mark.parametrize("hostile", HOSTILE_CELLS)
def test_the_quarantine_listing_prints_a_reason_as_text_never_as_markup(hostile: str) -> None:
    import io

    from rich.console import Console

    from sessionlog.cli.quarantinecmds import quarantine_table
    from sessionlog.quarantine import Quarantined

    entry = Quarantined(projection="ui-replayer", stream_seq=7, session_id="s1", reason=f"bad record: {hostile}")
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(quarantine_table([entry]))
    shown = hostile.replace("\x1b", "\\x1b").replace("\x07", "\\x07")
    assert f"bad record: {shown}" in out.getvalue() and "\x1b" not in out.getvalue()
