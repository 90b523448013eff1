"""Reliability, the load of issue 15: many concurrent sessions from several writer processes for a bounded time, with
every projection running as its own process (two context-deriver replicas claiming partitions, the token-auditor,
the ui-replayer and the repairer) and one deriver replica killed with SIGKILL midway and started again.

Checked: every session's acknowledged events are in the log once and in order; the surviving deriver takes the
dead one's partitions over and the restarted one gets a share back; every session's derivation equals its log;
no writer failed and no service quarantined anything. Measured: the lag of each projection (events behind, sampled
from its health endpoint) at p50 and p99, and the peak RSS of every service process.

The default run is 50 sessions from 2 processes for 10 s; `SESSIONLOG_RELIABILITY=full` runs 1,000 from 4 for 120 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from reliability import peak_rss_mib, percentile, record_figures, scale
from scaffold import Opened, assert_contiguous, eventually
from test_context_deriver import ServiceProcess, answered, derive, expected_reply, log_of

from sessionlog.embedded import EmbeddedServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(1800)]

WRITER = Path(__file__).resolve().parent / "reliability_writer.py"
ALL = list(range(8))
PROJECTIONS = ("context-deriver", "token-auditor", "ui-replayer", "repairer")


def start_load(url: str, prefix: str, count: int, seconds: float, workdir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SESSIONLOG_")}
    env.update(SESSIONLOG_NATS_URL=url, SESSIONLOG_METRICS_PORT="0")
    return subprocess.Popen(
        [sys.executable, str(WRITER), "--load", prefix, str(count), str(seconds)],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def component(process: ServiceProcess, name: str) -> dict[str, Any] | None:
    status, body = process.health("/healthz")
    if status != 200 or body is None:
        return None
    found: dict[str, Any] = body["components"][name]
    return found


async def test_concurrent_sessions_from_writer_processes_with_a_deriver_killed_midway(
    fresh_server: EmbeddedServer, tmp_path: Path
) -> None:
    sessions = scale(50, 1000)
    writer_processes = scale(2, 4)
    seconds = float(scale(10, 120))
    services: dict[str, ServiceProcess] = {}
    for name in ("context-deriver", "context-deriver-2", "token-auditor", "ui-replayer", "repairer"):
        workdir = tmp_path / name
        workdir.mkdir()
        service = name.removesuffix("-2")
        # Default 10 s partition leases: with the 1 s leases of the other tests, a machine this loaded (2 cores,
        # every writer process and service on it) lost and reclaimed partitions over and over and stopped applying.
        services[name] = ServiceProcess(service, fresh_server.url, workdir, SESSIONLOG_UI_PORT=str(free_port()))
        services[name].env["SESSIONLOG_LEASE_TTL_S"] = "10"
    lag: dict[str, list[float]] = {name: [] for name in services}
    loads: list[subprocess.Popen[bytes]] = []
    try:
        async with Opened(fresh_server.url) as opened:
            log = await opened.connect()  # provisions the log
            for process in services.values():
                process.start()
            for process in services.values():
                await process.wait_ready(timeout=60)
            per_process = sessions // writer_processes
            loads = [
                start_load(fresh_server.url, f"load{i}", per_process, seconds, tmp_path)
                for i in range(writer_processes)
            ]
            started = time.monotonic()
            sampling = True

            async def sample() -> None:
                while sampling:
                    for name, process in services.items():
                        health = await asyncio.to_thread(component, process, process.name)
                        # a service starting again (the restarted deriver) reports its state, no lag yet
                        lag_events = health.get("lag_events") if health is not None else None
                        if lag_events:
                            lag[name].append(float(sum(lag_events.values())))
                    await asyncio.sleep(0.25)

            sampler = asyncio.create_task(sample())
            try:
                # Midway, one deriver replica dies; the other takes its partitions over, then shares them again.
                await asyncio.sleep(seconds / 3)
                victim, survivor = services["context-deriver"], services["context-deriver-2"]
                victim.kill9()

                async def survivor_owns_all() -> bool:
                    health = await asyncio.to_thread(component, survivor, "context-deriver")
                    return health is not None and health["partitions"] == ALL

                await eventually(survivor_owns_all, "the surviving deriver takes every partition over", 90)
                victim.start()
                await victim.wait_ready(timeout=60)

                async def shared_again() -> bool:
                    a = await asyncio.to_thread(component, victim, "context-deriver")
                    b = await asyncio.to_thread(component, survivor, "context-deriver")
                    if a is None or b is None:
                        return False
                    return bool(a["partitions"]) and sorted(a["partitions"] + b["partitions"]) == ALL

                await eventually(shared_again, "the restarted deriver gets a share back, none owned twice", 120)
                outputs = []
                for proc in loads:
                    out, err = await asyncio.to_thread(proc.communicate, None, seconds + 120)
                    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
                    outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
                ran_s = time.monotonic() - started
            finally:
                sampling = False
                await sampler
            failures = [f for o in outputs for f in o["failures"]]
            assert failures == [], f"{len(failures)} writer failures, first: {failures[0]}"
            acked: dict[str, int] = {sid: seq for o in outputs for sid, seq in o["acked"].items()}
            assert len(acked) == per_process * writer_processes

            written = 0
            for sid, seq in acked.items():
                records = await log.reader.records(sid)
                assert_contiguous(records)
                count = sum(len(r.events) for r in records)
                assert count == seq + 1, f"{sid}: {seq + 1} acknowledged and closed, {count} in the log"
                written += count
            for sid, seq in acked.items():
                reply = await derive(log, {"session": sid, "min_seq": seq, "timeout_ms": 20_000}, 30)
                assert answered(reply) == expected_reply(await log_of(log, sid)), f"{sid}: derivation differs"
            rss = {name: peak_rss_mib(p.proc.pid) for name, p in services.items() if p.proc is not None}
            for name, process in services.items():
                health = component(process, process.name)
                assert health is not None, f"{name} is not serving:\n{process.output()}"
                assert health["quarantined"] == 0, f"{name} quarantined records"
    finally:
        for proc in loads:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for process in services.values():
            process.stop()
    record_figures(
        f"load: {sessions} sessions, {writer_processes} writer processes, a deriver replica killed midway",
        fault="SIGKILL of one of two context-deriver replicas at a third of the run",
        sessions=sessions,
        seconds=round(ran_s, 1),
        events_written=written,
        events_per_s=round(written / ran_s),
        faults_injected=1,
        events_lost=0,
        duplicates=0,
        errors=0,
        lag_events_p50={name: percentile(values, 50) for name, values in lag.items()},
        lag_events_p99={name: percentile(values, 99) for name, values in lag.items()},
        peak_rss_mib={name: round(v, 1) for name, v in rss.items() if v is not None},
    )
