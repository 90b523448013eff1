"""`sessionlog up` starts the whole system, serves the transcript page and the gateway, and stops cleanly on
SIGINT with no process left behind; the demo's session runs on a 3-node cluster with R3 streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from natsfixtures import start_cluster

from sessionlog.embedded import free_port, port_open


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(
        SESSIONLOG_DATA_DIR=str(tmp_path / "data"),
        SESSIONLOG_EMBEDDED_PORT=str(free_port()),
        SESSIONLOG_UI_PORT=str(free_port()),
        SESSIONLOG_GATEWAY_PORT=str(free_port()),
        SESSIONLOG_METRICS_PORT=str(free_port()),
        COLUMNS="160",
    )
    env.update(extra)
    return env


def _alive(pattern: str) -> bool:
    return subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, check=False).returncode == 0


def test_up_serves_the_transcript_page_and_the_gateway_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    env = _env(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sessionlog", "up"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        ui = f"http://127.0.0.1:{env['SESSIONLOG_UI_PORT']}/"
        gateway = f"http://127.0.0.1:{env['SESSIONLOG_GATEWAY_PORT']}/healthz"
        ready = f"http://127.0.0.1:{env['SESSIONLOG_METRICS_PORT']}/readyz"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(ready, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        page = httpx.get(ui, timeout=5)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert httpx.get(gateway, timeout=5).status_code == 200
        refused = httpx.post(
            f"http://127.0.0.1:{env['SESSIONLOG_GATEWAY_PORT']}/v1/chat/completions",
            json={"model": "m", "messages": []},
            headers={"X-Session-Id": "nope"},
            timeout=10,
        )
        assert refused.status_code >= 400  # the gateway answers, and refuses what the log does not hold
        assert _alive(f"-p {env['SESSIONLOG_EMBEDDED_PORT']}"), "the embedded nats-server runs"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "sessionlog is up" in out and "sessionlog stopped" in out
    assert not _alive(f"-p {env['SESSIONLOG_EMBEDDED_PORT']}"), "no nats-server left behind"
    for port in ("SESSIONLOG_UI_PORT", "SESSIONLOG_GATEWAY_PORT", "SESSIONLOG_METRICS_PORT"):
        assert not port_open("127.0.0.1", int(env[port])), f"{port} still served"


def test_the_demo_session_runs_on_a_three_node_cluster_with_r3(tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "cluster")
    try:
        env = _env(tmp_path, SESSIONLOG_NATS_URL=cluster.url, SESSIONLOG_REPLICAS="3")
        done = subprocess.run(
            [sys.executable, "-m", "sessionlog", "demo"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert "FAILED" not in done.stdout
        info = subprocess.run(
            [sys.executable, "-c", _R3_PROBE, cluster.url], capture_output=True, text=True, timeout=60, check=False
        )
        assert info.stdout.strip() == "3", info.stdout + info.stderr
    finally:
        for server in cluster.servers:
            server.kill()


_R3_PROBE = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1].split(","))
    info = await nc.jetstream().stream_info("SESSIONLOG")
    print(info.config.num_replicas)
    await nc.close()
asyncio.run(main())
"""
