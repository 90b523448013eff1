"""The README's "Put the gateway in front of your agent" is what the tests run.

Every code block of that section is either verbatim in the file named just before it (files that
`test_record_clients.py` runs as they are) or a shell block of the walkthrough, which this module runs as written:
the first block's servers in the background (the scripted provider, `sessionlog up`), then each command of the
second. Only the ports differ from the page: the machine is shared, so the default ports (the provider's 8479 in
the text; the gateway's, the embedded server's, the UI's and the metrics' through their settings) become free ones.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import REPO_ROOT

from sessionlog.embedded import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TITLE = "## Put the gateway in front of your agent"
SHOWN = {
    "examples/record_openai.py",
    "tests/node/record_chat.mjs",
    "examples/record_agents.py",
    "examples/check_mode.py",
    "examples/check_mode_sync.py",
    "examples/record_script.json",
}
COMMAND_S = 120.0  # the bound of one walkthrough command
READY_S = 60.0
STOP_S = 20.0  # the bound of a Ctrl-C stop


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    before: str  # the section's text between the previous block and this one


def section_blocks() -> list[Block]:
    readme = (REPO_ROOT / "README.md").read_text()
    start = readme.index(TITLE)
    end = readme.find("\n## ", start + len(TITLE))
    text = readme[start : end if end != -1 else len(readme)]
    blocks: list[Block] = []
    previous = 0
    for match in re.finditer(r"^```(\w*)\n(.*?)\n```$", text, flags=re.DOTALL | re.MULTILINE):
        blocks.append(Block(match.group(1), match.group(2), text[previous : match.start()]))
        previous = match.end()
    return blocks


def named_file(before: str) -> str | None:
    """The first repository file named in backticks in the paragraph that introduces a block."""
    paragraph = before.strip().split("\n\n")[-1]
    names = [n for n in re.findall(r"`([\w./-]+)`", paragraph) if (REPO_ROOT / n).is_file()]
    return names[0] if names else None


def test_every_code_block_of_the_section_is_a_file_the_tests_run_or_the_walkthrough() -> None:
    blocks = section_blocks()
    shown: set[str] = set()
    for block in blocks:
        if block.lang == "sh":
            continue
        name = named_file(block.before)
        assert name is not None, f"a {block.lang} block names no file before it:\n{block.code[:200]}"
        assert block.code in (REPO_ROOT / name).read_text(), f"the README's block differs from {name}"
        shown.add(name)
    assert shown == SHOWN
    assert [b.lang for b in blocks].count("sh") == 2, "the walkthrough: its servers, then its commands"
    runner = (REPO_ROOT / "tests" / "test_record_clients.py").read_text()
    for name in SHOWN - {"examples/record_script.json"}:
        assert Path(name).name in runner, f"{name} is shown but no test runs it"


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    servers, commands = (b.code for b in section_blocks() if b.lang == "sh")
    provider_port, gateway_port = free_port(), free_port()
    servers = servers.replace("8479", str(provider_port))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # `python`, `sessionlog`: this venv
        SESSIONLOG_DATA_DIR=str(tmp_path / "data"),
        SESSIONLOG_EMBEDDED_PORT=str(free_port()),
        SESSIONLOG_GATEWAY_PORT=str(gateway_port),
        SESSIONLOG_UI_PORT=str(free_port()),
        SESSIONLOG_METRICS_PORT=str(free_port()),
        SESSIONLOG_LEASE_TTL_S="1",
        GATEWAY_URL=f"http://127.0.0.1:{gateway_port}",
        COLUMNS="200",
    )
    (tmp_path / "examples").symlink_to(REPO_ROOT / "examples")
    background: list[subprocess.Popen[bytes]] = []
    try:
        for number, line in enumerate(servers.splitlines()):
            assert line.endswith(" &"), line
            with open(tmp_path / f"server-{number}.log", "wb") as out:
                background.append(
                    subprocess.Popen(
                        ["bash", "-c", line[:-2]], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL, start_new_session=True,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + READY_S
        urls = [f"http://127.0.0.1:{provider_port}/healthz", f"http://127.0.0.1:{gateway_port}/healthz"]
        while not all(_ready(url) for url in urls):
            assert all(p.poll() is None for p in background), _logs(tmp_path)
            assert time.monotonic() < deadline, f"not up within {READY_S}s:\n{_logs(tmp_path)}"
            time.sleep(0.2)

        outputs = []
        for line in commands.splitlines():
            done = subprocess.run(
                ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=COMMAND_S
            )
            assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
            outputs.append(done.stdout)
    finally:
        stopped = [_stop(process) for process in background]
    assert stopped == [True, True], f"Ctrl-C left a process running (then killed):\n{_logs(tmp_path)}"
    assert not _left_running(env["SESSIONLOG_EMBEDDED_PORT"]), "the embedded nats-server outlived `sessionlog up`"
    agent, _, check, transcript, audit, own = outputs
    assert "answer: 2 + 3 = 5." in agent and "answer: Doubled, that is 10." in agent
    assert check.startswith("ok: ") and "no open turn" in check
    assert "user: What is 2 + 3?" in transcript and "assistant: Doubled, that is 10." in transcript
    assert "no findings" in audit, audit
    assert "answer: 2 + 3 = 5." in own
    assert (tmp_path / "my-first-session.jsonl").is_file()


def _left_running(port: str) -> bool:
    return subprocess.run(["pgrep", "-f", "--", f"-p {port}"], capture_output=True, check=False).returncode == 0


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted(tmp_path.glob("server-*.log")))


def _stop(process: subprocess.Popen[bytes]) -> bool:
    """Ctrl-C to the whole process group, as a terminal sends it; SIGKILL if that does not stop it within the
    bound. True when Ctrl-C was enough."""
    if process.poll() is not None:
        return True
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=STOP_S)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        return False
