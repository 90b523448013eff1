"""`sessionlog demo` runs end to end, offline, and passes every check it makes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from sessionlog.embedded import free_port


def test_the_demo_runs_and_every_check_passes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    ui_port = free_port()
    env.update(
        SESSIONLOG_DATA_DIR=str(tmp_path / "data"),
        SESSIONLOG_EMBEDDED_PORT=str(free_port()),
        SESSIONLOG_UI_PORT=str(ui_port),
        SESSIONLOG_GATEWAY_PORT=str(free_port()),
        COLUMNS="160",
    )
    # a running `sessionlog up` holds the configured UI port: the demo serves its own UI elsewhere meanwhile, and
    # the page it points at is the one that outlives it
    with socket.socket() as up_ui:
        up_ui.bind(("127.0.0.1", ui_port))
        up_ui.listen()
        done = subprocess.run(
            [sys.executable, "-m", "sessionlog", "demo"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "FAILED" not in done.stdout
    for check in (
        "parallel tool calls answered",
        "compaction replaces turn 1",
        "writer process killed during the tool body",
        "repairer closers",
        "injected message refused",
        "fork inside an open turn is refused",
        "token audit finds nothing wrong",
    ):
        assert check in done.stdout
    assert f"http://127.0.0.1:{ui_port}/sessions/demo-" in done.stdout.replace("\n", "")
    # the embedded server the demo started is gone again
    assert (
        subprocess.run(["pgrep", "-f", "--", f"-p {env['SESSIONLOG_EMBEDDED_PORT']}"], capture_output=True).returncode
        != 0
    )
